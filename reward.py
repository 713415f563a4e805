"""Rule-based rewards for grpo.py/ppo.py: pure scorers, dispatch by data_source, custom functions (the worker
processes that run them are reward_pool.py's).

Scorers (each `(solution, ground_truth, ...) -> float`, verl's `verl/utils/reward_score/` semantics):
    gsm8k_score      `#### N` answer (strict) or the last number (flexible) against the gold number.
    math_score       the last `\\boxed{...}` against the gold answer after MATH-style normalisation.
    countdown_score  TinyZero's task: the equation in the last `<answer>...</answer>` uses each given number
                     once and equals the target. Parsed by a small arithmetic parser, never `eval`.
    format_reward    DeepSeek-R1's format: the whole text is `<think>...</think> <answer>...</answer>`.
`default_compute_score(data_source, solution_str, ground_truth, extra_info)` picks one by data_source as
verl does. `load_reward_fn(path, name)` loads a user function from a .py file; `adapt_reward_fn` calls it
with either signature (rule in its docstring); `check_data_sources` refuses, at start-up, a data_source that the
default dispatch cannot score. reward_pool.RewardPool runs the function in worker processes.

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
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
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

# (path, name) for load_reward_fn, and optionally the function's extra keyword arguments (custom_reward_function.
# reward_kwargs); None for default_compute_score
FnSpec = tuple[str, str | None] | tuple[str, str | None, Mapping[str, Any]] | None
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


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (verl's dapo reward manager): 0 for a response of up to max_len -
    buffer_len tokens, then -factor x (the tokens past that) / buffer_len: -factor at max_len, and further down
    past it (a max_len below the response cap)."""
    return min(-(length - (max_len - buffer_len)) / buffer_len * factor, 0.0)


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


def load_scorer(fn_spec: FnSpec) -> Callable[[dict], Any]:
    """The scorer of a pool's spec: the function (load_reward_fn) with its keyword arguments, adapted."""
    path, name, kwargs = (*fn_spec, {})[:3] if fn_spec else (None, None, {})
    return adapt_reward_fn(load_reward_fn(path, name), kwargs)


def adapt_reward_fn(fn: Callable, kwargs: Mapping[str, Any] | None = None) -> Callable[[dict], Any]:
    """Wrap `fn` as `scorer(item) -> float | dict`, item having the keys RewardPool.score documents; `kwargs`
    (verl's custom_reward_function.reward_kwargs) go to every call, each by name, as verl binds them.

    The rule, from `inspect.signature(fn)`:
    1. parameters named `prompt` and `response` (and no `solution_str`): plain, `fn(prompt=, response=)`;
    2. a parameter named `solution_str` or `data_source`: verl, keywords data_source, solution_str (the
       response), ground_truth, extra_info, each passed if fn names it (all four if it takes **kwargs);
    3. otherwise by the count of named positional parameters: 2 -> plain `fn(prompt, response)`; 3 or more
       -> verl, positionally, `fn(data_source, solution_str, ground_truth, extra_info)` cut to that count.
    Raises:
        TypeError if none applies, or a keyword argument is not the function's (or names one of the row's).
    """
    if kwargs:
        params = inspect.signature(fn).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        row = set(_VERL_ARGS) | {"prompt", "response"}
        for k in kwargs:
            if k in row or not (k in params or takes_any):
                why = (
                    "names an argument of the row"
                    if k in row
                    else "is not a parameter of it, and it takes no **kwargs"
                )
                raise TypeError(
                    f"custom_reward_function.reward_kwargs.{k}: {why} ({getattr(fn, '__name__', fn)}"
                    f"{inspect.signature(fn)})"
                )
        fn = functools.partial(fn, **kwargs)
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
