#!/usr/bin/env bash
# make demo: build the offline toy model and task, SFT it on 2 ranks, merge the checkpoint into a Hugging
# Face folder, then GRPO and PPO (each from the SFT model) with colocated vLLM, and report validation accuracy
# before SFT, after SFT, after GRPO and after PPO (greedy decoding, the toy's exact-match reward) in
# runs/demo/summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TORCHRUN=".venv/bin/torchrun --nproc_per_node 2"
export OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
rm -rf runs/demo && mkdir -p runs/demo
$PY toy.py --out runs/toy
latest() { ls -d "$1"/global_step_* | sort -t_ -k3 -n | tail -1; }

echo "== accuracy of the untrained toy model"
$TORCHRUN grpo.py --config configs/grpo_toy.yaml --model.path runs/toy/model --trainer.val_only \
  --trainer.default_local_dir runs/demo/eval_base --trainer.logger jsonl
echo "== SFT"
$TORCHRUN sft.py --config configs/sft_toy.yaml
$PY shard_merge.py --ckpt-dir "$(latest runs/demo/sft)" --out runs/demo/sft_model --verify
echo "== GRPO from the SFT model"
$TORCHRUN grpo.py --config configs/grpo_toy.yaml
$PY shard_merge.py --ckpt-dir "$(latest runs/demo/grpo)" --out runs/demo/grpo_model
echo "== PPO from the SFT model"
$TORCHRUN ppo.py --config configs/ppo_toy.yaml
$PY shard_merge.py --ckpt-dir "$(latest runs/demo/ppo)" --out runs/demo/ppo_model
$PY scripts/summary.py runs/demo
