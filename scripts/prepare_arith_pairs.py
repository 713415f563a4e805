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

On-policy pairs (what raised the toy model's greedy accuracy, configs/dpo_toy.yaml): the model's own right and wrong
responses, from grpo.py's validation file of several samples a prompt:

    torchrun --nproc_per_node 1 grpo.py --config configs/grpo_arith_words_smollm2.yaml --trainer.val_only \
      --model.path runs/real/model --data.val_files runs/real/data/arith_words/train.parquet \
      --rollout.val_kwargs.n 4 --rollout.val_kwargs.temperature 1.0 --rollout.val_kwargs.do_sample \
      --trainer.default_local_dir runs/real/gen_train
    python scripts/prepare_arith_pairs.py --generations runs/real/gen_train/val_generations/step_0.jsonl \
      --out runs/real/data/arith_policy_pairs --split train

writes OUT/SPLIT.parquet: per prompt, its first right response (score 1) against its first wrong non-empty one;
prompts whose samples all score alike give none. The prompts there are the rendered chat text the engine was given,
so dpo.py reads them with `data.apply_chat_template=false` (completion = the response + eos, as generated).
"""

from __future__ import annotations

import json
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
    generations: str | None = None
    """A grpo.py RUN/val_generations/step_N.jsonl of several samples a prompt: write on-policy pairs from it instead."""
    split: str = "train"
    """With --generations: the name of the file written (OUT/SPLIT.parquet)."""


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


def policy_pairs(lines: list[dict]) -> list[dict]:
    """Rows of a val_generations file ({prompt, response, ground_truth, score}) -> {prompt, chosen, rejected}, one
    per prompt that has a right (score 1) and a wrong non-empty response, in the file's order."""
    by_prompt: dict[str, list[dict]] = {}
    for r in lines:
        by_prompt.setdefault(r["prompt"], []).append(r)
    rows = []
    for prompt, rs in by_prompt.items():
        right = [r["response"] for r in rs if r["score"] == 1]
        wrong = [r["response"] for r in rs if r["score"] != 1 and r["response"].strip()]
        if right and wrong:
            rows.append({"prompt": prompt, "chosen": right[0], "rejected": wrong[0]})
    return rows


def main(args: Args) -> None:
    src, out = Path(args.src).expanduser(), Path(args.out).expanduser()
    if args.generations is not None:
        path = Path(args.generations).expanduser()
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = policy_pairs(lines)
        out.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), out / f"{args.split}.parquet")
        print(f"{len(rows)} pairs from {len(lines)} responses -> {out / f'{args.split}.parquet'}")
        return
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
