#!/usr/bin/env bash
# Every figure of bench/README.md on one H200, in device calls of under 10 minutes each, after vLLM 0.24 is
# installed per the workplace GPU notes (three back-to-back calls; this goes in the third or a later one):
#
#   call A:  source .gpu3/device_install.sh && FLATRL_COMMIT=<sha> bash bench/run_h200.sh 1   # 7.5 min measured
#   call B:  source .gpu3/device_install.sh && FLATRL_COMMIT=<sha> bash bench/run_h200.sh 2   # 5 min measured
#   call C (optional): ... bash bench/run_h200.sh 3   # flatrl e2e with gradient checkpointing
#   call D (optional): ... bash bench/run_h200.sh 4   # e2e against TRL with --no-offload-optimizer
# both with carry [".gpu3", ".gpu_trl"]
#
# A: the attention check, rollout (0.5B), weight push (0.5B, 1.5B), the GPU tests; B: policy update (0.5B,
# 1.5B), end to end against TRL (0.5B). FLATRL_COMMIT goes into every JSON (the device's copy has no .git).
# (the durations are estimates from the device baselines in bench/README.md, not measurements). TRL is
# optional: carry .gpu_trl/ (bench/build_trl_payload.sh) with call B and it is unpacked into /tmp/site;
# without it bench_e2e.py reports TRL as skipped. Each bench writes one JSON file under $OUT (6 at most, plus
# this script's log), so the files come back even when a later bench fails or the call runs out of time.
#
# Issue 21's runs (verl beside flatrl and TRL; memory with the defaults; the levers), named parts, each one
# call on the same warm machine after the vLLM calls. Later calls need no .gpu3: the script sets the payload's
# environment itself when /tmp/site holds vLLM. Durations are estimates from earlier runs at these shapes.
#   toy-grpo   (no carry, 116 s at 6e02cb0)  grpo.py on the toy model for 3 steps on CUDA (part 1 ends with it)
#   gen-split  (no carry; MODEL=smollm2 after smollm2-prep, or it converts; ~2 min est. at 135M) bench_rollout at one
#                                      step's shape, each run twice interleaved: bare vLLM, flatrl's call, bare with
#                                      the check's logprobs, bare with them on short probes, flatrl's call on a woken
#                                      engine, flatrl's call checking 2 prompts, flatrl's call with torch at 1
#                                      thread: the 1.245x of 6e02cb0 (135M), split
#   gpu-tests  (no carry, 5.5 min at 428ed92)  the CUDA-only tests, each sleep-mode engine in its own process
#   defaults   (no carry, a job, ~6 min; 7 on a slow H100 host, 2026-12-06, and about 1 more since bare vLLM
#              joined)                 flatrl with its defaults, bare vLLM's generation of one step, then TRL, at
#                                      $MODEL (0.5b; 1.5b is a run of its own)
#   gen-profile (no carry, a job, ~6 min at 864d4e1, 0.5b) flatrl's defaults and the bare runs (no TRL), every
#                                      vLLM call's Python stack and garbage collections timed (bench/gen_profile.py):
#                                      where the loop's call spends its 1.136x of the call alone (d03c3d6)
#   flatrl     (no carry, a job, ~3.5 min)  flatrl's defaults alone at $MODEL, kept for the verl part (--flatrl-from);
#                                      STEPS (4) steps, then bare vLLM's runs
#   tokens     (no carry, 484 s at 1.5b on a slow H100 host) flatrl alone at $MODEL: the defaults (DEFAULTS=0
#                                      skips them), then one run per TOKENS entry BUDGET[:LAYERS] (4096:auto):
#                                      BUDGET-token micro-batches, LAYERS recomputed (auto, all or a number); no bare vLLM
#   trl        (no carry, a job, 128 s at 1.5b on a fast H100 host)  TRL alone at $MODEL, flatrl's figures from the
#                                      flatrl part's JSON on this machine (--flatrl-from): the flatrl, verl and trl
#                                      parts give one machine's row of all three in one lease (e3556ff: 1.5b in
#                                      ~1,100 s of device time with the install)
#   verl       (carry .gpu_verl1 .gpu_trl, a job)  unpacks verl (first time), then runs verl at $MODEL, flatrl's
#                                      figures from the defaults part's JSON on this machine (--flatrl-from), so the
#                                      ratios come out (VERL_ATTENTION=sdpa-padded: the runs before 2026-12-06, no
#                                      flash-attn stand-in); start-up alone took over 320 s on an H100
#   wait       (no carry; verl-wait is the same)  follows the job a part started to its end (send it at once: the
#                                      machine goes back 30 s after a call). A job runs in its own process session,
#                                      and its part follows it until the call has run WAIT_S s (560); no other part
#                                      starts while it runs
#   levers     (no carry, ~7.5 min)    flatrl alone at 0.5b: --checkpoint-layers auto; --async-steps 1 --engine-process
#   compile    (no carry, ~6 min est.) model.compile_layers: bench_update's packed update eager and compiled at $MODEL
#                                      (checkpointed), then flatrl alone end to end with --compile-layers
#   fast       (no carry, ~6 min est. at 0.5b) flatrl alone at $MODEL: --compile-layers --use-fused-kernels
#                                      --token-budget 65536 --fused-adamw --checkpoint-layers auto, then
#                                      --no-compile-layers (eager: the defaults compile since 2026-12-06); ratios
#                                      (TOKENS=16384: the levers' micro-batches at that budget, where the plan's
#                                      auto leaves every 0.5B layer whole since compiled layers count 0.66;
#                                      EAGER=0 skips the eager run)
#                                      against the defaults part's TRL of this machine
#                                      (MODEL=smollm2: the real model and the smollm2 part's TRL; LoRA + compiled
#                                      layers are checked on CPU by tests/test_compile_layers.py)
#   best       (no carry, ~4 min est.)  flatrl alone at $MODEL with fast's update levers and async rollouts (the
#                                      engine in its own process, its share SHARE: 0.12, 0.2 at 1.5b), 6 steps; CPU
#                                      toy size: 129 s (bench/README.md's next runs)
#   ledger     (no carry, ~2 min est.) bench/probe_memory.py at $MODEL: the memory outside torch's allocator after each
#                                      piece of grpo.py's set-up (context, NCCL groups, cuBLAS, vLLM's start, sleep),
#                                      with the trainer's process group (lazy NCCL), bound to the device, and none
#   levers2    (no carry, ~7.5 min)    flatrl alone at 0.5b: --no-offload-optimizer; --no-expandable-segments
#   fused      (no carry, ~7.5 min)    flatrl alone at 0.5b: --use-fused-kernels, with every layer and with auto checkpointing
#   share      (no carry, ~5 min)      the defaults and async at vLLM's share 0.12 instead of 0.3
#   levers3    (no carry, ~8 min est.) flatrl alone at 0.5b: --use-fused-kernels --checkpoint-layers auto; then
#                                      --compile-layers --async-steps 1 --engine-process at share 0.12 over 6 steps
#   async      (no carry, ~8.5 min)    async at share 0.12 over 6 steps, the engine in this process (one CUDA
#                                      context: the two sides' kernels interleave) and in its own (two contexts,
#                                      time-sliced); 4 steps at 001eeb6 fell 14.5, 13.0, 8.7 s
#   smollm2-prep (carry .gpu_smol3 .gpu_smol4 .gpu_trl; a call before it copied .gpu_smol1-2 into /tmp/smol_parts,
#              ~1 min)                 unpacks the GGUF and dequantizes it into /tmp/real/model
#   smollm2    (no carry after smollm2-prep, a job: 505 s for the e2e bench on an H100 at f8597ea, over 640 s at
#              428ed92, whose compiled layers' first step took 148 s)  the real SmolLM2-135M: flatrl, bare vLLM and
#                                      TRL (async at 135M: MODEL=smollm2 ... best); it converts first where
#                                      smollm2-prep did not (one call of 577 s at 01e8306)
#                                      PEERS=verl (carry .gpu_verl1 .gpu_trl): verl instead of TRL, in the job
# The lever parts pass --bare-vllm off (two flatrl runs a call leave no minute for it); defaults, flatrl, 2 and smollm2
# time it after their first flatrl run.
# e.g.  FLATRL_COMMIT=<sha> bash bench/run_h200.sh defaults;  FLATRL_COMMIT=<sha> MODEL=1.5b bash bench/run_h200.sh verl
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-1}
OUT=${OUT:-/tmp/flatrl-bench-out}
WORK=${WORK:-/tmp/flatrl-bench}   # models are built once per machine and reused by later calls
mkdir -p "$OUT" "$WORK"
log="$OUT/run_h200_part$part.log"
exec > >(tee -a "$log") 2>&1
echo "== run_h200.sh part $part, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u)"
if [ -f /tmp/site/vllm/__init__.py ]; then  # the vLLM payload's environment (.gpu3/device_install.sh's exports)
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# tyro (config.py) and TRL are not on the device: carry .gpu_trl/ (bench/build_trl_payload.sh) with both parts.
if [ -d .gpu_trl ] && [ ! -d /tmp/site/tyro ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_trl/*.whl
fi
# Every part needs it (bench/common.py builds the models through toy.py): stop at once rather than 10 s into a bench
# (2026-12-05: a verl call carried .gpu_verl1 alone and lost its 78 s to this)
python3 -c "import tyro" || { echo "== tyro is missing: carry .gpu_trl (bench/build_trl_payload.sh) with this call"; exit 3; }

MODEL=${MODEL:-0.5b}
# The flatrl-only parts (levers, compile, fast, levers2, fused, share, async) take the peers' figures from the parts
# before them on this machine, for ratios: TRL from the defaults part (or the trl part), verl from the verl part.
# A file that holds no peer (the flatrl part's) is passed over with a line (2026-12-07: it alone failed `fast`).
path_args=()  # MODEL=smollm2: the real model the smollm2 part converted, and its TRL figures from that part
candidates=("$WORK/json/e2e_defaults_$MODEL.json" "$WORK/json/e2e_trl_$MODEL.json")
if [ "$MODEL" = smollm2 ]; then path_args=(--model-path /tmp/real/model); candidates=("$WORK/json/e2e_smollm2.json"); fi
peers_from=()
for f in "${candidates[@]}" "$WORK/json/e2e_verl_$MODEL.json"; do [ -f "$f" ] && peers_from+=(--peers-from "$f"); done

run() {  # run NAME CMD...: one bench, timed; a failure is logged and the next bench still runs
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" || echo "== $name FAILED (exit $?)"
  echo "== $name took $((SECONDS - t0)) s"
}

# The long benches (the e2e parts with a peer: defaults, flatrl, smollm2, verl) run as a job in their own process
# session (setsid), which outlives the call (workplace device notes): the part starts it and follows it until the
# call has run WAIT_S seconds (560), and the part `wait` in the next call follows it to its end. A call cut at 600 s
# used to lose what the bench had not written yet (2026-12-06: the smollm2 part's TRL run, 40 s short). Every 15 s
# the job's JSON (written as the bench goes), its log and verl's console and metrics are copied into $OUT; a job
# that exits 0 leaves its JSON in $WORK/json for later parts' --flatrl-from and --peers-from.
jobs=$WORK/jobs
job_running() {  # whether the job started last on this machine still runs
  [ -f "$jobs/current" ] || return 1
  local d; d=$jobs/$(cat "$jobs/current")
  [ ! -f "$d/rc" ] && kill -0 "$(cat "$d/pid" 2>/dev/null || echo 0)" 2>/dev/null
}
copy_job() {  # copy_job NAME: what the job has written so far, into $OUT
  local name=$1 d=$jobs/$1 model
  model=$(cat "$d/model" 2>/dev/null || echo "$MODEL")
  cp "$d"/*.json "$OUT/" 2>/dev/null
  [ -f "$d/bench.log" ] && tail -c 100000 "$d/bench.log" > "$OUT/$name.log"
  case $name in e2e-verl-*)  # verl ran in it (the verl part, or the smollm2 part with PEERS=verl)
    [ -f "$WORK/verl_run/console.log" ] && tail -c 200000 "$WORK/verl_run/console.log" > "$OUT/verl_console_$model.log"
    [ -f "$WORK/verl_run/metrics.jsonl" ] && cp "$WORK/verl_run/metrics.jsonl" "$OUT/verl_metrics_$model.jsonl" ;;
  esac
  if [ "$(cat "$d/rc" 2>/dev/null)" = 0 ]; then mkdir -p "$WORK/json" && cp "$d"/*.json "$WORK/json/" 2>/dev/null; fi
  return 0
}
start_job() {  # start_job NAME CMD...: CMD in its own session, its output in $jobs/NAME/bench.log
  local name=$1; shift
  local d=$jobs/$name
  rm -rf "$d" && mkdir -p "$d" && echo "$MODEL" > "$d/model" && echo "$name" > "$jobs/current"
  echo "== $name (own session, $(date -u +%T)): $*"
  # every descriptor of its own away from this call's (the log's tee, the device's capture), so nothing waits on it
  setsid bash -c '"$@" > "$0/bench.log" 2>&1; echo $? > "$0/rc"' "$d" "$@" < /dev/null > "$d/setsid.log" 2>&1 &
  echo $! > "$d/pid"
}
follow_job() {  # follows the job started last until it ends or this call has run WAIT_S seconds
  [ -f "$jobs/current" ] || { echo "== no job was started on this machine: run its part first"; exit 2; }
  local name; name=$(cat "$jobs/current")
  local d=$jobs/$name
  while job_running && [ $SECONDS -lt "${WAIT_S:-560}" ]; do sleep "${POLL_S:-15}"; copy_job "$name"; done
  copy_job "$name"
  if [ -f "$d/rc" ]; then echo "== $name exited $(cat "$d/rc") ($(date -u +%T))"; tail -5 "$d/bench.log"
  elif job_running; then echo "== $name still running after this call's ${WAIT_S:-560} s: send the part wait now"
  else echo "== $name ended without an exit status (killed?)"; tail -5 "$d/bench.log"; fi
}
if job_running && [ "$part" != wait ] && [ "$part" != verl-wait ]; then
  echo "== $(cat "$jobs/current") is still running on this GPU: send the part wait first (another bench beside it"
  echo "   would share the device and spoil both runs' figures)"; exit 2
fi

if { [ "$part" = smollm2-prep ] || [ "$part" = smollm2 ] || { [ "$part" = gen-split ] && [ "$MODEL" = smollm2 ]; }; } &&
  [ ! -f /tmp/real/model/config.json ]; then
  mkdir -p /tmp/smol_parts && cp .gpu_smol[1-4]/* /tmp/smol_parts/ 2>/dev/null  # whichever parts this call carried
  run smollm2-unpack bash scripts/smollm2_payload.sh unpack
  run smollm2-convert python3 scripts/get_smollm2.py \
    --src /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/real/model
fi

toy_grpo() {  # the whole GRPO loop on CUDA (varlen attention, bf16, sleep/wake, the per-step logprob check, one
  # rank's gloo group), toy size
  run toy-grpo bash -c "python3 toy.py --out $WORK/toy > /dev/null && python3 -m torch.distributed.run \
    --nproc_per_node 1 grpo.py --config configs/grpo_toy.yaml --model.path $WORK/toy/model \
    --data.train_files $WORK/toy/rl/train.parquet --data.val_files $WORK/toy/rl/val.parquet \
    --trainer.total_training_steps 3 --trainer.logger console --trainer.default_local_dir $WORK/toy_grpo \
    --rollout.gpu_memory_utilization 0.2 2>&1 | grep -E 'step [0-9]|logprob|backend|Error|error' | tail -20"
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
  toy_grpo
elif [ "$part" = toy-grpo ]; then
  toy_grpo
elif [ "$part" = gen-split ]; then  # the generation phase's gap to bare vLLM, split, at one step's shape (64 x 8)
  # each run twice, interleaved: bare; flatrl's call (8 probes, 1 torch thread); bare with 8 probe requests; flatrl's
  # call as before 2026-12-07 with the check's logprobs on 8 prompts' rollouts, then with the process's threads;
  # flatrl's call on a woken engine
  split=bare_n8,flatrl_n8_call,bare_n8_probe8,flatrl_n8_onrollouts,flatrl_n8_threadsall,flatrl_n8_woken
  run gen-split python3 bench/bench_rollout.py --model "$MODEL" "${path_args[@]}" --workdir "$WORK" \
    --num-prompts 64 --gpu-memory-utilization 0.3 --runs "$split,${split//,/#2,}#2" --out "$OUT/gen_split_$MODEL.json"
elif [ "$part" = 2 ]; then
  for size in 0.5b 1.5b; do
    run update-$size python3 bench/bench_update.py --sizes $size --workdir "$WORK" --out "$OUT/update_$size.json"
  done
  run e2e python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --out "$OUT/e2e.json"
elif [ "$part" = 3 ]; then  # flatrl with gradient checkpointing, TRL's setting (2.3 min measured, 58239f2)
  run e2e-gc python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --gradient-checkpointing --skip-trl \
    --out "$OUT/e2e_gc.json"
elif [ "$part" = 4 ]; then  # flatrl with the optimizer state on the device in the rollout (the default before 2026-12-05)
  run e2e-no-offload python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --no-offload-optimizer \
    --out "$OUT/e2e_no_offload.json"
elif [ "$part" = gpu-tests ]; then
  run gpu-tests python3 -m pytest -q -rs -m gpu tests/ -k "not sleep_wake"
  # CPU tests whose engine and trainer run in bf16 on CUDA: the two-mini-batch toy failed there twice (2026-12-06)
  run toy-correction python3 -m pytest -q -rA tests/test_rollout_correction.py -k toy
  # rollout.engine_process's push through the CUDA IPC buffer: the async `best` runs push this way every step (at
  # 71b1a5f unchecked past the first step; grpo.py's probe checks each push since)
  # (-rA: the passed tests' output too, where assert_seed_repeats prints how much a seeded repeat agrees on CUDA)
  run engine-process-push python3 -m pytest -q -rA tests/test_rollout.py -k engine_process_push
  for level in 1 2; do  # one sleep-mode engine per process (vLLM's CuMem allocator)
    run gpu-sleep-wake-$level python3 -m pytest -q -rA -m gpu tests/test_rollout.py -k "sleep_wake and $level"
  done
elif [ "$part" = wait ] || [ "$part" = verl-wait ]; then  # the job a part before this call started, to its end
  follow_job
elif [ "$part" = defaults ]; then  # flatrl's defaults: checkpointing of every layer, expandable segments, the
  # optimizer state in host memory during the rollout, share 0.3; then bare vLLM and TRL (a job: part `wait` after)
  start_job e2e-defaults-$MODEL python3 bench/bench_e2e.py --model "$MODEL" --workdir "$WORK" --peers trl \
    --out "$jobs/e2e-defaults-$MODEL/e2e_defaults_$MODEL.json"
  follow_job
elif [ "$part" = gen-profile ]; then  # where the loop's vLLM call spends the 1.136x of the call alone (d03c3d6, 0.5B):
  # flatrl's defaults and the bare runs, every vLLM call's Python stack sampled (bench/gen_profile.py); the JSON's
  # gen_profile_loop_vs_alone sets the two side by side, function by function, with the garbage collector's pauses
  # (a job: part `wait` after)
  start_job e2e-profile-$MODEL python3 bench/bench_e2e.py --model "$MODEL" "${path_args[@]}" --workdir "$WORK" \
    --skip-trl --bare-vllm on --profile-gen --out "$jobs/e2e-profile-$MODEL/e2e_profile_$MODEL.json"
  follow_job
elif [ "$part" = flatrl ]; then  # flatrl's defaults alone at $MODEL (~3.5 min at 0.5b), kept for a verl part on this
  # machine: a defaults part with TRL and a verl part do not fit one warm machine's budget on a slow host
  # (STEPS: more steps than bench_e2e's 4 show whether generation keeps growing from step to step)
  start_job e2e-flatrl-$MODEL python3 bench/bench_e2e.py --model "$MODEL" --workdir "$WORK" --skip-trl \
    --steps "${STEPS:-4}" --out "$jobs/e2e-flatrl-$MODEL/e2e_defaults_$MODEL.json"
  follow_job
elif [ "$part" = tokens ]; then  # flatrl alone at $MODEL, in one call: the defaults (16,384-token micro-batches, every
  # layer recomputed), then a run for each TOKENS entry BUDGET[:LAYERS], default 4096:auto (auto checkpointing keeps
  # layers whole under the update's optimizer step where the offloaded AdamW state's return sets its peak: 1.5B on an
  # H100, compiled layers: none of 28 by the plan). At 8de09b6 (a slow host) 4096:auto lost 4.8 s: the update's
  # host work per micro-batch outlasts its GPU work; next, 8192:0 (35.1 GiB by the plan) and 16384:14 (40.4 GiB).
  # The defaults' JSON is kept for the trl and verl parts of this machine (--flatrl-from) when the run exits 0.
  if [ "${DEFAULTS:-1}" != 0 ]; then
    run e2e-tokens-defaults bash -c "python3 bench/bench_e2e.py --model $MODEL ${path_args[*]} --workdir $WORK \
      --skip-trl --bare-vllm off ${peers_from[*]} --out $OUT/e2e_tokens_defaults_$MODEL.json && mkdir -p $WORK/json \
      && cp $OUT/e2e_tokens_defaults_$MODEL.json $WORK/json/e2e_defaults_$MODEL.json"
  fi
  for entry in ${TOKENS:-4096:auto}; do
    budget=${entry%%:*} layers=auto
    [ "$entry" != "$budget" ] && layers=${entry#*:}
    run "e2e-tokens-$budget-$layers" python3 bench/bench_e2e.py --model "$MODEL" "${path_args[@]}" --workdir "$WORK" \
      --skip-trl --bare-vllm off "${peers_from[@]}" --token-budget "$budget" --checkpoint-layers "$layers" \
      --out "$OUT/e2e_tokens_${budget}_${layers}_$MODEL.json"
  done
elif [ "$part" = trl ]; then  # TRL alone at $MODEL against the flatrl part's figures on this machine (128 s at 1.5b
  # on a fast H100 host, 2026-12-07), so flatrl, TRL and verl share one machine in one lease: flatrl, verl, trl
  from=$WORK/json/e2e_defaults_$MODEL.json
  [ -f "$from" ] || { echo "== $from is missing: run the flatrl (or defaults) part on this machine first"; exit 2; }
  start_job e2e-trl-$MODEL python3 bench/bench_e2e.py --model "$MODEL" --workdir "$WORK" --peers trl \
    --flatrl-from "$from" --out "$jobs/e2e-trl-$MODEL/e2e_trl_$MODEL.json"
  follow_job
elif [ "$part" = verl ]; then
  # verl's main_ppo took more than 320 s to reach its first step on an H100 host (2026-12-05: Ray and its task
  # runner 2.2 min, vLLM's server, engine core and worker processes 2.5 min, then torch.compile and graph capture):
  # a job, followed to its end by the part `wait` (or `verl-wait`) in the next call
  if [ ! -f /tmp/verl_site/verl/__init__.py ]; then run verl-install bash bench/verl_device_install.sh; fi
  from=$WORK/json/e2e_defaults_$MODEL.json
  model_args=()  # the real model: the smollm2 part converts it and keeps its flatrl + TRL JSON for these ratios
  if [ "$MODEL" = smollm2 ]; then from=$WORK/json/e2e_smollm2.json; model_args=(--model-path /tmp/real/model); fi
  [ "$MODEL" = smollm2 ] && [ ! -f /tmp/real/model/config.json ] && {
    echo "== /tmp/real/model is missing: run the smollm2 part on this machine first"; exit 2; }
  # flatrl's figures from the defaults part on this machine; without them verl runs alone (flatrl beside it would
  # take the call past 10 minutes), and the ratios wait for a defaults part in a later call
  [ -f "$from" ] && from_args=(--flatrl-from "$from") || from_args=(--skip-flatrl)
  start_job e2e-verl-$MODEL python3 bench/bench_e2e.py --model "$MODEL" "${model_args[@]}" --workdir "$WORK" \
    --peers verl "${from_args[@]}" --verl-attention "${VERL_ATTENTION:-flash-shim}" --verl-steps "${VERL_STEPS:-3}" \
    --timeout-s "${VERL_TIMEOUT_S:-900}" --out "$jobs/e2e-verl-$MODEL/e2e_verl_$MODEL.json"
  follow_job
elif [ "$part" = levers ]; then  # a flatrl run took 218 s of process wall time at 0.5B (f7812f0): two a call
  run e2e-auto python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --checkpoint-layers auto --out "$OUT/e2e_auto.json"
  run e2e-async python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --async-steps 1 --engine-process --out "$OUT/e2e_async.json"
elif [ "$part" = compile ]; then  # model.compile_layers: the update alone, eager and compiled, then end to end
  run update-compiled python3 bench/bench_update.py --sizes "$MODEL" --modes packed,compiled --gradient-checkpointing \
    --workdir "$WORK" --out "$OUT/update_compiled_$MODEL.json"
  run e2e-compiled python3 bench/bench_e2e.py --model "$MODEL" --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --compile-layers --out "$OUT/e2e_compiled_$MODEL.json"
elif [ "$part" = fast ]; then  # the update levers together, then compiled alone, at $MODEL, against the defaults
  # part's TRL on this machine: a serial step reaches 0.4x TRL only with an update about 0.55x today's
  # (bench/README.md, dd661b4), which no lever gives alone. Together: compiled layers; the fused LM head (no
  # [T, V] logits), which leaves room for 65,536-token micro-batches (a quarter of the micro-batches, of the
  # host's per-micro-batch work); fused AdamW (no sqrt(v) buffer at the step, 1.5B's peak); and auto checkpointing
  # in the room those leave
  run e2e-levers python3 bench/bench_e2e.py --model "$MODEL" "${path_args[@]}" --workdir "$WORK" --skip-trl \
    --bare-vllm off "${peers_from[@]}" --compile-layers --use-fused-kernels --token-budget "${TOKENS:-65536}" --fused-adamw \
    --checkpoint-layers auto --out "$OUT/e2e_levers_$MODEL${TOKENS:+_$TOKENS}.json"
  # the defaults compile the layers since 2026-12-06 (model.compile_layers=auto): eager, for what that default buys
  [ "${EAGER:-1}" = 0 ] || run e2e-eager python3 bench/bench_e2e.py --model "$MODEL" "${path_args[@]}" --workdir "$WORK" --skip-trl \
    --bare-vllm off "${peers_from[@]}" --no-compile-layers --out "$OUT/e2e_eager_$MODEL.json"
elif [ "$part" = best ]; then  # every lever at once at $MODEL: fast's update levers, and the next step's rollouts
  # generated while this one trains (async, the engine in its own process: compiled layers and an in-process
  # engine generating ahead do not mix), the engine's share sized to its KV cache (it never sleeps, so its share
  # sits beside the update: 512 x 768 tokens of KV are 4.8 GB at 0.5b, 11 GB at 1.5b); 6 steps, as async's steps
  # settle after the first few (001eeb6: 14.5, 13.0, 8.7 s)
  case $MODEL in 1.5b) share=0.2 ;; *) share=0.12 ;; esac
  run e2e-best python3 bench/bench_e2e.py --model "$MODEL" "${path_args[@]}" --workdir "$WORK" --skip-trl \
    --bare-vllm off "${peers_from[@]}" --compile-layers --use-fused-kernels --token-budget 65536 --fused-adamw \
    --checkpoint-layers auto --async-steps 1 --engine-process --gpu-memory-utilization "${SHARE:-$share}" --steps 6 \
    --out "$OUT/e2e_best_$MODEL.json"
elif [ "$part" = ledger ]; then  # the 4.3 GiB outside torch's allocator, piece by piece (bench/probe_memory.py):
  # grpo.py's set-up with the trainer's process group (lazy NCCL, grpo.py's since 2026-12-06), the same bound to the
  # device (before: every later group's NCCL communicator, vLLM's too, starts at once), then no process group
  run probe-memory-$MODEL python3 bench/probe_memory.py --model "$MODEL" --workdir "$WORK" \
    --out "$OUT/probe_memory_$MODEL.json"
  run probe-memory-bound-$MODEL python3 bench/probe_memory.py --model "$MODEL" --workdir "$WORK" --bind-device \
    --out "$OUT/probe_memory_bound_$MODEL.json"
  run probe-memory-nopg-$MODEL python3 bench/probe_memory.py --model "$MODEL" --workdir "$WORK" --no-process-group \
    --out "$OUT/probe_memory_nopg_$MODEL.json"
elif [ "$part" = levers2 ]; then  # what the memory defaults cost: each one off
  run e2e-no-offload python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --no-offload-optimizer --out "$OUT/e2e_no_offload.json"
  run e2e-no-expandable python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --no-expandable-segments --out "$OUT/e2e_no_expandable.json"
elif [ "$part" = fused ]; then  # model.use_fused_kernels: no [B, T, V] logits (8.8 GiB less in the 0.5B update's plan)
  run e2e-fused python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --use-fused-kernels --out "$OUT/e2e_fused.json"
  run e2e-fused-auto python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --use-fused-kernels --checkpoint-layers auto --out "$OUT/e2e_fused_auto.json"
elif [ "$part" = share ]; then  # 512 x 768 tokens need ~4.8 GB of KV cache at 0.5B; 0.3 of the H200 holds 42 GiB
  # async first: it is the lever likeliest to reach 0.4x TRL's step, and a call cut short keeps its JSON
  run e2e-share012-async python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --gpu-memory-utilization 0.12 --async-steps 1 --engine-process --out "$OUT/e2e_share012_async.json"
  run e2e-share012 python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --gpu-memory-utilization 0.12 --out "$OUT/e2e_share012.json"
elif [ "$part" = levers3 ]; then  # the two levers not yet measured end to end (2026-12-06): the fused LM head with
  # auto checkpointing (no [B, T, V] logits, so fewer layers recompute), and compiled layers with the engine generating
  # ahead in its own process (grpo.py refuses compile + async with an in-process engine)
  run e2e-fused-auto python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --use-fused-kernels --checkpoint-layers auto --out "$OUT/e2e_fused_auto.json"
  run e2e-compiled-async python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --compile-layers --async-steps 1 --engine-process --gpu-memory-utilization 0.12 --steps 6 \
    --out "$OUT/e2e_compiled_async.json"
elif [ "$part" = async ]; then
  run e2e-async6-inprocess python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off "${peers_from[@]}" \
    --gpu-memory-utilization 0.12 --async-steps 1 --steps 6 --out "$OUT/e2e_async6_inprocess.json"
  run e2e-async6-engine-process python3 bench/bench_e2e.py --model 0.5b --workdir "$WORK" --skip-trl --bare-vllm off \
    "${peers_from[@]}" --gpu-memory-utilization 0.12 --async-steps 1 --engine-process --steps 6 \
    --out "$OUT/e2e_async6_engine_process.json"
elif [ "$part" = smollm2-prep ]; then
  :  # the conversion above is all of it
elif [ "$part" = smollm2 ]; then  # a job (part `wait` after); async at 135M: MODEL=smollm2 ... best
  MODEL=smollm2
  # PEERS=verl (carry .gpu_verl1 .gpu_trl): flatrl, bare vLLM and verl in one job, the memory target's pair, where
  # a session's device time holds no TRL beside them
  peers=${PEERS-trl} verl_args=() name=e2e-smollm2  # PEERS= (empty): flatrl and bare vLLM alone
  if [[ ",$peers," == *,verl,* ]]; then
    name=e2e-verl-smollm2  # copy_job copies verl's console and metrics for e2e-verl-* jobs only
    [ -f /tmp/verl_site/verl/__init__.py ] || run verl-install bash bench/verl_device_install.sh
    verl_args=(--verl-attention "${VERL_ATTENTION:-flash-shim}" --verl-steps "${VERL_STEPS:-3}"
      --timeout-s "${VERL_TIMEOUT_S:-900}")
  fi
  start_job $name python3 bench/bench_e2e.py --model smollm2 --model-path /tmp/real/model --workdir "$WORK" \
    --peers "$peers" "${verl_args[@]}" --out "$jobs/$name/e2e_smollm2.json"
  follow_job
else
  echo "usage: bash bench/run_h200.sh 1|2|3|4|toy-grpo|gen-split|gpu-tests|defaults|gen-profile|flatrl|verl|wait|verl-wait|compile|fast|best|ledger|levers|levers2|levers3|fused|share|async|tokens|trl|smollm2-prep|smollm2"; exit 2
fi
echo "== done $(date -u); files in $OUT:"; ls -la "$OUT"
