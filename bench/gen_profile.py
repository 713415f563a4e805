"""Where a vLLM generate call's seconds go: a sampling profile of the calling thread during each `vllm.LLM.generate`.

Issue 21's question: flatrl's call alone is at bare vLLM's speed (bench_rollout's flatrl_n8_call, 0.978x at 0.5B
on d03c3d6), yet the same call inside grpo.py's loop takes 1.136x as long, with no compiling and no steal, and its
process CPU seconds near its wall seconds (which says little: a CUDA sync spins on the CPU). This module samples the
calling thread's Python stack every `interval_s` (sys._current_frames from a daemon thread) while each call runs,
and adds the seconds since the previous sample to the sample's innermost function (`self`) and to every function on
its stack once (`inclusive`), as "package/file.py:function": the loop's calls and the call alone side by side,
function by function, in seconds (`compare`).

    python bench/gen_profile.py --out calls.jsonl -- grpo.py --config X.yaml   # grpo.py, every call profiled
    bench_e2e.py --profile-gen / bench_rollout.py --profile-gen                  # what the benches run

A sample takes the GIL for about a stack walk (tens of microseconds at vLLM's depth): under 1% of a call at the
default 5 ms, and the same in both places. A thread that holds the GIL in a long C call delays the sample until it
lets go, and the seconds land on where it is then: the Python line after the call, or the C call's caller.

Each call also times Python's cyclic garbage collector (`GCTimer`, gc.callbacks): its pauses by generation. The
sampler cannot see them (they land on whichever function allocated). vLLM freezes the heap (gc.freeze) once its
engine has started, so in grpo.py's process the trainer's objects built before it are out of the collector's reach
too (864d4e1, 0.5B: 1.15M objects frozen, about a thousand tracked at the first call).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any

TOP = 40  # functions kept per call in each ranking


def frame_key(code: Any) -> str:
    """'vllm/v1/engine/core.py:step': the file from its package down (site-packages cut), and the function."""
    path = code.co_filename.replace("\\", "/")
    path = (
        path.rsplit("site-packages/", 1)[-1] if "site-packages/" in path else "/".join(path.split("/")[-2:])
    )
    return f"{path}:{code.co_name}"


class StackSampler:
    """Samples one thread's stack every interval_s while the block runs (the calling thread by default)."""

    def __init__(self, interval_s: float = 0.005, thread_id: int | None = None):
        self.interval_s, self.thread_id = interval_s, thread_id
        self.self_counts: collections.Counter[str] = collections.Counter()  # seconds by innermost function
        self.inclusive: collections.Counter[str] = collections.Counter()  # seconds by function on the stack
        self.samples, self.seconds = 0, 0.0
        self._stop = threading.Event()

    def _run(self) -> None:
        last = self._t0
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            now = time.perf_counter()
            # Each sample weighs the seconds since the one before: while the thread runs Python, this one gets the
            # GIL only at the switch interval (5 ms), so samples come sparser there than where the GIL is let go
            # (a sleep, a CUDA wait in torch), and counting samples would shrink the Python share.
            weight, last = now - last, now
            if frame is None:
                continue
            self.samples += 1
            self.self_counts[frame_key(frame.f_code)] += weight
            seen = set()
            while frame is not None:
                seen.add(frame_key(frame.f_code))
                frame = frame.f_back
            for key in seen:
                self.inclusive[key] += weight

    def __enter__(self) -> StackSampler:
        self.thread_id = self.thread_id or threading.get_ident()
        self._thread = threading.Thread(target=self._run, name="flatrl-gen-profile", daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()

    def summary(self, top: int = TOP) -> dict[str, Any]:
        """The call's seconds, samples, and each ranking's top functions with their sampled seconds."""

        def ranked(c: collections.Counter[str]) -> dict[str, float]:
            return {k: round(v, 4) for k, v in c.most_common(top)}

        return {
            "seconds": round(self.seconds, 4),
            "samples": self.samples,
            "interval_s": self.interval_s,
            "self_s": ranked(self.self_counts),
            "inclusive_s": ranked(self.inclusive),
        }


class GCTimer:
    """Seconds and runs of the cyclic garbage collector by generation while the block runs (any thread's)."""

    def __init__(self) -> None:
        self.seconds, self.runs = [0.0, 0.0, 0.0], [0, 0, 0]
        self._t0: float | None = None

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            gen = min(int(info.get("generation", 2)), 2)
            self.seconds[gen] += time.perf_counter() - self._t0
            self.runs[gen] += 1
            self._t0 = None

    def __enter__(self) -> GCTimer:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        return {
            "gc_s": round(sum(self.seconds), 4),
            "gc_s_by_generation": [round(x, 4) for x in self.seconds],
            "gc_runs_by_generation": self.runs,
        }


def install(sink: list[dict[str, Any]] | None = None, path: str | Path | None = None) -> list[dict[str, Any]]:
    """Wraps vllm.LLM.generate so that each call's summary is appended to `sink` (returned) and, with `path`, as one
    JSON line to that file (written at once: a run that dies later keeps its calls)."""
    from vllm import LLM

    sink = [] if sink is None else sink
    inner = LLM.generate
    if getattr(inner, "flatrl_profiled", False):
        raise RuntimeError("gen_profile.install: vllm.LLM.generate is profiled already")

    @functools.wraps(inner)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with GCTimer() as collector, StackSampler() as sampler:
            out = inner(self, *args, **kwargs)
        row = sampler.summary() | collector.summary() | {"call": len(sink)}
        sink.append(row)
        if path is not None:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return out

    generate.flatrl_profiled = True  # type: ignore[attr-defined]
    LLM.generate = generate
    return sink


def compare(a: dict[str, float], b: dict[str, float], top: int = 15) -> list[list[Any]]:
    """[function, seconds in a, seconds in b, a - b] for the functions whose seconds differ most (a function missing
    from one side's top list counts 0 there)."""
    rows = [
        [k, a.get(k, 0.0), b.get(k, 0.0), round(a.get(k, 0.0) - b.get(k, 0.0), 4)]
        for k in a.keys() | b.keys()
    ]
    return sorted(rows, key=lambda r: (-abs(r[3]), r[0]))[:top]


def mean_profile(calls: list[dict[str, Any]], key: str = "inclusive_s") -> dict[str, float]:
    """The functions' seconds averaged over calls (0 where a call's top list lacks one)."""
    total: collections.Counter[str] = collections.Counter()
    for c in calls:
        total.update(c[key])
    return {k: round(v / len(calls), 4) for k, v in total.items()} if calls else {}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON lines, one per generate call (appended)")
    p.add_argument("script", help="the script to run, e.g. grpo.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    a = p.parse_args(argv)
    script = Path(a.script).resolve()
    sys.path.insert(0, str(script.parent))  # the script's own imports (grpo.py's `import rollout`)
    install(path=a.out)
    sys.argv = [str(script), *(a.args[1:] if a.args[:1] == ["--"] else a.args)]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
