#!/usr/bin/env bash
# The verl peer of bench_e2e.py for the H200 (no network there): verl 0.9.1 and what its GRPO `main_ppo` imports
# that the device lacks, as one xz archive split into parts of at most 60 MB under .gpu_verl1/, .gpu_verl2/, ...
# (git-ignored by .gitignore's /.gpu*/). bench/verl_device_install.sh reassembles it there into /tmp/verl_site,
# which bench_e2e.py puts on the PYTHONPATH of the verl subprocess only. Run it here in the project root:
#   bash bench/build_verl_payload.sh          (about 2 minutes, most of it xz)
# Versions (bench/README.md, "verl as a peer"): verl 0.9.1's `vllm` extra pins torch 2.11.0, vllm 0.24.0 and
# transformers 5.9.0, the device's torch and our vLLM payload; transformers 5.9.0 travels because verl wants
# <5.11 and the device has 5.17. tensordict 0.10.0 is the one release both verl (<=0.10.0) and TransferQueue
# (>=0.10.0, the store of verl's default v1 trainer) accept. ray 2.56.1 and peft 0.20.0 are the last releases
# before verl 0.9.1 (2026-09-20). ray is core only (no dashboard): a local cluster needs nothing more.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
W=${VERL_PAYLOAD_WORK:-/tmp/flatrl-verl-payload}
PART_BYTES=${VERL_PART_BYTES:-60000000}
rm -rf "$W/always" "$W/wheels" "$W/stage" && mkdir -p "$W/always" "$W/wheels" "$W/stage/site" "$W/stage/wheels"
P="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
   --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
pipdl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P "$@"; }
# Always installed into /tmp/verl_site (the device has none of them, or, for transformers, the wrong version).
pipdl -d "$W/always" verl==0.9.1 transformers==5.9.0 ray==2.56.1 transferqueue==0.1.11 tensordict==0.10.0 \
  pyvers==0.1.0 torchdata==0.11.0 hydra-core==1.3.8 omegaconf==2.3.0 codetiming==1.4.0 pylatexenc==2.11 \
  peft==0.20.0 orjson==3.13.0
# hydra-core 1.3.8 wants antlr4-python3-runtime 4.9.*, which PyPI has only as an sdist (pure Python): build it.
python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$W/always" antlr4-python3-runtime==4.9.3
# Installed on the device only where it has no version that satisfies the payload's requirements
# (verl_device_install.sh decides): what transformers 5.9, ray, datasets and the rest need, from a walk of
# their wheels' Requires-Dist (bench/README.md). tokenizers 0.22.2: transformers 5.9 wants <=0.23.0.
pipdl -d "$W/wheels" tokenizers==0.22.2 huggingface-hub==1.33.0 safetensors==0.8.0 regex==2026.11.19 \
  tqdm==4.70.1 pyyaml==6.0.4 packaging==26.4 filelock==4.3.2 typer==0.29.2 click==8.5.1 shellingham==1.5.4 \
  rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 annotated-doc==0.0.7 hf-xet==1.8.0 \
  httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 certifi==2026.10.19.post1 idna==3.20 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
  msgpack==1.2.4 protobuf==6.33.6 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 \
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 \
  yarl==1.25.1 cloudpickle==3.1.3 datasets==5.2.0 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0 \
  uvicorn==0.55.0 prometheus-client==0.26.0 \
  watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 \
  prometheus-fastapi-instrumentator==8.1.0 python-multipart==0.0.34 uvloop==0.23.0
# verl serves its rollout through vLLM's OpenAI server (build_app, uvicorn), a path of vLLM that the vLLM payload
# (made for the offline LLM path) never ran: what that path imports, found by reading vllm 0.24's entrypoints and
# its Requires-Dist, is a root of the device's choice too (FastAPI wants python-multipart for the form routes),
# and so is aiohttp, which verl's reward loop imports but lists only through ray[default].
printf '%s\n' aiohttp uvicorn watchfiles model-hosting-container-standards "prometheus-fastapi-instrumentator>=8.0.0" \
  python-multipart uvloop > "$W/stage/roots"
# Unzip keeping the file modes: ray starts its raylet and gcs_server binaries from inside the package.
python3 - "$W/always" "$W/stage/site" <<'EOF'
import os, sys, zipfile, pathlib
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            path = z.extract(info, sys.argv[2])
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode)
EOF
# What the GRPO run never loads: the Java worker (33 MB), the dashboard's web front end, RLlib.
rm -rf "$W"/stage/site/ray/jars "$W"/stage/site/ray/dashboard/client/build "$W"/stage/site/ray/rllib
cp "$W"/wheels/*.whl "$W/stage/wheels/"
tar -C "$W/stage" -cf - site wheels roots | xz -T2 -6 > "$W/verl.tar.xz"
size=$(stat -c %s "$W/verl.tar.xz"); n=$(( (size + PART_BYTES - 1) / PART_BYTES ))
rm -rf .gpu_verl[0-9]*
split -b "$PART_BYTES" -d -a 1 "$W/verl.tar.xz" "$W/part."
for i in $(seq 1 "$n"); do mkdir -p ".gpu_verl$i"; mv "$W/part.$((i - 1))" ".gpu_verl$i/verl.part$i"; done
echo "$n" > ".gpu_verl$n/nparts"
sha256sum "$W/verl.tar.xz" | cut -c1-16 > ".gpu_verl$n/sha256"
ls -la .gpu_verl*
echo "verl payload $(( size / 1048576 )) MiB in $n part(s); carry one folder per call, back to back (bench/README.md)"
