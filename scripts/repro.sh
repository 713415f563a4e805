#!/usr/bin/env bash
# The offline reproduction behind the README's results table (docs/REPRODUCE.md): a 30M-parameter Qwen2 trained
# from scratch by flatrl, SFT -> merge -> GRPO and PPO, each from the SFT model.
#
#   bash scripts/repro.sh                   # one H200: three-digit addition/subtraction (TASK=arith3)
#   SEEDS="0 1" bash scripts/repro.sh       # two training seeds: the seed spread (twice the time of the stages)
#   SIZE=toy bash scripts/repro.sh          # the same stages at toy size on CPU (2 ranks, a few minutes)
#   TASK=countdown bash scripts/repro.sh    # TinyZero's countdown (3-4 numbers) instead: written, not yet run
#   STAGES="data sft" bash scripts/repro.sh; STAGES="grpo ppo report" bash scripts/repro.sh   # in two sittings
#   PY=python3 TORCHRUN_BIN="python3 -m torch.distributed.run" bash scripts/repro.sh          # without .venv
#
# Stages, per seed S under OUT/seedS/ (OUT=runs/repro; OUT/data, with the model, is built once, seed 0):
#   data        toy.py --digits 3 (arith3) or scripts/prepare_countdown.py: RL and SFT parquet, a from-scratch
#               model and tokenizer
#   sft         sft.py, configs/sft_TASK.yaml          -> OUT/seedS/sft, merged to OUT/seedS/sft_model
#   grpo        grpo.py, configs/grpo_TASK.yaml        -> OUT/seedS/grpo (validates the SFT model first)
#   ppo         ppo.py, configs/ppo_TASK.yaml          -> OUT/seedS/ppo
#   report      plot.py -> OUT/seedS/plots/*.png (and OUT/plots: seeds); scripts/repro_summary.py
# The summary (OUT/summary.json): greedy accuracy on the held-out problems after SFT, GRPO and PPO, the SFT
# validation loss, steps and wall-clock seconds of every stage (OUT/seedS/wall_s.txt), and with several seeds their
# mean and spread. A seed here is the training seed (data order, sampling); the data, the tokenizer and the
# initial weights are the same for every seed. DOCS=docs/repro (the default at SIZE=h200) copies seed 0's plots and
# the summary there for the README.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SIZE=${SIZE:-h200}
SEEDS=${SEEDS:-0}
OUT=${OUT:-runs/repro}

TASK=${TASK:-arith3}
STAGES=${STAGES:-data sft grpo ppo report}
case "$SIZE" in
  h200)
    NPROC=1
    DOCS=${DOCS:-docs/repro}
    ARITH_FLAGS=(--n-train 400000 --n-val 512 --hidden-size 512 --num-layers 8)
    COUNTDOWN_FLAGS=(--n-train 100000 --n-test 512 --n-sft 400000 --hidden-size 512 --num-layers 8)
    SFT_FLAGS=() GRPO_FLAGS=() PPO_FLAGS=()  # the configs hold the H200 sizes
    ;;
  toy)
    NPROC=2
    DOCS=${DOCS:-}
    export OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1  # as scripts/demo.sh
    ARITH_FLAGS=(--n-train 6000 --n-val 64 --hidden-size 128 --num-layers 2)
    COUNTDOWN_FLAGS=(--n-train 2000 --n-test 64 --n-sft 6000 --hidden-size 128 --num-layers 2)
    SFT_FLAGS=(--trainer.total_training_steps 40 --trainer.test_freq 20 --data.train_batch_size 64
      --data.micro_batch_size_per_gpu 32 --optim.lr 3e-3)
    RL_FLAGS=(--trainer.total_training_steps 2 --trainer.test_freq 2 --custom_reward_function.num_workers 2
      --rollout.max_num_seqs 64)
    GRPO_FLAGS=("${RL_FLAGS[@]}" --data.train_batch_size 8 --rollout.n 4 --actor.ppo_mini_batch_size 8
      --actor.ppo_micro_batch_size_per_gpu 32)
    PPO_FLAGS=("${RL_FLAGS[@]}" --data.train_batch_size 16 --actor.ppo_mini_batch_size 16
      --actor.ppo_micro_batch_size_per_gpu 32 --critic.ppo_mini_batch_size 16
      --critic.ppo_micro_batch_size_per_gpu 32 --trainer.critic_warmup 1)
    ;;
  *) echo "SIZE must be h200 or toy, got $SIZE" >&2; exit 2 ;;
esac
case "$TASK" in
  arith3)  # toy.py's layout: DIR/model, DIR/sft/{train,val}.parquet, DIR/rl/{train,val}.parquet
    MODEL=$OUT/data/model SFT_TRAIN=$OUT/data/sft/train.parquet SFT_VAL=$OUT/data/sft/val.parquet
    RL_TRAIN=$OUT/data/rl/train.parquet RL_VAL=$OUT/data/rl/val.parquet
    DATA_CMD=($PY toy.py --out "$OUT/data" --digits 3 --seed 0 "${ARITH_FLAGS[@]}")
    ;;
  countdown)
    MODEL=$OUT/model SFT_TRAIN=$OUT/data/sft/train.parquet SFT_VAL=$OUT/data/sft/test.parquet
    RL_TRAIN=$OUT/data/train.parquet RL_VAL=$OUT/data/test.parquet
    DATA_CMD=($PY scripts/prepare_countdown.py --out "$OUT/data" --style plain --seed 0 --model-out "$OUT/model"
      "${COUNTDOWN_FLAGS[@]}")
    TASK=countdown_scratch  # its configs' suffix
    ;;
  *) echo "TASK must be arith3 or countdown, got $TASK" >&2; exit 2 ;;
esac
has() { [[ " $STAGES " == *" $1 "* ]]; }
# shellcheck disable=SC2206  # TORCHRUN_BIN may be a command with arguments: "python3 -m torch.distributed.run"
TORCHRUN=(${TORCHRUN_BIN:-.venv/bin/torchrun} --nproc_per_node "$NPROC")
source scripts/stages.sh  # latest, stage

if has data; then
  rm -rf "${OUT:?}"/{data,model,seed*,plots,summary.json,wall_s.txt}  # only what this script writes
  mkdir -p "$OUT"
  stage data "$OUT/wall_s.txt" "${DATA_CMD[@]}"
fi
for S in $SEEDS; do
  RUN="$OUT/seed$S"
  mkdir -p "$RUN"
  RL_DATA=(--data.train_files "$RL_TRAIN" --data.val_files "$RL_VAL" --model.path "$RUN/sft_model"
    --trainer.seed "$S" --data.seed "$((S + 1))" --rollout.seed "$S" --trainer.logger console jsonl)
  if has sft; then
    stage sft "$RUN/wall_s.txt" "${TORCHRUN[@]}" sft.py --config "configs/sft_$TASK.yaml" \
      --model.partial_pretrain "$MODEL" --data.train_files "$SFT_TRAIN" --data.val_files "$SFT_VAL" \
      --trainer.default_local_dir "$RUN/sft" --trainer.seed "$S" "${SFT_FLAGS[@]}"
    stage merge "$RUN/wall_s.txt" $PY shard_merge.py --ckpt-dir "$(latest "$RUN/sft")" --out "$RUN/sft_model"
  fi
  if has grpo; then
    stage grpo "$RUN/wall_s.txt" "${TORCHRUN[@]}" grpo.py --config "configs/grpo_$TASK.yaml" \
      --trainer.default_local_dir "$RUN/grpo" "${RL_DATA[@]}" "${GRPO_FLAGS[@]}"
  fi
  if has ppo; then
    stage ppo "$RUN/wall_s.txt" "${TORCHRUN[@]}" ppo.py --config "configs/ppo_$TASK.yaml" \
      --trainer.default_local_dir "$RUN/ppo" "${RL_DATA[@]}" "${PPO_FLAGS[@]}"
  fi
  if has report; then
    $PY plot.py "$RUN/sft" "$RUN/grpo" "$RUN/ppo" --out "$RUN/plots"
  fi
done
has report || exit 0
if [ "$(echo $SEEDS | wc -w)" -gt 1 ]; then
  $PY plot.py "$OUT"/seed*/grpo "$OUT"/seed*/ppo --out "$OUT/plots"
fi
$PY scripts/repro_summary.py "$OUT"
if [ -n "$DOCS" ]; then
  mkdir -p "$DOCS"
  first=$(echo $SEEDS | awk '{ print $1 }')
  cp "$OUT/seed$first"/plots/*.png "$OUT/summary.json" "$DOCS"/
  echo "copied seed $first's plots and summary.json to $DOCS (commit them with the README table's rows)"
fi
