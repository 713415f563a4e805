"""Tests for reward.py (scorers on the real GSM8K files and hand cases, dispatch, custom functions) and
reward_pool.py (the worker pool)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import subprocess
import sys
import textwrap
import time
from fractions import Fraction
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
import reward  # noqa: E402
from reward import (  # noqa: E402
    adapt_reward_fn,
    countdown_score,
    default_compute_score,
    format_reward,
    gsm8k_score,
    load_reward_fn,
    math_score,
)
from reward_pool import RewardPool  # noqa: E402

GSM8K_DIR = Path(__file__).parents[1] / "../shared/data/gsm8k"


def _gsm8k_rows() -> list[dict]:
    files = [GSM8K_DIR / "train.jsonl", GSM8K_DIR / "test.jsonl"]
    if not all(f.is_file() for f in files):
        pytest.skip(f"GSM8K files not found under {GSM8K_DIR.resolve()} (the shared/ folder beside the repo)")
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]


def _gold(answer: str) -> str:
    # verl's examples/data_preprocess/gsm8k.py: the text after "#### ", commas removed
    return answer.split("#### ")[-1].replace(",", "").strip()


# ---------------------------------------------------------------- GSM8K


def test_gsm8k_every_gold_solution_scores_one():
    rows = _gsm8k_rows()
    assert len(rows) == 7473 + 1319
    for method in ("strict", "flexible"):
        scores = [gsm8k_score(r["answer"], _gold(r["answer"]), method=method) for r in rows]
        bad = [r["answer"][-60:] for r, s in zip(rows, scores, strict=True) if s != 1.0]
        assert not bad, f"{method}: {len(bad)} gold solutions scored < 1, e.g. {bad[:3]}"
    # ground truth with its thousands separators kept ("1,450,000") must match too
    with_commas = [r for r in rows if "," in r["answer"].split("#### ")[-1]]
    assert len(with_commas) == 93
    assert all(gsm8k_score(r["answer"], r["answer"].split("#### ")[-1]) == 1.0 for r in with_commas)


def test_gsm8k_gold_solution_with_another_answer_scores_format_score():
    rows = _gsm8k_rows()
    golds = [_gold(r["answer"]) for r in rows]
    pairs = [(i, (i + 1) % len(rows)) for i in range(len(rows))]
    pairs = [(i, j) for i, j in pairs if Fraction(golds[i]) != Fraction(golds[j])]
    assert len(pairs) > 8000
    for i, j in pairs:
        assert gsm8k_score(rows[i]["answer"], golds[j], format_score=0.25) == 0.25
        assert gsm8k_score(rows[i]["answer"], golds[j], method="flexible") == 0.0


@pytest.mark.parametrize(
    "solution, gold, method, expected",
    [
        ("so she pays #### $1,000", "1000", "strict", 1.0),
        ("so she pays #### 1,000", "$1,000", "strict", 1.0),
        ("In total she pays $1,000.", "1000", "flexible", 1.0),
        ("#### 1,000.00", "1000", "strict", 1.0),  # numeric comparison
        ("#### 5.0", "5", "strict", 1.0),
        ("#### 72.", "72", "strict", 1.0),  # trailing full stop
        ("#### 5.5", "5", "strict", 0.5),
        ("#### -3", "-3", "strict", 1.0),
        ("the change is -3 dollars", "-3", "flexible", 1.0),
        ("#### 3", "-3", "strict", 0.5),
        ("#### -3", "3", "strict", 0.5),
        ("#### 4\nwait, no.\n#### 5", "5", "strict", 1.0),  # the last #### wins
        ("#### 4\nwait, no.\n#### 5", "4", "strict", 0.5),
        ("The answer is 5", "5", "strict", 0.0),  # no #### -> nothing extracted, not format_score
        ("The answer is 5", "5", "flexible", 1.0),
        ("Hello, world.", "5", "flexible", 0.0),  # "," and "." are not answers
        ("#### ,", "5", "strict", 0.0),
        ("####7", "7", "strict", 1.0),
        ("#### 7" + " and so on" * 100, "7", "strict", 1.0),  # no 300-char clip (module docstring, 1.)
        ("#### 7", 7, "strict", 1.0),  # an int ground truth
    ],
)
def test_gsm8k_hand_cases(solution, gold, method, expected):
    assert gsm8k_score(solution, gold, method=method, format_score=0.5) == expected


def test_gsm8k_scores_and_bad_method():
    assert gsm8k_score("#### 6", "7") == 0.0
    assert gsm8k_score("#### 7", "7", score=2.0) == 2.0
    with pytest.raises(ValueError, match="loose"):
        gsm8k_score("#### 7", "7", method="loose")


# ---------------------------------------------------------------- MATH


@pytest.mark.parametrize(
    "solution, gold, expected",
    [
        (r"so the answer is $\boxed{\frac{\sqrt{3}}{2}}$.", r"\frac{\sqrt{3}}{2}", 1.0),  # nested braces
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{2}}{2}", 0.0),
        (r"first \boxed{1}, then \boxed{2}", "2", 1.0),  # the last box counts
        (r"first \boxed{1}, then \boxed{2}", "1", 0.0),
        (r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),  # unbalanced: cut off
        ("the answer is 5", "5", 0.0),  # no box
        (r"\boxed{\left( 3, 4 \right)}", "(3,4)", 1.0),
        (r"\boxed{(1,2)}", "12", 0.0),  # tuple commas are not thousands separators
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{10\text{ cm}}", "10", 1.0),
        (r"\boxed{\text{(B)}}", "(B)", 1.0),
        (r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{1/2}", "0.5", 1.0),
        (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
        (r"\boxed{0.49}", r"\frac{1}{2}", 0.0),
        (r"\boxed{5.}", "5", 1.0),
        (r"\boxed{x = 3}", "3", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{\!12\,345}", "12345", 1.0),
        (r"\boxed 5$", "5", 1.0),
        (r"\boxed{\sqrt2}", r"\sqrt{2}", 1.0),
        (r"\boxed{7}", r"The answer is \boxed{7}.", 1.0),  # a boxed ground truth is unwrapped
    ],
)
def test_math_score(solution, gold, expected):
    assert math_score(solution, gold) == expected


# ---------------------------------------------------------------- Countdown

GT = {"target": 60, "numbers": [3, 5, 25]}


@pytest.mark.parametrize(
    "solution, gt, expected",
    [
        ("<think>25-5=20, 20*3=60</think> <answer>(25 - 5) * 3</answer>", GT, 1.0),
        ("<answer>(25-5)*3 = 60</answer>", GT, 1.0),
        ("<answer>(25-5)*3 = 61</answer>", GT, 0.1),  # claims the wrong target
        ("<answer>(25+5)*3</answer>", GT, 0.1),  # 90
        ("<answer>(25-5)*3*1</answer>", GT, 0.1),  # uses a number not given
        ("<answer>(25-5)*(5-2)</answer>", GT, 0.1),  # 5 twice, 3 not at all
        ("<answer>60</answer>", GT, 0.1),
        ("<answer>1+1</answer> ... <answer>(25-5)*3</answer>", GT, 1.0),  # the last answer counts
        ("<answer>(25-5)*3</answer> ... <answer>1+1</answer>", GT, 0.1),
        ("<answer>8/(3-8/3)</answer>", {"target": 24, "numbers": [8, 3, 8, 3]}, 1.0),  # exact division
        ("<answer>2/(5-5)</answer>", {"target": 2, "numbers": [5, 5, 2]}, 0.1),  # division by zero
        ("<answer>-3+5</answer>", {"target": 2, "numbers": [3, 5]}, 1.0),  # unary minus
        ("<answer>\n(25 - 5)\n* 3\n</answer>", GT, 1.0),
        ("no answer tag: (25-5)*3", GT, 0.0),
        ("<answer></answer>", GT, 0.0),
        ("<answer>twenty times three</answer>", GT, 0.0),
        ("<answer>(25-5)*3.0</answer>", GT, 0.0),  # integers only
        ("<answer>((25-5)*3</answer>", GT, 0.0),
        ("<answer>(25-5)*3 = sixty</answer>", GT, 0.0),
        ("<answer>(25-5)*3 = 60 = 60</answer>", GT, 0.0),
        ("<answer>(٢٥-5)*3</answer>", GT, 0.0),  # Arabic-Indic digits: int() would take them
        ("<answer>(25-5)*3 = ٦٠</answer>", GT, 0.0),
    ],
)
def test_countdown_score(solution, gt, expected):
    assert countdown_score(solution, gt) == expected


def test_countdown_numpy_ground_truth_and_scores():
    np = pytest.importorskip("numpy")  # parquet rows come back with numpy arrays
    gt = {"target": np.int64(60), "numbers": np.array([25, 3, 5])}
    assert countdown_score("<answer>(25-5)*3</answer>", gt, format_score=0.2, score=3.0) == 3.0
    assert countdown_score("<answer>25+5+3</answer>", gt, format_score=0.2, score=3.0) == 0.2


def test_countdown_hostile_strings(tmp_path):
    marker = tmp_path / "pwned"
    hostile = [
        f"__import__('os').system('touch {marker}')",
        f"__import__('subprocess').run(['touch', '{marker}'])",
        "9**9**9",
        "(" * 10_000 + "1" + ")" * 10_000,
        "((((((((((((((((((((((((((((1))))))))))))))))))))))))))))",  # 28 deep, under 200 characters
        f"(lambda: __import__('os').system('touch {marker}'))()",
        "(1)**999999999",
        "9**9**9**9",
        "(" * 100_000 + "1" + ")" * 100_000,
        "(" * 40 + "3" + ")" * 40,  # short enough, too deep
        "-" * 60 + "3",
        "1+" * 150 + "1",
        "9" * 5000,
        "3 if 1 else 5",
        "0x3c",
        "3e1*2",
        "[25,5,3]",
    ]
    start = time.perf_counter()
    for h in hostile:
        assert countdown_score(f"<answer>{h}</answer>", GT) == 0.0, h
        assert countdown_score(f"<answer>{h[:100]}</answer>" * 1000, GT) == 0.0
    # unclosed tags: a `<answer>(.*?)</answer>` regex would take minutes here (quadratic)
    assert countdown_score("<answer>" * 100_000, GT) == 0.0
    assert countdown_score("<answer>1+" * 100_000 + "</answer>", GT) == 0.0
    assert format_reward("<think>" + "a" * 1_000_000) == 0.0
    assert time.perf_counter() - start < 2.0
    assert not marker.exists()
    for h in hostile:
        with pytest.raises(ValueError):
            reward._eval_arith(h)


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>a</think><answer>b</answer>", 1.0),
        ("  \n<think>\nstep 1\nstep 2\n</think>\n\n<answer>\n42\n</answer>\n", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<answer>b</answer>", 0.0),
        ("<think>a</think>", 0.0),
        ("hi <think>a</think><answer>b</answer>", 0.0),
        ("<think>a</think><answer>b</answer> bye", 0.0),
        ("<think>a</think> x <answer>b</answer>", 0.0),
        ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),
        ("<think>a<think>b</think><answer>c</answer>", 0.0),
        ("<answer>b</answer><think>a</think>", 0.0),
    ],
)
def test_format_reward(text, expected):
    assert format_reward(text) == expected


# ---------------------------------------------------------------- dispatch


def test_default_compute_score_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 12", "12") == 1.0
    assert default_compute_score("openai/gsm8k", "12", "12") == 0.0  # strict
    assert default_compute_score("flatrl/toy", "7+8=15, carry 1\n4+3+1=8\n#### 85", "85") == 1.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert default_compute_score(source, r"\boxed{\dfrac{1}{2}}", "0.5") == 1.0
    for source in ("countdown", "countdown-3to4"):
        assert default_compute_score(source, "<answer>25+5+3</answer>", GT) == 0.1
    with pytest.raises(ValueError, match=r"'my/dataset'.*openai/gsm8k"):
        default_compute_score("my/dataset", "#### 1", "1")


# ---------------------------------------------------------------- custom functions

REWARDS_PY = """
import os
import subprocess
import sys
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str), "pred": solution_str}


def plain(prompt, response):
    return float(len(response) > len(prompt))


def positional(a, b, c):
    return 1.0 if b == c else 0.0


def keywords(solution_str, ground_truth, **kwargs):
    return float(kwargs["data_source"] == "x" and kwargs["extra_info"] == {"i": 1})


def no_torch(prompt, response):
    return float("torch" not in sys.modules and "vllm" not in sys.modules)


def mixed(prompt, response):
    kind, _, value = response.partition(":")
    if kind == "raise":
        raise RuntimeError("boom")
    if kind == "slow":
        time.sleep(30)
    if kind == "nap":  # slow, but within the timeout
        time.sleep(0.5)
        return 7.0
    if kind == "exit":
        sys.exit(3)
    if kind == "crash":
        os._exit(1)
    if kind == "print":
        print("hello from a reward function")
    bad = {"str": "1.0", "none": None, "nan": float("nan"), "inf": float("inf"), "list": [1.0], "ninf": -float("inf")}
    return bad.get(kind, float(value or 0))


def with_dict(prompt, response):
    return {"score": 0.5, "acc": float(response == "a"), "tag": "ignored"}


def bad_dict(prompt, response):
    return {"acc": 1.0}


def spawn(prompt, response):  # starts a child that would outlive its worker; its pid goes to the file `prompt`
    child = subprocess.Popen(["sleep", "300"])
    with open(prompt, "w") as f:
        f.write(str(child.pid))
    if response == "hang":
        time.sleep(30)
    return 1.0


def loud(prompt, response):  # 1 MB of stderr (Python and fd level) and of exception text
    sys.stderr.write("e" * 1_000_000)
    os.write(2, b"f" * 100_000)
    if response == "raise":
        raise ValueError("x" * 1_000_000)
    return 1.0

not_a_function = 3
"""


@pytest.fixture
def rewards_py(tmp_path: Path) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS_PY))
    return str(path)


def _item(
    response: str, prompt: str = "q", ground_truth="1", data_source: str = "x", extra_info=None
) -> dict:
    return {
        "data_source": data_source,
        "prompt": prompt,
        "response": response,
        "ground_truth": ground_truth,
        "extra_info": extra_info if extra_info is not None else {"i": 1},
    }


def test_load_and_adapt_both_signatures(rewards_py):
    verl = adapt_reward_fn(load_reward_fn(rewards_py, None))  # default name: compute_score
    assert verl(_item(" 1 ")) == {"score": 1.0, "length": 3, "pred": " 1 "}
    assert verl(_item("2"))["score"] == 0.0
    plain = adapt_reward_fn(load_reward_fn(rewards_py, "plain"))
    assert plain(_item("long answer", prompt="q")) == 1.0
    assert plain(_item("a", prompt="a long question")) == 0.0
    positional = adapt_reward_fn(load_reward_fn(rewards_py, "positional"))  # (data_source, response, gt)
    assert positional(_item("1", ground_truth="1")) == 1.0
    assert positional(_item("2", ground_truth="1")) == 0.0
    assert adapt_reward_fn(load_reward_fn(rewards_py, "keywords"))(_item("1")) == 1.0
    assert adapt_reward_fn(lambda q, r: float(r.startswith(q)))(_item("q!", prompt="q")) == 1.0
    default = adapt_reward_fn(load_reward_fn(None, None))
    assert default(_item("#### 3", data_source="openai/gsm8k", ground_truth="3")) == 1.0
    with pytest.raises(TypeError, match="neither"):
        adapt_reward_fn(lambda x: x)


def test_load_reward_fn_errors(rewards_py, tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_reward_fn(missing, "f")
    with pytest.raises(AttributeError, match=r"my_rewards\.py.*'absent'"):
        load_reward_fn(rewards_py, "absent")
    with pytest.raises(TypeError, match="not_a_function"):
        load_reward_fn(rewards_py, "not_a_function")
    with pytest.raises(ValueError, match="without a path"):
        load_reward_fn(None, "plain")


# ---------------------------------------------------------------- the pool

MIXED = [
    "ok:1",
    "raise",
    "ok:0.5",
    "slow",
    "str",
    "print:4",
    "nan",
    "none",
    "inf",
    "exit",
    "ok:2",
    "slow",
    "crash",
    "nap",
    "list",
    "ninf",
]
MIXED_REWARDS = [1.0, 0, 0.5, 0, 0, 4.0, 0, 0, 0, 0, 2.0, 0, 0, 7.0, 0, 0]


def test_pool_counts_every_kind_of_failure(rewards_py, capfd):
    start = time.perf_counter()
    with RewardPool((rewards_py, "mixed"), num_workers=2, timeout_s=1.0, max_error_frac=1.0) as pool:
        rewards, metrics = pool.score([_item(r) for r in MIXED])
        assert rewards == MIXED_REWARDS  # every other sample keeps its score; the nap within 1 s counts
        assert metrics == {
            "reward/errors": 11.0,
            "reward/errors_timeout": 2.0,
            "reward/errors_exception": 3.0,  # raise, sys.exit, a worker that died (os._exit)
            "reward/errors_bad_type": 6.0,  # str, nan, None, inf, [1.0], -inf
            "reward/errors_print": 0.0,  # printing is fine by default (verl's scorers print)
            "reward/errors_out_of_range": 0.0,
            "reward/printed": 1.0,
        }
        assert len(pool.last_errors) == 11 and any("boom" in m for m in pool.last_errors)
        # the killed workers were replaced: the pool still scores, with no errors left over
        rewards, metrics = pool.score([_item(f"ok:{i}") for i in range(6)])
        assert rewards == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and metrics["reward/errors"] == 0.0
    elapsed = time.perf_counter() - start
    assert elapsed < 9.0, elapsed  # two 30 s sleeps were cut at 1 s each
    out, err = capfd.readouterr()
    assert "hello from a reward function" not in out  # stdout carries the console metrics
    assert err.count("hello from a reward function") == 1  # shown once, on stderr


def test_pool_in_process_mode(rewards_py, capfd):
    items = [_item(r) for r in MIXED if r not in ("slow", "crash")]
    with RewardPool((rewards_py, "mixed"), num_workers=0, max_error_frac=1.0) as pool:
        rewards, metrics = pool.score(items)
    assert rewards == [r for r, k in zip(MIXED_REWARDS, MIXED, strict=True) if k not in ("slow", "crash")]
    assert metrics["reward/errors"] == 8.0 and metrics["reward/errors_timeout"] == 0.0
    assert metrics["reward/errors_exception"] == 2.0 and metrics["reward/errors_bad_type"] == 6.0
    assert metrics["reward/printed"] == 1.0 and metrics["reward/errors_print"] == 0.0
    assert "hello from a reward function" not in capfd.readouterr().out


def test_print_is_error_option(rewards_py, capfd):
    items = [_item("print:4"), _item("ok:1"), _item("print:2")]
    for workers in (0, 1):
        with RewardPool(
            (rewards_py, "mixed"), num_workers=workers, print_is_error=True, max_error_frac=1.0
        ) as pool:
            rewards, metrics = pool.score(items)
        assert rewards == [0.0, 1.0, 0.0], workers
        assert metrics["reward/errors_print"] == 2.0 and metrics["reward/printed"] == 2.0
        assert "hello from a reward function" in pool.last_errors[0]
    assert "hello from a reward function" not in capfd.readouterr().out


def test_pool_dict_extras_default_dispatch_and_options(rewards_py):
    with RewardPool((rewards_py, "with_dict"), num_workers=1) as pool:
        rewards, metrics = pool.score([_item("a"), _item("b"), _item("a"), _item("c")])
    assert rewards == [0.5] * 4 and metrics["reward/acc"] == 0.5 and "reward/tag" not in metrics
    with RewardPool((rewards_py, "bad_dict"), num_workers=0, max_error_frac=1.0) as pool:
        assert pool.score([_item("a")])[1]["reward/errors_bad_type"] == 1.0
    with RewardPool((rewards_py, "mixed"), num_workers=1) as pool:
        rewards, metrics = pool.score([_item("print:3")])
        assert rewards == [3.0] and metrics["reward/printed"] == 1.0 and metrics["reward/errors"] == 0.0
    items = [
        _item("#### 5", data_source="openai/gsm8k", ground_truth="5"),
        _item(r"\boxed{5}", data_source="HuggingFaceH4/MATH-500", ground_truth="5"),
        _item("<answer>(25-5)*3</answer>", data_source="countdown", ground_truth=GT),
        _item("#### 5", data_source="unknown/source", ground_truth="5"),
    ]
    with RewardPool(None, num_workers=2) as pool:
        rewards, metrics = pool.score(items)
    assert rewards == [1.0, 1.0, 1.0, 0.0] and metrics["reward/errors_exception"] == 1.0
    assert "unknown/source" in pool.last_errors[0]


def test_pool_workers_do_not_import_torch(rewards_py):
    with RewardPool((rewards_py, "no_torch"), num_workers=1) as pool:
        assert pool.score([_item("x")])[0] == [1.0]


def test_pool_bad_spec_raises_at_construction(rewards_py, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        RewardPool((str(tmp_path / "nope.py"), "f"), num_workers=2)
    with pytest.raises(ValueError, match=r"my_rewards\.py.*'absent'"):
        RewardPool((rewards_py, "absent"), num_workers=2)
    with pytest.raises(AttributeError, match="absent"):
        RewardPool((rewards_py, "absent"), num_workers=0)


def test_pool_survives_a_replacement_worker_that_cannot_start(rewards_py):
    with RewardPool((rewards_py, "mixed"), num_workers=1, timeout_s=1.0, max_error_frac=1.0) as pool:
        good = Path(rewards_py).read_text()
        Path(rewards_py).write_text("raise ImportError('file broken after start')\n")
        rewards, metrics = pool.score([_item("slow"), _item("ok:1")])  # the replacement fails to load
        assert rewards == [0.0, 0.0] and metrics["reward/errors_timeout"] == 1.0
        assert metrics["reward/errors_exception"] == 1.0 and "no reward worker" in pool.last_errors[1]
        Path(rewards_py).write_text(good)
        assert pool.score([_item("ok:1"), _item("ok:2")])[0] == [1.0, 2.0]  # score() refills the pool


# ---------------------------------------------------------------- failures that must not pass silently


def test_pool_stops_when_most_calls_fail(rewards_py):
    for workers in (0, 1):
        with RewardPool((rewards_py, "mixed"), num_workers=workers) as pool:  # max_error_frac 0.5
            rewards, metrics = pool.score([_item("raise"), _item("raise"), _item("ok:1"), _item("ok:2")])
            assert rewards == [0.0, 0.0, 1.0, 2.0] and metrics["reward/errors"] == 2.0  # half: not more
            with pytest.raises(
                RuntimeError, match=r"^3 of 4 reward calls failed .*max_error_frac=0.5.*boom$"
            ):
                pool.score([_item("raise"), _item("ok:1"), _item("raise"), _item("raise")])
    with RewardPool(None, num_workers=1) as pool:  # every row's data_source has no scorer
        with pytest.raises(RuntimeError, match=r"2 of 2 .*no reward function for data_source 'my/set'"):
            pool.score([_item("#### 1", data_source="my/set")] * 2)
    with pytest.raises(ValueError, match=r"num_workers=-1 must be >= 0"):
        RewardPool(None, num_workers=-1)
    with pytest.raises(ValueError, match=r"max_error_frac=1.5 must be in \[0, 1\]"):
        RewardPool(None, num_workers=0, max_error_frac=1.5)


def test_check_data_sources_names_the_unknown_ones(rewards_py):
    reward.check_data_sources(["openai/gsm8k", "countdown-3to4", "HuggingFaceH4/MATH-500"], None)
    with pytest.raises(ValueError, match=r"data_source 'my/set'; registered: openai/gsm8k, .*countdown\*"):
        reward.check_data_sources(["openai/gsm8k", "my/set", "my/set"], None)
    reward.check_data_sources(["my/set"], (rewards_py, "mixed"))  # a custom function scores any source


def test_module_that_exits_while_imported_is_named(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("import os\nimport sys\nsys.stderr.write('loading exits.py')\nos._exit(3)\n")
    with pytest.raises(
        ValueError, match=r"exited with code 3 while importing .*exits\.py.*loading exits\.py"
    ):
        RewardPool((str(path), "f"), num_workers=2)


def test_in_process_mode_enforces_the_timeout(rewards_py):
    start = time.perf_counter()
    with RewardPool((rewards_py, "mixed"), num_workers=0, timeout_s=1.0) as pool:
        rewards, metrics = pool.score([_item("slow"), _item("ok:2"), _item("nap")])
        assert rewards == [0.0, 2.0, 7.0] and metrics["reward/errors_timeout"] == 1.0
        assert "timed out" in pool.last_errors[0]
        assert time.perf_counter() - start < 5.0  # the 30 s sleep was cut at 1 s
        with concurrent.futures.ThreadPoolExecutor(1) as ex:  # signals work only in the main thread
            with pytest.raises(RuntimeError, match="main thread.*num_workers >= 1"):
                ex.submit(pool.score, [_item("ok:1")]).result()
    with RewardPool((rewards_py, "mixed"), num_workers=0, timeout_s=math.inf) as pool:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:  # no limit: nothing to enforce
            assert ex.submit(pool.score, [_item("ok:1")]).result()[0] == [1.0]


def test_reward_text_in_the_log_is_capped(rewards_py, capfd, caplog):
    with RewardPool((rewards_py, "loud"), num_workers=1, max_error_frac=1.0) as pool:
        rewards, _ = pool.score([_item("raise"), _item("ok"), _item("ok")])
        assert rewards == [0.0, 1.0, 1.0]
        assert len(pool.last_errors[0]) < 5000 and "995" in pool.last_errors[0]  # "... [995904 ... cut]"
    err = capfd.readouterr().err
    assert 4000 < len(err) < 10_000, len(err)  # was 3.3 MB
    assert "1 of 3 calls that wrote to it" in err and "[1095904 more bytes cut]" in err  # 4096 shown
    assert sum(len(r.getMessage()) for r in caplog.records) < 5000


def _alive(pid: int) -> bool:
    try:  # a zombie that nobody reaped (PID 1 in a container may not) is dead too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _gone_soon(pid: int) -> bool:
    for _ in range(40):
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_processes_a_reward_function_starts_end_with_its_worker(rewards_py, tmp_path):
    pid_file = tmp_path / "child.pid"
    with RewardPool((rewards_py, "spawn"), num_workers=1, timeout_s=1.0, max_error_frac=1.0) as pool:
        assert pool.score([_item("hang", prompt=str(pid_file))])[0] == [0.0]  # timed out
        timed_out_child = int(pid_file.read_text())
        assert _gone_soon(timed_out_child)
        assert pool.score([_item("ok", prompt=str(pid_file))])[0] == [1.0]
        child = int(pid_file.read_text())
        assert _alive(child)
    assert _gone_soon(child)  # close()


def test_processes_end_when_the_trainer_dies(rewards_py, tmp_path):
    # a trainer that dies without close(): one worker idle (its child from the last call lives on), one in a
    # 30 s call; the idle one sees EOF, the busy one's watchdog thread sees the trainer gone (within 1 s)
    idle, busy = tmp_path / "idle.pid", tmp_path / "busy.pid"
    script = f"""
import os, sys, threading, time
sys.path.insert(0, {str(Path(reward.__file__).parent)!r})
import reward_pool
pool = reward_pool.RewardPool(({rewards_py!r}, "spawn"), num_workers=2, timeout_s=60)
items = [dict(prompt={str(idle)!r}, response="ok"), dict(prompt={str(busy)!r}, response="hang")]
threading.Thread(target=pool.score, args=(items,), daemon=True).start()
while not (os.path.exists({str(busy)!r}) and os.path.exists({str(idle)!r})):
    time.sleep(0.05)
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", script], timeout=30, check=True)
    children = [int(idle.read_text()), int(busy.read_text())]
    time.sleep(1.5)
    assert not any(_alive(pid) for pid in children), children


def test_huge_rewards_are_refused_and_counted(rewards_py):
    items = [_item("ok:1e308"), _item("ok:-1e7"), _item("ok:1e6"), _item("ok:3")]
    with RewardPool((rewards_py, "mixed"), num_workers=0) as pool:  # max_abs_reward 1e6
        rewards, metrics = pool.score(items)
    assert rewards == [0.0, 0.0, 1e6, 3.0]
    assert metrics["reward/errors_out_of_range"] == 2.0 and metrics["reward/errors"] == 2.0
    assert "1e+308" in pool.last_errors[0] and "max_abs_reward=1000000.0" in pool.last_errors[0]
    with RewardPool((rewards_py, "mixed"), num_workers=1, max_abs_reward=2.0, max_error_frac=1.0) as pool:
        rewards, metrics = pool.score(items)
    assert rewards == [0.0, 0.0, 0.0, 0.0] and metrics["reward/errors_out_of_range"] == 4.0


def test_reward_kwargs_reach_every_call(tmp_path):
    """custom_reward_function.reward_kwargs (verl's `+custom_reward_function.reward_kwargs.K=V`): bound by name in
    the worker processes and in process; a name the function does not take, or one of the row's, is refused at
    load with the function's signature."""
    path = tmp_path / "kw.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, bonus=None):\n"
        "    return scale * len(solution_str) + (bonus or {}).get('x', 0)\n"
        "def any_kwargs(data_source, solution_str, ground_truth, **kw):\n"
        "    return float(kw['alpha'])\n"
    )
    kwargs = {"scale": 0.5, "bonus": {"x": 10}}
    for workers in (0, 2):
        with RewardPool((str(path), None, kwargs), num_workers=workers) as pool:
            rewards, _ = pool.score([_item("abcd"), _item("ab")])
        assert rewards == [12.0, 11.0], workers
    with RewardPool((str(path), None), num_workers=0) as pool:  # no kwargs: the defaults
        assert pool.score([_item("abcd")])[0] == [4.0]
    assert reward.load_scorer((str(path), "any_kwargs", {"alpha": 3}))(_item("a")) == 3.0
    with pytest.raises(TypeError, match=r"reward_kwargs.gamma: is not a parameter.*scale=1.0"):
        reward.load_scorer((str(path), None, {"gamma": 1}))
    with pytest.raises(TypeError, match="reward_kwargs.extra_info: names an argument of the row"):
        reward.load_scorer((str(path), "any_kwargs", {"extra_info": {}}))
    with pytest.raises(ValueError, match="failed to load in a worker.*gamma"):
        RewardPool((str(path), None, {"gamma": 1}), num_workers=1)
