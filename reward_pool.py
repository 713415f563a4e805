"""The reward function's worker pool: `RewardPool` scores (prompt, response) items with reward.py's dispatch or a
custom function in worker processes, with a per-call timeout. A failing call scores 0.0 and is counted in
`reward/errors*` instead of stopping training, but a batch where most calls fail (`max_error_frac`) stops it with
the first error.

Deviations from verl:
1. The pool launches workers with `subprocess` (a fresh interpreter, like multiprocessing's "spawn"), not
   multiprocessing: spawn and forkserver re-import the trainer's `__main__` (grpo.py, hence torch and vLLM)
   in every worker. A worker imports only this file, reward.py, the user's file, and whatever unpickling items needs.
   Each worker leads its own process group; the group is killed on a timeout, at close(), and (by the worker
   itself) when the trainer dies, so processes a reward function starts do not outlive the run.
2. A reward function may print, as verl's own scorers do (countdown prints a sample now and then): the call
   scores normally and is counted in `reward/printed`. Its text never reaches the trainer's stdout, where the
   console metrics go: it is captured, and the first printing call's text of each batch goes to stderr.
   `print_is_error=True` makes such a call score 0.0 instead (`reward/errors_print`). A worker's stderr is
   captured too (at the fd level) and shown the same way; each text in the log is cut at 4 KB, saying how much
   was cut. With num_workers 0 (in process) stderr is not captured.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from reward import FnSpec, load_scorer

_log = logging.getLogger(__name__)


def _is_finite_number(x: Any) -> bool:
    if isinstance(x, (str, bytes)) or not hasattr(x, "__float__"):
        return False
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError, OverflowError):
        return False


_TEXT_CAP = 4096  # characters (bytes for stderr) of one call's text kept for the log: 40 MB a step was seen


def _cap(text: str) -> str:
    """text, cut to _TEXT_CAP characters with a count of what was cut."""
    cut = len(text) - _TEXT_CAP
    return text if cut <= 0 else f"{text[:_TEXT_CAP]}... [{cut} more characters cut]"


def _score_one(scorer: Callable[[dict], Any], item: dict, print_is_error: bool) -> tuple:
    """(status, reward, extras, message); status is "ok", "exception", "bad_type" or "print"; message is the
    error, or for "ok" what the call printed ("" if nothing)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            result = scorer(item)
    except (Exception, SystemExit) as e:
        return "exception", 0.0, {}, _cap(f"{type(e).__name__}: {e}")
    printed = out.getvalue()
    if print_is_error and printed:
        return "print", 0.0, {}, f"printed to stdout: {printed[:200]!r}"
    extras = {}
    if isinstance(result, dict):
        extras = {k: float(v) for k, v in result.items() if k != "score" and _is_finite_number(v)}
        result = result.get("score", "<no 'score' key>")
    if not _is_finite_number(result):
        return "bad_type", 0.0, {}, f"reward is not a finite number: {result!r:.200}"
    return "ok", float(result), extras, _cap(printed)


# ---------------------------------------------------------------- the pool

_STARTUP_TIMEOUT_S = 60.0  # a fresh interpreter plus the user's file; generous for a loaded machine
_ERROR_CAUSES = ("timeout", "exception", "bad_type", "print", "out_of_range")


def _worker_main(fd: int) -> None:
    """A pool worker: build the scorer from the spec it is sent, then answer (index, item) until None/EOF.
    It leads its own process group (start_new_session): when it stops, or the trainer dies, it kills the group,
    so processes the reward function started do not outlive it."""
    ppid = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(ppid,), daemon=True).start()
    conn = Connection(fd)
    fn_spec, print_is_error = conn.recv()
    try:
        scorer = load_scorer(fn_spec)
    except Exception as e:
        conn.send(("init_error", _cap(f"{type(e).__name__}: {e}")))
        return
    conn.send(("ready",))
    with contextlib.suppress(EOFError, OSError):
        while (msg := conn.recv()) is not None:
            result = _score_one(scorer, msg[1], print_is_error)
            sys.stderr.flush()  # the trainer reads this call's stderr once it has the result
            conn.send(("result", msg[0], result))
    os.killpg(0, signal.SIGKILL)


def _exit_with_parent(ppid: int) -> None:
    """Kill the worker's group once the trainer is gone, even while a call hangs (a thread in the worker)."""
    while os.getppid() == ppid:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


class _Worker:
    """One worker process, the item it is scoring (None if idle) and when it must answer by."""

    def __init__(self, fn_spec: FnSpec, print_is_error: bool):
        parent, child = socket.socketpair()
        here = os.path.dirname(os.path.abspath(__file__))
        code = f"import sys; sys.path.insert(0, {here!r}); import reward_pool; reward_pool._worker_main({child.fileno()})"
        # stdout -> /dev/null: even fd-level writes (C extensions, os.write) never reach the trainer's output;
        # stderr -> a file the trainer reads after each call, so it can cap what reaches its log.
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
            pass_fds=[child.fileno()],
            start_new_session=True,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send((fn_spec, print_is_error))
        self.ready, self.task, self.deadline = False, None, time.monotonic() + _STARTUP_TIMEOUT_S

    def take_stderr(self) -> str:
        """What the worker wrote to stderr since the last take (its first _TEXT_CAP bytes), then empty the file.
        The worker shares the file's offset, so its next write lands at the start again."""
        fd = self.stderr.fileno()
        size = os.fstat(fd).st_size
        text = os.pread(fd, _TEXT_CAP, 0).decode(errors="replace")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        return text + (f"... [{size - _TEXT_CAP} more bytes cut]" if size > _TEXT_CAP else "")

    def exit_code(self) -> int:
        """Kill the worker's group and reap it; the worker's exit status (-9 if it was still running)."""
        if self.proc.returncode is None:  # never killpg a reaped leader: its pid could be someone else's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        self.exit_code()
        self.conn.close()
        self.stderr.close()


class _CallTimeout(BaseException):
    """Raised by SIGALRM in an in-process call; a BaseException so the function's `except Exception` lets it by."""


class RewardPool:
    """Score (prompt, response) items with a reward function in worker processes, never raising for one call.

    Args:
        fn_spec: (path, name) of a custom function (see load_reward_fn), or (path, name, keyword arguments for
            every call), or None for default_compute_score.
        num_workers: worker processes; 0 scores in this process (for debugging: breakpoints work). There a finite
            timeout_s is enforced with SIGALRM, which works only in the main thread: score() from another thread
            raises then, unless timeout_s is inf.
        timeout_s: per-call limit; a worker past it is killed with the processes it started and replaced, the
            item scores 0.0.
        print_is_error: a call that prints to stdout scores 0.0 (deviation 5 in the module docstring); by
            default it scores normally and is only counted.
        max_error_frac: score() raises when more than this fraction of its calls failed: a run whose rewards are
            all zero is broken, not learning. 1.0 never raises.
        max_abs_reward: a reward beyond +-this scores 0.0 and counts in reward/errors_out_of_range (a 1e308
            passes the finite check, then makes the loss NaN).
    Raises:
        FileNotFoundError / ValueError at construction if the function cannot be loaded (naming the path, and
        the exit code if importing it ended the worker) or an argument is out of range.
    Not thread-safe: one score() at a time.
    """

    def __init__(
        self,
        fn_spec: FnSpec,
        num_workers: int = 4,
        timeout_s: float = 10.0,
        print_is_error: bool = False,
        max_error_frac: float = 0.5,
        max_abs_reward: float = 1e6,
    ):
        self.fn_spec, self.num_workers, self.timeout_s = fn_spec, num_workers, timeout_s
        self.print_is_error = print_is_error
        self.max_error_frac, self.max_abs_reward = max_error_frac, max_abs_reward
        self.last_errors: list[str] = []  # messages of the failed calls of the latest score(), for debugging
        self.last_stderr: list[str] = []  # what the calls of the latest score() wrote to stderr (capped)
        self.last_extras: list[dict[str, float]] = []  # each item's extra numeric keys in the latest score()
        self._workers: list[_Worker] = []
        for name, ok, allowed in (
            ("num_workers", num_workers >= 0, ">= 0 (0: score in the trainer's process)"),
            ("timeout_s", timeout_s > 0, "> 0 (inf: no limit)"),
            ("max_error_frac", 0 <= max_error_frac <= 1, "in [0, 1]"),
            ("max_abs_reward", max_abs_reward > 0, "> 0"),
        ):
            if not ok:
                raise ValueError(f"reward pool: {name}={getattr(self, name)} must be {allowed}")
        if fn_spec is not None and not Path(fn_spec[0]).expanduser().is_file():
            raise FileNotFoundError(f"reward function file not found: {fn_spec[0]}")
        if num_workers == 0:
            self._scorer = load_scorer(fn_spec)
            return
        self._workers = [_Worker(fn_spec, print_is_error) for _ in range(num_workers)]
        for w in self._workers:  # wait for every worker to load the function, so a bad spec fails here
            msg = ("init_error", "startup timed out")
            try:
                if w.conn.poll(_STARTUP_TIMEOUT_S):
                    msg = w.conn.recv()
            except (EOFError, OSError):  # os._exit / sys.exit / a crash at module level
                stderr = w.take_stderr().strip()
                why = f"it exited with code {w.exit_code()} while importing {fn_spec[0] if fn_spec else __file__}"
                msg = ("init_error", why + (f"; its stderr: {stderr}" if stderr else ""))
            if msg[0] != "ready":
                self.close()
                raise ValueError(f"reward function {fn_spec} failed to load in a worker: {msg[1]}")
            w.ready, w.deadline = True, math.inf

    def score(self, items: list[dict]) -> tuple[list[float], dict[str, float]]:
        """Reward every item; failures score 0.0 and are counted.

        Args:
            items: dicts with keys data_source, prompt, response, ground_truth, extra_info.
        Returns:
            (rewards, metrics): one float per item, in order (their extra numeric keys in `last_extras`);
            metrics `reward/errors` (count of failed calls),
            `reward/errors_{timeout,exception,bad_type,print,out_of_range}`, `reward/printed` (calls that
            printed to stdout, errors or not), and `reward/<key>` the mean of each extra numeric key of dict
            results over the items that returned it.
        Raises:
            RuntimeError when more than max_error_frac of the calls failed, with the first failure's text; or
            with num_workers 0 and a finite timeout_s, when called outside the main thread.
        """
        results: list[tuple] = [("exception", 0.0, {}, "not scored")] * len(items)
        self.last_stderr = []
        if self.num_workers == 0:
            results = [self._score_in_process(it) for it in items]
        else:
            self._run(items, results)
        for i, (status, value, _, _) in enumerate(results):
            if status == "ok" and abs(value) > self.max_abs_reward:
                why = f"reward {value!r} is beyond max_abs_reward={self.max_abs_reward!r}"
                results[i] = ("out_of_range", 0.0, {}, why)
        rewards, errors, extras = [], dict.fromkeys(_ERROR_CAUSES, 0), defaultdict(list)
        self.last_errors = [r[3] for r in results if r[0] != "ok"]
        self.last_extras = [r[2] for r in results]  # {} for a failed call
        for status, value, extra, _ in results:
            rewards.append(value)
            if status != "ok":
                errors[status] += 1
            for k, v in extra.items():
                extras[k].append(v)
        metrics = {"reward/errors": float(sum(errors.values()))}
        metrics |= {f"reward/errors_{k}": float(v) for k, v in errors.items()}
        printed = [r[3] for r in results if r[0] == "ok" and r[3]]
        metrics["reward/printed"] = float(len(printed) + errors["print"])
        metrics |= {f"reward/{k}": sum(v) / len(v) for k, v in extras.items()}
        # shown, but on stderr (stdout carries the console metrics), once a batch and capped
        for what, texts in (("stdout", printed), ("stderr", self.last_stderr)):
            if texts:
                print(
                    f"[reward function {what}, 1 of {len(texts)} calls that wrote to it]\n{texts[0]}",
                    file=sys.stderr,
                )
        failed = len(self.last_errors)
        if failed > self.max_error_frac * len(items):
            first = " ".join(self.last_errors[0].split())  # one line
            raise RuntimeError(
                f"{failed} of {len(items)} reward calls failed (more than "
                f"custom_reward_function.max_error_frac={self.max_error_frac}); first: {first}"
            )
        if failed:
            _log.warning("%d of %d reward calls failed; first: %s", failed, len(items), self.last_errors[0])
        return rewards, metrics

    def _score_in_process(self, item: dict) -> tuple:
        """_score_one in this process, stopped by SIGALRM after timeout_s (signals need the main thread)."""
        if math.isinf(self.timeout_s):
            return _score_one(self._scorer, item, self.print_is_error)
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                f"reward pool: num_workers 0 enforces timeout_s={self.timeout_s} with SIGALRM, which needs the "
                "main thread; score() was called from another: use num_workers >= 1, or timeout_s inf"
            )

        def alarm(signum: int, frame: Any) -> None:
            raise _CallTimeout

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            try:
                return _score_one(self._scorer, item, self.print_is_error)
            finally:  # an alarm landing here, as the call ends, is still caught below
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _CallTimeout:
            return "timeout", 0.0, {}, f"reward call timed out (timeout_s={self.timeout_s})"
        finally:
            signal.signal(signal.SIGALRM, previous)

    def _run(self, items: list[dict], results: list[tuple]) -> None:
        """Feed items to workers one at a time, replacing any that hangs, dies or fails to start."""
        self._workers += [
            _Worker(self.fn_spec, self.print_is_error) for _ in range(self.num_workers - len(self._workers))
        ]
        pending = deque(range(len(items)))
        while self._workers and (pending or any(w.task is not None for w in self._workers)):
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    w.task = pending.popleft()
                    with contextlib.suppress(OSError):  # a dead worker shows up as EOF below
                        w.conn.send((w.task, items[w.task]))
                    w.deadline = time.monotonic() + self.timeout_s
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            answered = wait(
                [w.conn for w in waiting], max(0.0, min(w.deadline for w in waiting) - time.monotonic())
            )
            for w in waiting:
                msg = ("timed out",)
                if w.conn in answered:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        msg = ("died",)
                    if msg[0] == "ready":
                        w.ready, w.deadline = True, math.inf
                        continue
                    if msg[0] == "result":
                        results[msg[1]], w.task, w.deadline = msg[2], None, math.inf
                        self._keep_stderr(w)
                        continue
                elif time.monotonic() < w.deadline:
                    continue
                self._replace(w, msg[-1], results)
        for i in pending:  # only if every worker failed to start: score() still returns
            results[i] = ("exception", 0.0, {}, "no reward worker could start")

    def _keep_stderr(self, w: _Worker) -> None:
        if text := w.take_stderr():
            self.last_stderr.append(text)

    def _replace(self, w: _Worker, why: str, results: list[tuple]) -> None:
        """Kill a worker that timed out, died or failed to start ("init_error" text); restart it if it had
        started, else drop its slot (score() refills the pool next call), so a broken file cannot spin."""
        if w.task is not None:
            self._keep_stderr(w)
        w.kill()
        why = f"died (exit code {w.proc.returncode})" if why == "died" else why
        if w.task is not None:
            cause = "timeout" if why == "timed out" else "exception"
            results[w.task] = (cause, 0.0, {}, f"reward worker {why} (timeout_s={self.timeout_s})")
        i = self._workers.index(w)
        if w.ready:
            self._workers[i] = _Worker(self.fn_spec, self.print_is_error)
        else:
            self._workers.pop(i)
            _log.warning("a reward worker failed to start: %s", why)

    def close(self) -> None:
        """Kill the workers and every process their functions started (each worker's process group)."""
        for w in self._workers:
            w.kill()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
