"""bench_e2e.py's verl peer: verl 0.9.1's `python -m verl.trainer.main_ppo` with GRPO, in a subprocess whose
PYTHONPATH starts with the verl payload (bench/build_verl_payload.sh, unpacked on the device by
bench/verl_device_install.sh into /tmp/verl_site), so that verl gets the transformers it pins (<5.11) while
flatrl and TRL keep the device's.

The run matches flatrl's (bench_e2e.py): the same random-init model folder, prompts of the same letters, batch
(`--num-prompts` x `--n`), lengths, lr 1e-6, no KL, no entropy term, temperature 1, `ignore_eos`, vLLM memory share
and reward (bench/e2e_reward.py's compute_score, verl's signature). Elsewhere verl keeps its defaults (the
command goes into the result): FSDP2 with fp32 master weights and bf16 compute, gradient checkpointing on, dynamic
micro-batches of `--token-budget` tokens, vLLM max_num_seqs 256 and max_num_batched_tokens 8192, one GPU with the
hybrid engine (actor and vLLM colocated; the v1 "sync" trainer). flash-attn, which verl's padding-free micro-batches
need, is flatrl's stand-in on torch's varlen flash kernel (the device has no flash-attn wheel; attention_overrides()
says why, and `--verl-attention sdpa-padded` gives the earlier runs' sdpa over padded micro-batches).
verl reads the prompt column as chat messages and always applies the tokenizer's chat template, so its parquet
holds [{"role": "user", "content": letters}] and the template writes the content alone: the prompt is the same
`--prompt-len` tokens that flatrl sends with `apply_chat_template: false`.
The real model's shape (`--model smollm2`: prompts of words, bench_e2e.REAL_LORA) adds LoRA as verl's GRPO-LoRA
examples set it (`model.lora_rank`, `lora_alpha`, `target_modules`, and `rollout.load_format=safetensors`, so vLLM
starts from the folder's weights and each sync sends the adapter alone; verl serves it through vLLM's LoRA path,
unmerged, as its default `model.lora.merge=False` does). Gradient checkpointing is on in every shape (verl's
default, stated in the command).

Figures from verl's own metrics (its file logger, `trainer.logger=[console,file]`, one JSON line a step):
`timing_s/step` per step, the phases `timing_s/*` (gen, reward, old_log_prob, adv, update_actor,
update_weights), `perf/max_memory_allocated_gb` / `perf/max_memory_reserved_gb` of the actor process. verl
logs no device-wide figure, so the device's used memory (total minus free, all processes) is sampled here
every 0.25 s: `peak_device_used_gib` over the training steps (from the first step's start to the last step's
log line), `peak_device_used_run_gib` over the whole subprocess (start-up, vLLM's profiling and graph capture
included).

A run that times out (or is interrupted) says where it waited before it is ended: every Python process of the run
dumps its threads' stacks on SIGUSR1 (bench/verl_no_trl/sitecustomize.py registers faulthandler where
FLATRL_VERL_STACKS names a folder), and the result's `stall` holds their innermost frames, the tails of Ray's
newest logs and when the console last moved. Then every process whose environment carries the run's
FLATRL_VERL_STACKS is killed, Ray's raylet and GCS included (they run in sessions of their own).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REWARD = BENCH / "e2e_reward.py"
NO_TRL = BENCH / "verl_no_trl"
FLASH_SHIM = BENCH / "verl_flash_shim"  # flatrl's flash-attn stand-in (attention_overrides says why)
# The folder where verl's processes write their stacks on SIGUSR1 (bench/verl_no_trl/sitecustomize.py); set for
# main_ppo alone, so its entry in a process's environment marks that process as one of the run's.
STACKS_ENV = "FLATRL_VERL_STACKS"
RAY_LOGS = Path("/tmp/ray/session_latest/logs")  # Ray's default temp dir: verl's ray.init sets none
# The chat template verl applies to every prompt: the message content alone, no role markers, no generation
# prompt (flatrl's `apply_chat_template: false`). `m.content` rather than `m['content']`: no quotes to escape
# inside a Hydra override.
RAW_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
MODULES = (
    "verl",
    "ray",
    "transfer_queue",
    "tensordict",
    "torchdata",
    "hydra",
)  # what `import verl ...` needs


def write_prompts(flatrl_parquet: str, path: Path) -> Path:
    """flatrl's prompt parquet rewritten in verl's schema: each prompt string becomes one user message."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(flatrl_parquet).to_pylist()
    for r in rows:
        r["prompt"] = [{"role": "user", "content": r["prompt"]}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def overrides(args, model: str, data: str, run_dir: str) -> list[str]:
    """The Hydra overrides of verl's ppo_trainer.yaml for the run (see the module docstring), then
    `--verl-override` as given (last, so they win)."""
    rollout = "actor_rollout_ref.rollout"
    actor = "actor_rollout_ref.actor"
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data}",
        f"data.val_files={data}",  # built even when validation never runs
        f"data.train_batch_size={args.num_prompts}",
        f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.response_len}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.shuffle=False",
        f"actor_rollout_ref.model.path={model}",
        f'actor_rollout_ref.model.custom_chat_template="{RAW_TEMPLATE}"',
        *attention_overrides(args),
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        *lora_overrides(args),
        f"{actor}.strategy=fsdp2",
        f"{actor}.optim.lr=1e-6",
        f"{actor}.ppo_mini_batch_size={args.num_prompts}",
        f"{actor}.use_dynamic_bsz=True",
        f"{actor}.ppo_max_token_len_per_gpu={args.token_budget}",
        f"{actor}.use_kl_loss=False",
        f"{actor}.entropy_coeff=0",
        f"{actor}.ppo_epochs=1",
        f"{rollout}.name=vllm",
        f"{rollout}.n={args.n}",
        f"{rollout}.tensor_model_parallel_size=1",
        f"{rollout}.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"{rollout}.ignore_eos=True",
        f"{rollout}.temperature=1.0",
        f"reward.custom_reward_function.path={REWARD}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        # Ray's CPU tokens. With num_cpus null Ray counts the host's cores (16 on the lent H200), and verl 0.9.1
        # asks for more actors of 1 CPU each than that on one GPU: the TaskRunner, TransferQueue's controller
        # and 8 storage units, the actor's placement group {CPU: 3}, reward.num_workers=8 RewardLoopWorkers,
        # the vLLMHttpServer and rollout.agent.num_workers=8 AgentLoopWorkers, 30 in all. The server then waits
        # for a CPU that never frees, silently: the likely stall of d146e60's run. The tokens only schedule
        # (these actors mostly wait), so 64 lets verl start as it would on a larger host.
        "ray_kwargs.ray_init.num_cpus=64",
        f"trainer.total_training_steps={args.verl_steps}",
        "trainer.logger=[console,file]",
        "trainer.project_name=flatrl_bench",
        "trainer.experiment_name=verl_e2e",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}/checkpoints",
        f"hydra.run.dir={run_dir}/hydra",
        *args.verl_override,
    ]


def attention_overrides(args) -> list[str]:
    """verl's attention. verl asks transformers for flash_attention_2 over padding-free ("remove padding")
    micro-batches, and the device has no flash-attn (PyPI has only its sdist, and no wheel is built for torch 2.11 +
    CUDA 13). `--verl-attention flash-shim` (the default) keeps verl's own settings and puts flatrl's flash-attn
    stand-in on verl's PYTHONPATH (`env`; bench/verl_flash_shim: torch's varlen flash kernel behind flash-attn's
    API). `sdpa-padded`, the runs before 2026-12-06: sdpa over padded micro-batches, since transformers 5.9's sdpa
    lets the sequences of a packed row attend to each other (logits off by 0.37 on a tiny Qwen2, CPU); with
    ignore_eos every sequence is prompt + response tokens long, so padding adds no tokens there."""
    if getattr(args, "verl_attention", "flash-shim") == "sdpa-padded":
        return [
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "actor_rollout_ref.model.use_remove_padding=False",
        ]
    return ["actor_rollout_ref.model.use_remove_padding=True"]  # verl's default, stated


def lora_overrides(args) -> list[str]:
    """verl's LoRA keys for the shape's LoRA (`args.lora`, None for full fine-tuning)."""
    if not args.lora:
        return []
    return [
        f"actor_rollout_ref.model.lora_rank={args.lora['rank']}",
        f"actor_rollout_ref.model.lora_alpha={args.lora['alpha']}",
        f"actor_rollout_ref.model.target_modules={args.lora['target_modules']}",
        # As verl's GRPO-LoRA examples: vLLM loads the base weights from the folder, so no base sync is needed.
        "actor_rollout_ref.rollout.load_format=safetensors",
    ]


def env(args, run_dir: str) -> dict[str, str]:
    """The verl subprocess's environment: TRL hidden and the payload first on PYTHONPATH (Ray's workers inherit it), verl's
    file logger at `run_dir`/metrics.jsonl, and vLLM's engine in its own process as verl runs it."""
    e = dict(os.environ)
    # Not the repo root: flatrl's top-level modules (data, log, rollout, ...) must not shadow anything of verl's.
    # NO_TRL first: its sitecustomize hides the TRL peer's TRL from verl (the file says why).
    shim = str(FLASH_SHIM) if getattr(args, "verl_attention", "flash-shim") == "flash-shim" else None
    e["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(NO_TRL), shim, args.verl_site, e.get("PYTHONPATH")) if p
    )
    e["VERL_FILE_LOGGER_PATH"] = f"{run_dir}/metrics.jsonl"
    e.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # flatrl's in-process setting; verl's server runs its own
    e.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not carried
    e["PYTHONUNBUFFERED"] = "1"
    # verl's Ray runtime env sets VLLM_LOGGING_LEVEL=WARN unless the launching shell sets it
    # (verl/trainer/constants_ppo.py get_ppo_ray_runtime_env drops every key already in os.environ): at WARN the
    # vLLM server's start-up (engine process, weights, memory profile, torch.compile, CUDA graphs) prints nothing,
    # and the H200 run at d146e60 went silent for its last 80 s there or just before. INFO says where it is.
    e.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    e.setdefault("RAY_DEDUP_LOGS", "0")  # every process's lines, not the first one of each pattern
    # The model is a local folder and the device has no network: no hub look-up, however quick to fail.
    e.setdefault("HF_HUB_OFFLINE", "1")
    return e


def parse_metrics(lines: list[str]) -> list[dict]:
    """verl's per-step metrics, from file-logger lines (`{"step": n, "data": {...}}`) or console lines
    (`step:n - key:value - ...`, possibly behind Ray's `(TaskRunner pid=..)` prefix); one dict per step with
    "step", in step order, the last line of a step winning."""
    rows: dict[int, dict] = {}
    number = re.compile(r"^(?:np\.\w+\()?(-?[\d.]+(?:e[-+]?\d+)?|nan|inf)\)?$")
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            d = json.loads(line)
            rows[int(d["step"])] = {"step": int(d["step"])} | d["data"]
            continue
        m = re.search(r"step:(\d+) - (.*)$", line)
        if not m:
            continue
        row = {"step": int(m.group(1))}
        for item in m.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            v = number.match(value.strip())
            if key and v:
                row[key] = float(v.group(1))
        rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def summarise(rows: list[dict]) -> dict:
    """Step times (median after the first), the phases' medians over the same steps, verl's memory figures."""
    rows = [r for r in rows if "timing_s/step" in r]
    if not rows:
        raise ValueError("no verl step has timing_s/step")
    steps = [r["timing_s/step"] for r in rows]
    later = rows[1:] or rows
    phases = {
        k.removeprefix("timing_s/"): statistics.median(r.get(k, 0.0) for r in later)
        for k in rows[-1]
        if k.startswith("timing_s/") and k != "timing_s/step"
    }
    peak = lambda key: max((r[key] for r in rows if r.get(key) is not None), default=None)  # noqa: E731
    return {
        "step_s": statistics.median(steps[1:] or steps),
        "first_step_s": steps[0],
        "steps_s": steps,
        "phases_s": phases,
        "peak_allocated_gib": peak("perf/max_memory_allocated_gb"),
        "peak_reserved_gib": peak("perf/max_memory_reserved_gb"),
        "mfu": statistics.median(r.get("perf/mfu/actor", 0.0) for r in later),
        "response_length_mean": rows[-1].get("response_length/mean"),
    }


class DeviceWatch:
    """Samples the device's used memory (total minus free, every process) every `period_s` in a thread, the
    device's clocks where NVML is there (`clocks`: (time, *common.GpuClocks.read()), busy % last), and the
    time at which each line of a run's metrics file (verl's, grpo.py's; None: none) appears."""

    def __init__(self, metrics: Path | None, period_s: float = 0.25) -> None:
        self.metrics, self.period_s = metrics, period_s
        self.samples: list[tuple[float, float]] = []  # (time, GiB used)
        self.clocks: list[tuple[float, ...]] = []  # (time, *GpuClocks.read())
        self.lines: list[float] = []  # time each metrics line was first seen
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        import common
        import torch

        gpu = common.GpuClocks.open()
        while not self.stop.is_set():
            free, total = torch.cuda.mem_get_info()
            now = time.perf_counter()
            self.samples.append((now, (total - free) / 2**30))
            if gpu is not None:
                try:
                    self.clocks.append((now, *gpu.read()))
                except Exception:  # one failed read ends the clocks, not the memory samples
                    gpu = None
            self.see_lines(now)
            self.stop.wait(self.period_s)

    def see_lines(self, now: float) -> None:
        """Record `now` as the time of each metrics line not seen before. A file that shrank (a run rewriting a
        previous run's file) drops the times of the lines it lost, so a later line is not dated by an old one."""
        if self.metrics is None:
            return
        n = self.metrics.read_bytes().count(b"\n") if self.metrics.is_file() else 0
        del self.lines[n:]
        self.lines += [now] * (n - len(self.lines))

    def __enter__(self) -> DeviceWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def peak(self, start: float = float("-inf"), end: float = float("inf")) -> float | None:
        """The largest sample in [start, end], GiB."""
        return max((gib for t, gib in self.samples if start <= t <= end), default=None)


def check_prompts(args, model: str, data: str) -> str | None:
    """None when verl's transformers, with RAW_TEMPLATE, renders every prompt of `data` to `--prompt-len`
    tokens; else the reason (run in the verl environment: its transformers is not the parent's)."""
    code = (
        "import sys, pyarrow.parquet as pq\n"
        "from transformers import AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1]); tok.chat_template = sys.argv[3]\n"
        "lens = set()\n"
        "for m in pq.read_table(sys.argv[2])['prompt'].to_pylist():\n"
        "    ids = tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True)\n"
        "    lens.add(len(ids['input_ids'] if hasattr(ids, 'keys') else ids))\n"
        "import transformers; print(transformers.__version__, type(tok).__name__, sorted(lens))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, model, data, RAW_TEMPLATE],
        env=env(args, str(Path(data).parent)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0:
        return f"the prompt check failed in verl's environment: {p.stderr.strip()[-1500:]}"
    version, cls, lens = p.stdout.split(maxsplit=2)
    if json.loads(lens) != [args.prompt_len]:
        return f"transformers {version} {cls} renders the bench prompts to {lens.strip()} tokens, not {args.prompt_len}"
    return None


def available(args) -> str | None:
    """None when verl can run here; else why not."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA: verl's vLLM rollout and FSDP engine run on GPUs"
    p = subprocess.run(
        [sys.executable, "-c", f"import {', '.join(MODULES)}"],
        env=env(args, "/tmp"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0:
        return (
            f"verl is not importable with {args.verl_site} first on PYTHONPATH (build it with "
            f"bench/build_verl_payload.sh, unpack it with bench/verl_device_install.sh): {p.stderr.strip()[-500:]}"
        )
    return None


def run(args, model: str, data: str, work: str) -> dict:
    """verl's main_ppo in a subprocess; its metrics and the sampled device memory as bench_e2e's result dict.
    An interruption (bench_e2e's SIGTERM handler, Ctrl-C) stops verl as a timeout does and goes on up, carrying
    the result dict so far as the exception's `result`."""
    from common import clock_summary

    why = available(args)
    if why:
        return {"skipped": why}
    run_dir = f"{work}/verl_run"
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    metrics = Path(run_dir, "metrics.jsonl")
    metrics.unlink(missing_ok=True)
    verl_data = str(write_prompts(data, Path(work, "prompts_verl.parquet")))
    bad = check_prompts(args, model, verl_data)
    if bad:
        return {"error": bad}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(args, model, verl_data, run_dir)]
    log = Path(run_dir, "console.log")
    t0 = time.perf_counter()
    with DeviceWatch(metrics) as watch:
        try:
            rc, stall = supervise(cmd, env(args, run_dir), run_dir, log, args.timeout_s)
        except BaseException as e:
            wall = time.perf_counter() - t0
            e.result = {  # type: ignore[attr-defined]
                "error": f"verl's main_ppo interrupted ({type(e).__name__}: {e}) after {wall:.0f} s",
                "tail": log.read_text(errors="replace")[-4000:] if log.is_file() else "",
                "stall": getattr(e, "stall", None),
                "command": cmd,
            }
            raise
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    lines = metrics.read_text().splitlines() if metrics.is_file() else text.splitlines()
    rows = parse_metrics(lines)
    failed = failure(rc, rows, wall, text, stall, cmd)
    if failed:
        return failed
    out = summarise(rows)
    first_start = watch.lines[0] - out["first_step_s"] if watch.lines else None
    out |= {
        # Without the metrics file (its path reaches verl through the environment Ray's workers inherit) the
        # steps' window is unknown, and the whole run's peak stands in, marked as such.
        "peak_device_used_gib": watch.peak(first_start, watch.lines[-1]) if watch.lines else watch.peak(),
        "peak_device_used_window": "steps" if watch.lines else "run (no metrics file: parsed the console)",
        "peak_device_used_run_gib": watch.peak(),
        "gpu": clock_summary(watch.clocks, first_start, watch.lines[-1]) if watch.lines else None,
        "process_wall_s": round(wall, 1),
        "startup_s": round(first_start - t0, 1) if first_start else None,
        "steps_logged": len(rows),
        "command": cmd,
    }
    return out


def failure(
    rc: int | str, rows: list[dict], wall: float, text: str, stall: dict | None, cmd: list[str]
) -> dict | None:
    """None for a run that exited 0 with steps logged; else the error dict (console tail, where it stalled, the
    command). The steps logged before a timeout or a crash are still measurements: their summary goes under
    "partial", never where bench_e2e draws ratios from (a step_s at the top)."""
    if rc == 0 and rows:
        return None
    failed = {
        "error": f"verl's main_ppo exited {rc} after {wall:.0f} s with {len(rows)} steps logged",
        "tail": text[-4000:],
        "stall": stall,
        "command": cmd,
    }
    timed = [r for r in rows if "timing_s/step" in r]
    if timed:
        failed["partial"] = summarise(timed) | {"steps_logged": len(timed)}
    return failed


def supervise(
    cmd: list[str], env: dict[str, str], run_dir: str, log: Path, timeout_s: float, dump_wait_s: float = 3.0
) -> tuple[int | str, dict | None]:
    """Runs `cmd` (verl's main_ppo, Ray inside) in its own session with its output in `log`, for at most
    `timeout_s`; then ends every process of the run, Ray's daemons included. Returns (exit code, or "timeout
    after N s"; where it stalled: None unless it timed out, see `stall`). On an interruption (any
    BaseException while waiting) the same diagnosis is made, set as the exception's `stall`, and it goes on up.

    The run's processes are found by FLATRL_VERL_STACKS=<run_dir>/stacks in their environment: Ray starts its
    raylet and GCS in sessions of their own, so killing main_ppo's process group leaves them running, holding
    their GPU memory for the next framework or the next call on the same machine."""
    stacks = Path(run_dir, "stacks")
    shutil.rmtree(stacks, ignore_errors=True)
    stacks.mkdir(parents=True)
    marker = f"{STACKS_ENV}={stacks}".encode()
    started = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=run_dir,
            env=env | {STACKS_ENV: str(stacks)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc: int | str = proc.wait(timeout=timeout_s)
            stall = None
        except BaseException as e:
            timed_out = isinstance(e, subprocess.TimeoutExpired)
            stall = stall_report(proc, marker, stacks, log, started, dump_wait_s)
            if not timed_out:
                e.stall = stall  # type: ignore[attr-defined]
                raise
            rc = f"timeout after {timeout_s:.0f} s"
        finally:
            left = kill_run(proc, marker)
            if left:
                print(f"e2e_verl: pids {left} of the verl run survived SIGKILL", file=sys.stderr, flush=True)
    return rc, stall


def stall_report(
    proc: subprocess.Popen, marker: bytes, stacks: Path, log: Path, started: float, dump_wait_s: float
) -> dict:
    """Where a run that is still going waits: every Python process of the run (those with a file in `stacks` that
    catch SIGUSR1: not a C++ daemon that Ray forked from Python) dumps its threads' stacks on SIGUSR1; after
    `dump_wait_s` their innermost frames, the tails of Ray's newest logs, and when the console last moved."""
    last = log.stat().st_mtime if log.is_file() else None
    cmdlines = {}
    for pid in sorted(set(marked_pids(marker)) | {proc.pid}):
        if Path(stacks, f"{pid}.txt").is_file() and catches(pid, signal.SIGUSR1):
            cmdlines[pid] = cmdline(pid)
            with_signal(pid, signal.SIGUSR1)
    signalled = time.time()
    time.sleep(dump_wait_s)
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return {
        "stacks": stack_summary(stacks, cmdlines),
        "stacks_dir": str(stacks),
        "signalled_pids": len(cmdlines),
        "ray_logs": ray_log_tail(RAY_LOGS, started),
        "last_console_line": lines[-1][-300:] if lines else None,
        "last_console_output_s": round(last - started, 1) if last else None,  # seconds after the start
        "silent_s": round(signalled - last, 1) if last else None,  # from then to the dumps
    }


def catches(pid: int, sig: int) -> bool:
    """Whether `pid` has a handler for `sig` (its SigCgt mask in /proc/<pid>/status): else the signal's default
    action, for SIGUSR1 the end of the process, would apply."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(x.split()[1], 16) for x in status.splitlines() if x.startswith("SigCgt:")), 0)
    return bool(mask >> (sig - 1) & 1)


def marked_pids(marker: bytes) -> list[int]:
    """The live processes whose environment holds `marker` (an exact NAME=VALUE entry), this one excluded."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            environ = (d / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if marker in environ.split(b"\0"):
            pids.append(int(d.name))
    return pids


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def with_signal(pid: int, sig: int) -> None:
    """Sends `sig` to `pid`, which may have gone since it was listed."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def cmdline(pid: int) -> str:
    """The command line of `pid` on one line, 120 characters (Ray names its workers "ray::Class.method")."""
    try:
        return " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split())[:120]
    except OSError:
        return "?"


def kill_run(proc: subprocess.Popen, marker: bytes, wait_s: float = 10.0) -> list[int]:
    """SIGKILLs main_ppo's process group and every process that carries the run's `marker`, until none is left
    (or `wait_s` passed); returns the pids that still ran after that (none, normally)."""
    if proc.poll() is None:
        with_signal(-proc.pid, signal.SIGKILL)  # its session's group: main_ppo and what it forked
    deadline = time.monotonic() + wait_s
    while True:
        pids = [p for p in marked_pids(marker) if alive(p)]
        for pid in pids:
            with_signal(pid, signal.SIGKILL)
        if (not pids and proc.poll() is not None) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    try:
        proc.wait(timeout=1)
    except subprocess.TimeoutExpired:  # stuck in the kernel (a driver call): reported by the caller's checks
        pass
    return [p for p in pids if alive(p)]


FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$')


def stack_summary(stacks: Path, cmdlines: dict[int, str], frames: int = 4, limit: int = 6000) -> str:
    """The dumps in `stacks` (faulthandler's format, most recent call first), shortened: per process its command
    line and, per thread, the innermost `frames` frames as "function (file:line)" joined by " < "; processes whose
    threads read the same are listed once with all their pids; those in verl or vLLM code first; `limit` chars."""
    groups: dict[str, list[int]] = {}
    for path in stacks.glob("*.txt"):
        if not path.stem.isdigit():
            continue
        threads: list[list[str]] = []
        for line in path.read_text(errors="replace").splitlines():
            if line.rstrip().endswith("(most recent call first):"):
                threads.append([])
            elif threads and (m := FRAME.match(line)) and len(threads[-1]) < frames:
                threads[-1].append(f"{m[3]} ({Path(m[1]).name}:{m[2]})")
        if not threads:  # never signalled, or gone before it could write
            continue
        counts = Counter(" < ".join(t) or "(no Python frame)" for t in threads)
        body = "\n".join(f"  {n}x {t}" if n > 1 else f"  {t}" for t, n in counts.items())
        groups.setdefault(body, []).append(int(path.stem))
    blocks = []
    for body, pids in groups.items():
        pids.sort()
        head = f"pid {pids[0]}" if len(pids) == 1 else f"pids {','.join(map(str, pids))}"
        blocks.append(f"{head} [{cmdlines.get(pids[0], '?')}]\n{body}")
    blocks.sort(key=lambda b: ("verl" not in b and "vllm" not in b, b))
    text = "\n".join(blocks)
    return text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} more characters)"


def ray_log_tail(logs: Path, since: float, files: int = 8, lines: int = 6, width: int = 300) -> str:
    """The last `lines` lines of the `files` Ray logs (*.out, *.err, *.log) written last since `since` (epoch s)."""
    try:
        found = [p for p in logs.iterdir() if p.suffix in (".out", ".err", ".log") and p.is_file()]
    except OSError:
        return f"no Ray logs at {logs}"
    found = [p for p in found if p.stat().st_size and p.stat().st_mtime >= since]
    found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    out = []
    for p in found[:files]:
        tail = p.read_bytes()[-20000:].decode(errors="replace").splitlines()[-lines:]
        out.append(f"== {p.name}\n" + "\n".join(x[:width] for x in tail))
    return "\n".join(out) or f"no Ray log written at {logs} since the start"
