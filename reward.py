"""Rule-based rewards for grpo.py/ppo.py: pure scorers, dispatch by data_source, custom functions, the pool.

Scorers (each `(solution, ground_truth, ...) -> float`, verl's `verl/utils/reward_score/` semantics):
    gsm8k_score      `#### N` answer (strict) or the last number (flexible) against the gold number.
    math_score       the last `\\boxed{...}` against the gold answer after MATH-style normalisation.
    countdown_score  TinyZero's task: the equation in the last `<answer>...</answer>` uses each given number
                     once and equals the target. Parsed by a small arithmetic parser, never `eval`.
    format_reward    DeepSeek-R1's format: the whole text is `<think>...</think> <answer>...</answer>`.
`default_compute_score(data_source, solution_str, ground_truth, extra_info)` picks one by data_source as
verl does. `load_reward_fn(path, name)` loads a user function from a .py file; `adapt_reward_fn` calls it
with either signature (rule in its docstring). `RewardPool` runs the function in worker processes with a
per-call timeout; a failing call scores 0.0 and is counted in `reward/errors*` instead of stopping training,
but a batch where most calls fail (`max_error_frac`) stops it with the first error, and `check_data_sources`
refuses, at start-up, a data_source that the default dispatch cannot score.

Deviations from verl / TinyZero:
1. gsm8k: answers are compared as numbers when both sides parse ("5.0" == "5", "1,000.00" == "1000"), after
   dropping `,` `$` and a trailing `.`; verl compares strings. Strict also takes `####` followed by any
   spaces/tabs and an optional `$` (verl: exactly one space). Tokens without a digit ("," or ".") are never
   an answer. verl's newer versions look only at the last 300 characters (a speed-up); flatrl reads the whole
   text (both regexes are linear), so an answer followed by a long tail still counts.
2. math: a hand-written subset of verl's `strip_string` normalisation (no unit word list, no sympy); plain
   numbers and integer fractions (`0.5`, `1/2`, `\\frac{1}{2}`) compare numerically.
3. countdown: the whole response is searched (TinyZero looks only at the last line after "Assistant:"); an
   equation may end in `= N`, which must then be the target; an unparseable answer scores 0, not format_score;
   division is exact (Fraction), so 1e-5 float slack is not needed.
4. The pool launches workers with `subprocess` (a fresh interpreter, like multiprocessing's "spawn"), not
   multiprocessing: spawn and forkserver re-import the trainer's `__main__` (grpo.py, hence torch and vLLM)
   in every worker. A worker imports only this file, the user's file, and whatever unpickling items needs.
   Each worker leads its own process group; the group is killed on a timeout, at close(), and (by the worker
   itself) when the trainer dies, so processes a reward function starts do not outlive the run.
5. A reward function may print, as verl's own scorers do (countdown prints a sample now and then): the call
   scores normally and is counted in `reward/printed`. Its text never reaches the trainer's stdout, where the
   console metrics go: it is captured, and the first printing call's text of each batch goes to stderr.
   `print_is_error=True` makes such a call score 0.0 instead (`reward/errors_print`). A worker's stderr is
   captured too (at the fd level) and shown the same way; each text in the log is cut at 4 KB, saying how much
   was cut. With num_workers 0 (in process) stderr is not captured.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import logging
import math
import operator
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from fractions import Fraction
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)

# ---------------------------------------------------------------- GSM8K


_GSM8K_STRICT = re.compile(r"####[ \t]*\$?[ \t]*(-?[0-9.,]+)")  # verl: "#### (\-?[0-9\.\,]+)"
_NUMBER_TOKEN = re.compile(r"-?[0-9.,]+")
_DECIMAL = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)")


def _as_number(s: str) -> Fraction | None:
    """A plain decimal as an exact Fraction; None if it is not one (or absurdly long)."""
    return Fraction(s) if len(s) <= 64 and _DECIMAL.fullmatch(s) else None


def _norm_gsm8k(s: str) -> str:
    return s.replace(",", "").replace("$", "").strip().rstrip(".")


def gsm8k_score(
    solution: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """Score a GSM8K-style solution (verl's gsm8k.compute_score; deviation 1 in the module docstring).

    Args:
        solution: the model's response text.
        ground_truth: the gold number, e.g. "72" or "1,000" (an int is accepted too).
        method: "strict" takes the last `#### N`; "flexible" the last number anywhere in the text.
        format_score: returned when an answer was extracted but is wrong.
        score: returned when the answer equals the gold number.
    Returns:
        score, format_score, or 0.0 when no answer could be extracted.
    """
    if method == "strict":
        found = _GSM8K_STRICT.findall(solution)
    elif method == "flexible":
        found = _NUMBER_TOKEN.findall(solution)
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    found = [t for t in found if any(c.isdigit() for c in t)]
    if not found:
        return 0.0
    pred, gold = _norm_gsm8k(found[-1]), _norm_gsm8k(str(ground_truth))
    pred_n, gold_n = _as_number(pred), _as_number(gold)
    right = pred == gold or (pred_n is not None and pred_n == gold_n)
    return float(score) if right else float(format_score)


# ---------------------------------------------------------------- MATH


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces) or `\\boxed N`; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    if text.startswith(" ", i) and not text[i:].lstrip(" ").startswith("{"):  # `\boxed 5` (verl accepts it)
        ans = re.split(r"[\s$]", text[i:].lstrip(" "), maxsplit=1)[0]
        return ans or None
    i = len(text) - len(text[i:].lstrip(" "))
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: the answer was cut off


_MATH_DROP = r"\! \, \; \: \left \right \displaystyle ^{\circ} ^\circ \$ $ \% %".split() + [
    "\\ "
]  # spacing etc.


def _norm_math(s: str) -> str:
    """MATH answer normalisation, after the Hendrycks `strip_string` that verl's math.py uses."""
    s = s.strip().replace("\n", "").replace("dfrac", "frac").replace("tfrac", "frac")
    for t in _MATH_DROP:
        s = s.replace(t, "")
    unitless = re.sub(r"\\(?:text|mbox)\{[^{}]*\}$", "", s).strip()  # "10\text{ cm}" -> "10"
    s = unitless or s
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators; "(1,2)" stays a tuple
        s = s.replace(",", "")
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:  # "x=5" -> "5"
        s = s.split("=")[1]
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    return re.sub(r"^(-?)\.", r"\g<1>0.", s)


def _math_number(s: str) -> Fraction | None:
    """0.5, -3, 1/2, \\frac{1}{2}, -\\frac{1}{2} as exact numbers; None for anything else."""
    m = re.fullmatch(r"(-?)(?:\\frac\{(-?\d+)\}\{(-?\d+)\}|(\d+)/(\d+))", s) if len(s) <= 64 else None
    if m:
        num, den = int(m[2] or m[4]), int(m[3] or m[5])
        return None if den == 0 else Fraction(num, den) * (-1 if m[1] else 1)
    return _as_number(s)


def math_score(solution: str, ground_truth: str) -> float:
    """1.0 iff the last `\\boxed{}` answer in `solution` equals `ground_truth` after normalisation.

    Args:
        solution: the model's response text.
        ground_truth: the gold answer (its own `\\boxed{}` is unwrapped if present).
    Returns:
        1.0 or 0.0.
    """
    pred = _last_boxed(solution)
    if pred is None:
        return 0.0
    gold = str(ground_truth)
    gold = (_last_boxed(gold) or gold) if "\\boxed" in gold else gold
    p, g = _norm_math(pred), _norm_math(gold)
    pn, gn = _math_number(p), _math_number(g)
    return 1.0 if p == g or (pn is not None and pn == gn) else 0.0


# ---------------------------------------------------------------- Countdown

_ARITH_TOKEN = re.compile(r"\s*(?:([0-9]{1,9})|([-+*/()]))")  # ASCII digits only: int() takes "٣" too
_ARITH_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_MAX_EQUATION_CHARS, _MAX_DEPTH = 200, 24  # a 6-number countdown equation is < 60 characters


def _eval_arith(text: str) -> tuple[Fraction | None, list[int]]:
    """Evaluate integers with + - * / ( ) and unary minus exactly; return (value, integer literals).

    value is None on division by zero. Raises ValueError on anything else (names, `**`, floats, too long,
    too deep): this is the only place a model's text is evaluated, and it never reaches `eval`.
    """
    if len(text) > _MAX_EQUATION_CHARS:
        raise ValueError("equation too long")
    tokens, pos, text = [], 0, text.rstrip()
    while pos < len(text):
        m = _ARITH_TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"bad character at {pos}")
        tokens.append(int(m[1]) if m[1] else m[2])
        pos = m.end()
    literals = [t for t in tokens if isinstance(t, int)]
    i = 0

    def peek() -> int | str | None:
        return tokens[i] if i < len(tokens) else None

    def binary(depth: int, ops: tuple[str, str], operand: Callable[[int], Fraction]) -> Fraction:
        nonlocal i
        value = operand(depth)
        while peek() in ops:
            op = _ARITH_OPS[tokens[i]]
            i += 1
            value = op(value, operand(depth))  # ZeroDivisionError is caught by the caller
        return value

    def unary(depth: int) -> Fraction:
        nonlocal i
        if depth > _MAX_DEPTH:
            raise ValueError("equation nested too deeply")
        tok = peek()
        if tok == "-":
            i += 1
            return -unary(depth + 1)
        if tok == "(":
            i += 1
            value = binary(depth + 1, ("+", "-"), term)
            if peek() != ")":
                raise ValueError("unbalanced parentheses")
            i += 1
            return value
        if isinstance(tok, int):
            i += 1
            return Fraction(tok)
        raise ValueError(f"unexpected token {tok!r}")

    def term(depth: int) -> Fraction:
        return binary(depth, ("*", "/"), unary)

    try:
        value: Fraction | None = binary(0, ("+", "-"), term)
    except ZeroDivisionError:
        value = None
    if i != len(tokens):
        raise ValueError(f"trailing token {tokens[i]!r}")
    return value, literals


def countdown_score(
    solution: str, ground_truth: dict, format_score: float = 0.1, score: float = 1.0
) -> float:
    """Score TinyZero's countdown task (deviation 3 in the module docstring).

    Args:
        solution: the model's response; the equation is the last `<answer>...</answer>`, optionally `= N`.
        ground_truth: {"target": int, "numbers": [int, ...]} (parquet may give numpy values; they are cast).
        format_score: a well-formed equation that is wrong, divides by zero or uses the wrong numbers.
        score: a correct equation using each number exactly once.
    Returns:
        score, format_score, or 0.0 when there is no answer or it does not parse.
    """
    # rfind, not a regex: `<answer>(.*?)</answer>` is quadratic on many unclosed `<answer>` tags.
    end = solution.rfind("</answer>")
    start = solution.rfind("<answer>", 0, max(end, 0))
    if end < 0 or start < 0:
        return 0.0
    target, numbers = int(ground_truth["target"]), sorted(int(n) for n in ground_truth["numbers"])
    lhs, eq, rhs = solution[start + len("<answer>") : end].strip().partition("=")
    try:
        value, literals = _eval_arith(lhs)
        if eq and not re.fullmatch(r"-?[0-9]{1,9}", rhs.strip()):
            raise ValueError("the right-hand side is not an integer")
        claimed = int(rhs) if eq else target
    except ValueError:
        return 0.0
    right = sorted(literals) == numbers and value == target and claimed == target
    return float(score) if right else float(format_score)


_TAG_FREE = r"(?:(?!</?(?:think|answer)>).)*"  # no nested or repeated tags inside a section
_R1_FORMAT = re.compile(rf"\s*<think>{_TAG_FREE}</think>\s*<answer>{_TAG_FREE}</answer>\s*", re.DOTALL)


def format_reward(solution: str) -> float:
    """1.0 iff the whole text is `<think>...</think>` then `<answer>...</answer>` (whitespace around allowed)."""
    return 1.0 if _R1_FORMAT.fullmatch(solution) else 0.0


# ---------------------------------------------------------------- dispatch

FnSpec = tuple[str, str | None] | None  # (path, name) for load_reward_fn, or None for default_compute_score
GSM8K_SOURCES = ("openai/gsm8k", "flatrl/toy")  # toy.py's solutions end in `#### N`
MATH_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "HuggingFaceH4/MATH",
    "EleutherAI/hendrycks_math",
)


_REGISTERED = ", ".join(GSM8K_SOURCES + MATH_SOURCES + ("countdown*",))


def _scorer_for(data_source: Any) -> Callable[[str, Any], float] | None:
    """The scorer default_compute_score uses for data_source (countdown: any name starting so); None if none."""
    if data_source in GSM8K_SOURCES:
        return gsm8k_score
    if data_source in MATH_SOURCES:
        return math_score
    if isinstance(data_source, str) and data_source.startswith("countdown"):
        return countdown_score
    return None


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """verl's `default_compute_score`: pick the scorer by data_source (`_scorer_for`).

    Raises:
        ValueError: for an unknown data_source, naming it and the known ones.
    """
    scorer = _scorer_for(data_source)
    if scorer is None:
        raise ValueError(f"no reward function for data_source {data_source!r}; known: {_REGISTERED}")
    return scorer(solution_str, ground_truth)


def check_data_sources(sources: Iterable[Any], fn_spec: FnSpec) -> None:
    """Fail at start-up, not as all-zero rewards, when default_compute_score has no scorer for a data_source.

    Args:
        sources: the data_source of every row (repeats are fine).
        fn_spec: the pool's spec; a custom function (not None) may score any source, so nothing is checked.
    Raises:
        ValueError naming the unknown sources and the registered ones.
    """
    unknown = sorted({repr(s) for s in sources if _scorer_for(s) is None})
    if fn_spec is None and unknown:
        raise ValueError(
            f"no reward function for data_source {', '.join(unknown[:5])}"
            f"{f' (and {len(unknown) - 5} more)' if len(unknown) > 5 else ''}; registered: {_REGISTERED}; "
            "for another source set custom_reward_function.path"
        )


# ---------------------------------------------------------------- custom functions


def load_reward_fn(path: str | None, name: str | None) -> Callable:
    """The function `name` (default "compute_score", as in verl) from the .py file at `path`.

    Args:
        path: a .py file, imported from exactly this path (never from sys.path); None for the default dispatch.
        name: the function's name in that file; must be None when path is None.
    Returns:
        the function (`default_compute_score` when both are None).
    Raises:
        FileNotFoundError / AttributeError / TypeError naming the path and name.
    """
    if path is None:
        if name is not None:
            raise ValueError(f"reward function name {name!r} given without a path")
        return default_compute_score
    name = name or "compute_score"
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"reward function file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"flatrl_custom_reward_{abs(hash(str(file)))}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"reward function file {path} has no function {name!r} (custom_reward_function.name; without it "
            f"flatrl looks for compute_score, as verl does); callables in the file: {', '.join(defined) or 'none'}"
        )
    if not callable(fn):
        raise TypeError(f"{name!r} in {path} is not callable")
    return fn


_VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def adapt_reward_fn(fn: Callable) -> Callable[[dict], Any]:
    """Wrap `fn` as `scorer(item) -> float | dict`, item having the keys RewardPool.score documents.

    The rule, from `inspect.signature(fn)`:
    1. parameters named `prompt` and `response` (and no `solution_str`): plain, `fn(prompt=, response=)`;
    2. a parameter named `solution_str` or `data_source`: verl, keywords data_source, solution_str (the
       response), ground_truth, extra_info, each passed if fn names it (all four if it takes **kwargs);
    3. otherwise by the count of named positional parameters: 2 -> plain `fn(prompt, response)`; 3 or more
       -> verl, positionally, `fn(data_source, solution_str, ground_truth, extra_info)` cut to that count.
    Raises:
        TypeError if none applies.
    """
    params = inspect.signature(fn).parameters
    kinds = [p.kind for p in params.values()]
    if {"prompt", "response"} <= params.keys() and "solution_str" not in params:
        return lambda it: fn(prompt=it["prompt"], response=it["response"])
    if "solution_str" in params or "data_source" in params:
        every = inspect.Parameter.VAR_KEYWORD in kinds
        names = [a for a in _VERL_ARGS if every or a in params]
        return lambda it: fn(**{a: it["response" if a == "solution_str" else a] for a in names})
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    n = sum(k in positional for k in kinds)
    if n == 2:
        return lambda it: fn(it["prompt"], it["response"])
    if n >= 3:
        n = min(n, 4)
        return lambda it: fn(*[it["response" if a == "solution_str" else a] for a in _VERL_ARGS[:n]])
    raise TypeError(f"reward function {fn!r} takes neither (prompt, response) nor verl's {_VERL_ARGS}")


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
        scorer = adapt_reward_fn(load_reward_fn(*(fn_spec or (None, None))))
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
        code = (
            f"import sys; sys.path.insert(0, {here!r}); import reward; reward._worker_main({child.fileno()})"
        )
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
        fn_spec: (path, name) of a custom function (see load_reward_fn), or None for default_compute_score.
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
            self._scorer = adapt_reward_fn(load_reward_fn(*(fn_spec or (None, None))))
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
            (rewards, metrics): one float per item, in order; metrics `reward/errors` (count of failed calls),
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
