"""What every bench script shares: the benchmark models, the hardware record, the one-line JSON result.

Models (`--model`): `toy` is toy.py's tiny Qwen2 (CPU, seconds); `0.5b` and `1.5b` are random-initialised
Qwen2.5-0.5B / -1.5B shapes (the real config.json sizes, tied embeddings, bf16 weights), built on the fly: no hub.
Their tokenizer is byte-level BPE without merges over the model's 151,936 ids (the 256 bytes encode, every other
id decodes to a placeholder), so `AutoTokenizer` (which turns any qwen2 folder into Qwen2Tokenizer) round-trips
it, every id the model samples decodes, and a prompt of k ASCII letters is exactly k tokens.
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench scripts run as `python bench/x.py`: the repo's modules sit one level up
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
}  # fmt: skip
VOCAB = 151936
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}  # Qwen2.5's ids


def make_tokenizer(vocab_size: int = VOCAB):
    """Byte-level BPE with no merges over `vocab_size` ids, in Qwen2's pipeline (see the module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import toy

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = {k: v for k, v in SPECIALS.items() if v < vocab_size}
    taken = set(specials.values())
    vocab |= {f"x{i}": i for i in range(len(vocab), vocab_size) if i not in taken} | specials
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(toy.QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(k, special=True) for k in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def model_config(size: str) -> Any:
    """The Qwen2Config of the benchmark model `size` (0.5b, 1.5b): Qwen2.5's config.json values, bf16."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB, max_position_embeddings=32768, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=SPECIALS["<|im_end|>"], pad_token_id=SPECIALS["<|endoftext|>"],
        use_sliding_window=False, dtype="bfloat16", **SHAPES[size],
    )  # fmt: skip


def build_model(size: str, out: Path, device: str | None = None) -> Path:
    """The benchmark model `size` (toy, 0.5b, 1.5b) saved under `out` (reused when already there).

    Returns the model folder: config.json, safetensors, generation_config.json, tokenizer.
    """
    out = Path(out)
    if size == "toy":
        import toy

        if not (out / "model" / "config.json").is_file():
            toy.build(out, n_train=64, n_val=8)
        return out / "model"
    # The tokenizer is written last and marks a finished folder. A folder with config.json and no tokenizer (a
    # build that died in make_tokenizer: the H200's first run had no tyro for `import toy`) was once reused, and
    # AutoTokenizer then made a Qwen2Tokenizer of one id that encodes every prompt to [] (transformers 5.17-5.19).
    if (out / "tokenizer.json").is_file():
        return out
    tokenizer = make_tokenizer()  # before any file is written
    from transformers import GenerationConfig, Qwen2ForCausalLM

    cfg = model_config(size)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.5B parameters on the GPU takes a second, on a CPU minutes
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def per_size(sizes: str, bench_size: Any) -> dict[str, Any]:
    """{size: bench_size(size)} for each of the comma-separated `sizes`, freeing memory between them."""
    import gc

    out = {}
    for size in sizes.split(","):
        out[size] = bench_size(size)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` token ids drawn uniformly from [300, vocab) (no special ids), reproducible."""
    rng = random.Random(seed)
    lo = min(300, vocab // 2)
    return [[rng.randrange(lo, vocab) for _ in range(length)] for _ in range(n)]


def hardware() -> dict[str, Any]:
    """The machine the figures come from: GPU (name, memory, count) or CPU, and library versions."""
    import log

    info = log.run_info()  # FLATRL_COMMIT, set by run_h200.sh, names the commit on the GPU machine
    out: dict[str, Any] = {
        "date": info["date"], "commit": info["commit"], "dirty": info["dirty"], "host": platform.node(),
        "python": info["versions"]["python"], "torch": torch.__version__,
        "transformers": info["versions"]["transformers"], "vllm": info["versions"]["vllm"],
    }  # fmt: skip
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1)}
        out["gpu_count"] = torch.cuda.device_count()
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            out["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            out["driver"] = None
    else:
        out["gpu"] = None
    return out | {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "host_loop_s": host_loop_seconds()}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_loop_seconds(n: int = 2_000_000) -> float:
    """Seconds of a fixed pure-Python loop (best of 3): how fast this host runs Python, single-threaded. vLLM's
    decode at the 0.5B shape is bound by host-side Python, so end-to-end ratios taken on different hosts differ
    with it (H200, 2026-12-03: TRL's step took 23.5 s on one host and 30.4-35.3 s on others, same settings)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        acc = 0
        for i in range(n):
            acc += i & 7
        best = min(best, time.perf_counter() - start)
    return round(best, 4)


def emit(result: dict[str, Any], out: str | None) -> dict[str, Any]:
    """Prints `result` as one JSON line (and writes it to `out`); returns it."""
    line = json.dumps(result, default=float)
    print(line, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(line + "\n")
    return result


class Clock:
    """Wall seconds of a block, after the GPU's queued work: `with Clock() as c: ...; c.s`."""

    def __enter__(self) -> Clock:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.s = time.perf_counter() - self.t0


def gib(n: float) -> float:
    """Bytes -> GiB, rounded to 3 decimals."""
    return round(n / 2**30, 3)


def now() -> str:
    """UTC time, for file names and logs."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# NVML's clocks-event bits (nvml.h, nvmlClocksEventReason*): the device ran below its top SM clock because of
# its power limit, or of its temperature.
POWER_CAP_BITS = 0x4 | 0x80  # software power cap, hardware power brake
THERMAL_BITS = 0x20 | 0x40 | 0x8  # software thermal slowdown, hardware thermal slowdown, hardware slowdown


class GpuClocks:
    """The device's SM clock (MHz), temperature (C), power draw (W) and clocks-event reasons, read through NVML:
    nvidia-ml-py's `pynvml` where installed, else the copy vLLM ships (vllm/third_party/pynvml.py, loaded by its
    path so vLLM itself is not imported). `GpuClocks.open()` is None without either, or without a device.
    2026-12-06 (01e8306): three generate calls in a row on one engine each took longer than the one before
    (0.5B 5.40, 5.54, 6.02 s), so a bench that compares runs made one after another needs to know the clocks."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle

    @classmethod
    def open(cls) -> GpuClocks | None:
        if not torch.cuda.is_available():
            return None
        try:
            nvml = load_nvml()
            if nvml is None:
                return None
            nvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            index = int(visible) if visible.isdigit() else 0
            return cls(nvml, nvml.nvmlDeviceGetHandleByIndex(index))
        except Exception:  # NVML there but unusable (no driver library): no clocks; the bench still runs
            return None

    def read(self) -> tuple[float, float, float, int, float]:
        """(SM clock MHz, temperature C, power W, clocks-event reasons bitmask, busy %) now. Busy: NVML's
        utilization.gpu, the share of its last sample period (1/6 to 1 s) in which a kernel ran; -1 where the
        bindings lack it. A phase whose device is busy far less than all the time is bound by the host."""
        n, h = self.nvml, self.handle
        # newer bindings name it ClocksEventReasons; the older name stays in both
        reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or n.nvmlDeviceGetCurrentClocksThrottleReasons
        busy = getattr(n, "nvmlDeviceGetUtilizationRates", None)
        return (
            float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
            float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
            n.nvmlDeviceGetPowerUsage(h) / 1000.0,
            int(reasons(h)),
            float(busy(h).gpu) if busy else -1.0,
        )


def load_nvml() -> Any:
    """NVML's Python bindings: `pynvml` (nvidia-ml-py) where installed, else vLLM's copy loaded by its file path
    (vllm/__init__.py, which takes seconds, does not run); None without either."""
    import importlib.util

    try:
        import pynvml

        return pynvml
    except ImportError:
        pass
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "third_party" / "pynvml.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("flatrl_bench_pynvml", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the module looks itself up there while it loads
    spec.loader.exec_module(module)
    return module


def clock_summary(
    samples: list[tuple[float, ...]],
    start: float = float("-inf"),
    end: float = float("inf"),
) -> dict[str, float] | None:
    """What `samples` of (time, SM MHz, C, W, reasons[, busy %]) say over [start, end]: the mean and lowest SM
    clock, the hottest reading, the mean power, the share of samples slowed by the power limit and by heat, and the
    mean busy % (None: no sample has it). None: no sample in the window."""
    window = [s for s in samples if start <= s[0] <= end]
    if not window:
        return None
    k = len(window)
    busy = [s[5] for s in window if len(s) > 5 and s[5] >= 0]
    return {
        "sm_mhz_mean": round(sum(s[1] for s in window) / k, 1),
        "sm_mhz_min": min(s[1] for s in window),
        "temp_c_max": max(s[2] for s in window),
        "power_w_mean": round(sum(s[3] for s in window) / k, 1),
        "power_capped_share": round(sum(bool(s[4] & POWER_CAP_BITS) for s in window) / k, 3),
        "thermal_share": round(sum(bool(s[4] & THERMAL_BITS) for s in window) / k, 3),
        "busy_pct_mean": round(sum(busy) / len(busy), 1) if busy else None,
        "samples": k,
    }


class ClockWatch:
    """Reads GpuClocks every `period_s` in a thread: `with ClockWatch() as w: ...; clock_summary(w.samples, a, b)`.
    Without NVML it samples nothing and every summary is None."""

    def __init__(self, period_s: float = 0.1) -> None:
        import threading

        self.period_s, self.samples = period_s, []
        self.clocks = GpuClocks.open()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while self.clocks is not None and not self.stop.is_set():
            try:
                self.samples.append((time.perf_counter(), *self.clocks.read()))
            except Exception:  # one failed read (a driver hiccup) ends the sampling, not the bench
                return
            self.stop.wait(self.period_s)

    def __enter__(self) -> ClockWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


# The probe HostWatch runs in its own process: a fixed loop (as host_loop_seconds', shorter) every period, each
# timing printed with its end on the clock every process shares (perf_counter: CLOCK_MONOTONIC on Linux).
HOST_PROBE = """
import sys, time
n, period = int(sys.argv[1]), float(sys.argv[2])
while True:
    t0 = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i & 7
    t1 = time.perf_counter()
    print(f"{t1:.6f} {(t1 - t0) * 1e3:.4f}", flush=True)
    time.sleep(period)
"""


class HostWatch:
    """The host's Python speed through a block, timed from another process: every `period_s` a fixed loop of `n`
    iterations runs on whichever core is free, so the measured process's GIL and threads are not touched (about
    1.5% of one core at the defaults). `samples`: (perf_counter time, loop ms); `mean(start, end)`. A host that
    slows under a neighbour's load shows as longer loops, in the phase where it happened (864d4e1's lease:
    host_loop_s 0.077 s at one bench's start and 0.138 at the next's, ten minutes later)."""

    def __init__(self, period_s: float = 0.5, n: int = 200_000) -> None:
        import threading

        self.period_s, self.n = period_s, n
        self.samples: list[tuple[float, float]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        for line in self.proc.stdout:
            when, ms = line.split()
            self.samples.append((float(when), float(ms)))

    def __enter__(self) -> HostWatch:
        cmd = [sys.executable, "-c", HOST_PROBE, str(self.n), str(self.period_s)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        self.proc.wait()
        self.thread.join()

    def mean(self, start: float = float("-inf"), end: float = float("inf")) -> float | None:
        """The mean loop ms of the samples that ended in [start, end]; None: none did."""
        window = [ms for when, ms in self.samples if start <= when <= end]
        return round(sum(window) / len(window), 3) if window else None
