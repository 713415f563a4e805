"""Preference pairs for dpo.py from the word-arithmetic task of scripts/prepare_arith_words.py: the same prompts,
a right worked answer against the same answer worked with a slip.

    python scripts/prepare_arith_words.py --out runs/real/data/arith_words
    python scripts/prepare_arith_pairs.py --src runs/real/data/arith_words --out runs/real/data/arith_pairs

Each row of SRC/{train,test}.parquet (verl's schema) becomes one row of OUT/{train,test}.parquet (TRL's preference
layout, read by dpo.py):
    prompt     the row's chat messages as they are (the worked example turn, then the question + "####" instruction)
    chosen     "7 plus 5 is 12.\\n#### 12": the example turn's own form, with the right answer
    rejected   "7 plus 5 is 13.\\n#### 13": the same sentence with a wrong answer (off by 1 or 2, never negative)
Both are written the same way, so the pair differs only in the number. The test pairs ask the held-out expressions
of SRC/test.parquet, so configs/dpo_arith_words_smollm2.yaml's val/rewards/accuracies is measured on problems no
train pair asks, and grpo.py's greedy validation on SRC/test.parquet measures the task accuracy before and after.
The same seed gives byte-identical files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import tyro

WORDS = {"+": "plus", "-": "minus"}
SCHEMA = pa.schema(
    [
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("chosen", pa.string()),
        ("rejected", pa.string()),
    ]
)


@dataclass(frozen=True)
class Args:
    """Where the word-arithmetic problems are and where the pairs go."""

    src: str = "runs/real/data/arith_words"
    """Folder with prepare_arith_words.py's train.parquet and test.parquet."""
    out: str = "runs/real/data/arith_pairs"
    """Output folder for train.parquet and test.parquet."""
    n_train: int | None = None
    """Use only the first N train problems (None: all)."""
    n_test: int | None = None
    """Use only the first N test problems (None: all)."""
    seed: int = 0
    """Seed of the wrong answers."""


def worked(expression: str, answer: int) -> str:
    """The answer in the form of the prompt's worked example ("5 plus 3 is 8.\\n#### 8")."""
    a, op, b = expression.split(" ")
    return f"{a} {WORDS[op]} {b} is {answer}.\n#### {answer}"


def pair(row: dict, rng: random.Random) -> dict:
    """One verl-schema row -> {prompt, chosen, rejected}."""
    expression, answer = row["extra_info"]["expression"], int(row["reward_model"]["ground_truth"])
    wrong = [w for w in (answer - 2, answer - 1, answer + 1, answer + 2) if w >= 0]
    return {
        "prompt": row["prompt"],
        "chosen": worked(expression, answer),
        "rejected": worked(expression, rng.choice(wrong)),
    }


def main(args: Args) -> None:
    src, out = Path(args.src).expanduser(), Path(args.out).expanduser()
    rng = random.Random(args.seed)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.n_train), ("test", args.n_test)):
        path = src / f"{split}.parquet"
        if not path.is_file():
            raise SystemExit(
                f"prepare_arith_pairs: {path} is missing; run scripts/prepare_arith_words.py first"
            )
        rows = pq.read_table(path).to_pylist()[:n]
        pq.write_table(
            pa.Table.from_pylist([pair(r, rng) for r in rows], schema=SCHEMA), out / f"{split}.parquet"
        )
        print(f"{len(rows)} {split} pairs -> {out / f'{split}.parquet'}")


if __name__ == "__main__":
    main(tyro.cli(Args))
