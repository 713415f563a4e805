#!/usr/bin/env bash
# Every figure of bench/README.md on one H200, in two device calls of under 10 minutes each, after vLLM 0.24 is
# installed per the workplace GPU notes (three back-to-back calls; this goes in the third or a later one):
#
#   call A:  source .gpu3/device_install.sh && FLATRL_COMMIT=<sha> bash bench/run_h200.sh 1   # 7.5 min measured
#   call B:  source .gpu3/device_install.sh && FLATRL_COMMIT=<sha> bash bench/run_h200.sh 2   # 5 min measured
#   call C (optional): ... bash bench/run_h200.sh 3   # flatrl e2e with gradient checkpointing
#   call D (optional): ... bash bench/run_h200.sh 4   # e2e against TRL with --offload-optimizer
# both with carry [".gpu3", ".gpu_trl"]
#
# A: the attention check, rollout (0.5B), weight push (0.5B, 1.5B), the GPU tests; B: policy update (0.5B,
# 1.5B), end to end against TRL (0.5B). FLATRL_COMMIT goes into every JSON (the device's copy has no .git).
# (the durations are estimates from the device baselines in bench/README.md, not measurements). TRL is
# optional: carry .gpu_trl/ (bench/build_trl_payload.sh) with call B and it is unpacked into /tmp/site;
# without it bench_e2e.py reports TRL as skipped. Each bench writes one JSON file under $OUT (6 at most, plus
# this script's log), so the files come back even when a later bench fails or the call runs out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-1}
OUT=${OUT:-/tmp/flatrl-bench-out}
WORK=/tmp/flatrl-bench            # models are built once per machine and reused by later calls
mkdir -p "$OUT" "$WORK"
log="$OUT/run_h200_part$part.log"
exec > >(tee -a "$log") 2>&1
echo "== run_h200.sh part $part, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# tyro (config.py) and TRL are not on the device: carry .gpu_trl/ (bench/build_trl_payload.sh) with both parts.
if [ -d .gpu_trl ] && [ ! -d /tmp/site/tyro ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_trl/*.whl
fi
python3 -c "import tyro" || echo "== tyro is missing: carry .gpu_trl (bench/build_trl_payload.sh); grpo.py and toy.py fail without it"

run() {  # run NAME CMD...: one bench, timed; a failure is logged and the next bench still runs
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" || echo "== $name FAILED (exit $?)"
  echo "== $name took $((SECONDS - t0)) s"
}

if [ "$part" = 1 ]; then
  run attention python3 bench/bench_attention.py --model 0.5b --workdir "$WORK" --out "$OUT/attention.json"
  run rollout python3 bench/bench_rollout.py --model 0.5b --workdir "$WORK" --out "$OUT/rollout_0.5b.json"
  for size in 0.5b 1.5b; do  # one process per engine: a torn-down engine's memory is not reliably freed
    run push-$size python3 bench/bench_push.py --sizes $size --workdir "$WORK" --out "$OUT/push_$size.json"
  done
  if python3 -c "import pytest" 2>/dev/null; then  # the CUDA-only tests, where the device has pytest
    run gpu-tests python3 -m pytest -q -rs -m gpu tests/test_perf.py
    # compiled logprob kernels against eager on CUDA; the micro-batch inputs under sync debug mode "error"
    run gpu-kernels python3 -m pytest -q -rs tests/test_losses.py tests/test_grpo.py -k "compiled or sync"
    for level in 1 2; do  # one sleep-mode engine per process (vLLM's CuMem allocator)
      run gpu-sleep-wake-$level python3 -m pytest -q -rs -m gpu tests/test_rollout.py -k "sleep_wake and $level"
    done
  fi
  # The whole GRPO loop on CUDA (varlen attention, bf16, sleep/wake, the per-step logprob check), toy size.
  run toy-grpo bash -c "python3 toy.py --out $WORK/toy > /dev/null && python3 -m torch.distributed.run \
    --nproc_per_node 1 grpo.py --config configs/grpo_toy.yaml --model.path $WORK/toy/model \
    --data.train_files $WORK/toy/rl/train.parquet --data.val_files $WORK/toy/rl/val.parquet \
    --trainer.total_training_steps 3 --trainer.logger console --trainer.default_local_dir $WORK/toy_grpo \
    --rollout.gpu_memory_utilization 0.2 2>&1 | grep -E 'step [0-9]|logprob|Error|error' | tail -20"
elif [ "$part" = 2 ]; then
  for size in 0.5b 1.5b; do
    run update-$size python3 bench/bench_update.py --sizes $size --workdir "$WORK" --out "$OUT/update_$size.json"
  done
  run e2e python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --out "$OUT/e2e.json"
elif [ "$part" = 3 ]; then  # flatrl with gradient checkpointing, TRL's setting (2.3 min measured, 58239f2)
  run e2e-gc python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --gradient-checkpointing --skip-trl \
    --out "$OUT/e2e_gc.json"
elif [ "$part" = 4 ]; then  # flatrl with the optimizer state off the device in the rollout, against TRL (7.5 min, 8723179)
  run e2e-offload python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --offload-optimizer \
    --out "$OUT/e2e_offload.json"
else
  echo "usage: bash bench/run_h200.sh 1|2|3|4"; exit 2
fi
echo "== done $(date -u); files in $OUT:"; ls -la "$OUT"
