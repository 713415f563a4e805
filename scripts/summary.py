"""Collects the demo's numbers from its runs' metrics.jsonl into RUN/summary.json and prints them."""

import json
import sys
from pathlib import Path


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(root: Path) -> dict:
    base = metrics(root / "eval_base" / "metrics.jsonl")
    sft = metrics(root / "sft" / "metrics.jsonl")
    grpo = [m for m in metrics(root / "grpo" / "metrics.jsonl") if "val/reward/mean" in m]
    ppo = [m for m in metrics(root / "ppo" / "metrics.jsonl") if "val/reward/mean" in m]
    summary = {
        "val_acc_before_sft": base[-1]["val/reward/mean"],
        "val_acc_after_sft": grpo[0]["val/reward/mean"],  # grpo.py validates its starting model first
        "val_acc_after_grpo": grpo[-1]["val/reward/mean"],
        "val_acc_after_ppo": ppo[-1]["val/reward/mean"],
        "val_loss_before_sft": next(m["val/loss"] for m in sft if "val/loss" in m),
        "val_loss_after_sft": [m["val/loss"] for m in sft if "val/loss" in m][-1],
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/demo"))
