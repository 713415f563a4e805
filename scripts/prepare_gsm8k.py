"""GSM8K -> parquet in verl's RL schema (plus flat question/answer columns for SFT).

    python scripts/prepare_gsm8k.py --src ../shared/data/gsm8k --out ~/data/gsm8k
    python scripts/prepare_gsm8k.py --from-hub --out ~/data/gsm8k     # needs `datasets` and hub access

Each row, as verl's examples/data_preprocess/gsm8k.py writes it:
    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": the number after "####"}
    extra_info    {"split", "index", "question", "answer"}
and, for sft.py (`data.prompt_key: question`, `data.response_key: answer`), `question` and `answer` columns.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import tyro

# verl's instruction (examples/data_preprocess/gsm8k.py), so rewards and prompts match its baselines.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


@dataclass(frozen=True)
class Args:
    """Where GSM8K comes from and where the parquet files go."""

    out: str = "~/data/gsm8k"
    """Output folder for train.parquet and test.parquet."""
    src: str = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k")
    """Folder with train.jsonl and test.jsonl (openai/grade-school-math's files)."""
    from_hub: bool = False
    """Read openai/gsm8k (config main) with the `datasets` library instead of `src`."""


def final_answer(answer: str, where: str) -> str:
    """The number after '####' in a GSM8K solution, without thousands separators."""
    m = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    if m is None:
        raise ValueError(f"{where}: no '#### <number>' line in the answer")
    return m.group(1).replace(",", "")


def convert(rows: list[dict], split: str, source: str) -> pa.Table:
    """GSM8K rows (question, answer) -> a verl-schema table."""
    out = []
    for i, r in enumerate(rows):
        where = f"{source} row {i}"
        for key in ("question", "answer"):
            if not isinstance(r.get(key), str) or not r[key].strip():
                raise ValueError(f"{where}: key {key!r} missing or not a non-empty string")
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": r["question"] + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": final_answer(r["answer"], where)},
                "extra_info": {"split": split, "index": i, "question": r["question"], "answer": r["answer"]},
                "question": r["question"],
                "answer": r["answer"],
            }
        )
    return pa.Table.from_pylist(out)


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    return rows


def main(args: Args) -> None:
    out = Path(os.path.expanduser(args.out))
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        if args.from_hub:
            import datasets

            rows = list(datasets.load_dataset("openai/gsm8k", "main", split=split))
            source = f"openai/gsm8k[{split}]"
        else:
            source = str(Path(args.src) / f"{split}.jsonl")
            rows = read_jsonl(Path(source))
        table = convert(rows, split, source)
        pq.write_table(table, out / f"{split}.parquet")
        print(f"{source}: {table.num_rows} rows -> {out / f'{split}.parquet'}")


if __name__ == "__main__":
    main(tyro.cli(Args))
