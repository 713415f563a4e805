"""GSM8K -> parquet in verl's RL schema, plus flat columns for SFT, one file per split (train, test).

    python scripts/prepare_gsm8k.py --out ~/data/gsm8k          # reads ../shared/data/gsm8k beside the repo
    python scripts/prepare_gsm8k.py --src DIR --out ~/data/gsm8k      # DIR holds train.jsonl and test.jsonl
    python scripts/prepare_gsm8k.py --from-hub --out ~/data/gsm8k     # needs `datasets` and hub access

Each row, as verl's examples/data_preprocess/gsm8k.py writes it:
    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": the number after "####"}
    extra_info    {"split", "index", "question", "answer"}
and three flat columns for sft.py:
    sft_prompt    question + " " + INSTRUCTION: the RL prompt's user turn, character for character
    question      the bare question (what verl's SFT tutorial trains on: configs/sft_verl_tutorial.yaml)
    answer        GSM8K's worked solution, ending in "#### N" (what the RL reward, reward.gsm8k_score, reads)

SFT then RL on the same prompt: train SFT with `data.prompt_key: sft_prompt` and `data.response_key: answer`
(configs/sft_gsm8k_smollm2.yaml). sft.py renders the prompt string as one user turn through the chat template,
as the RL data path renders `prompt`, so the SFT model sees exactly the tokens the RL stages and the evaluation
prompt it with, and learns to end with the "####" line that the reward reads. SFT on `question` instead
trains on a prompt RL never shows, without the instruction.
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
DEFAULT_SRC = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"  # ../shared/data/gsm8k


@dataclass(frozen=True)
class Args:
    """Where GSM8K comes from and where the parquet files go."""

    out: str = "~/data/gsm8k"
    """Output folder for train.parquet and test.parquet."""
    src: str = str(DEFAULT_SRC)
    """Folder with train.jsonl and test.jsonl (openai/grade-school-math's files); the default is the shared/
    folder beside the repository."""
    from_hub: bool = False
    """Read openai/gsm8k (config main) with the `datasets` library instead of `src`."""
    limit: int | None = None
    """Keep only the first N rows of each split (quick runs: scripts/real_model.sh SIZE=cpu); None: all."""


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
        user = r["question"] + " " + INSTRUCTION
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": user}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": final_answer(r["answer"], where)},
                "extra_info": {"split": split, "index": i, "question": r["question"], "answer": r["answer"]},
                "sft_prompt": user,
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
    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"prepare_gsm8k: --limit must be >= 1 rows, got {args.limit}")
    src = Path(os.path.expanduser(args.src))
    if not args.from_hub and not all((src / f"{split}.jsonl").is_file() for split in ("train", "test")):
        raise SystemExit(
            f"prepare_gsm8k: no train.jsonl and test.jsonl in {src}"
            + (
                " (the default: ../shared/data/gsm8k beside the repository)"
                if args.src == str(DEFAULT_SRC)
                else ""
            )
            + "; pass --src DIR with openai/grade-school-math's files, or --from-hub"
        )
    out = Path(os.path.expanduser(args.out))
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        if args.from_hub:
            import datasets

            rows = list(datasets.load_dataset("openai/gsm8k", "main", split=split))
            source = f"openai/gsm8k[{split}]"
        else:
            source = str(src / f"{split}.jsonl")
            rows = read_jsonl(Path(source))
        table = convert(rows[: args.limit], split, source)
        pq.write_table(table, out / f"{split}.parquet")
        print(f"{source}: {table.num_rows} rows -> {out / f'{split}.parquet'}")


if __name__ == "__main__":
    main(tyro.cli(Args))
