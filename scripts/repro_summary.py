"""The numbers of scripts/repro.sh, from its runs' metrics.jsonl and stage clocks, into OUT/summary.json.

    python scripts/repro_summary.py runs/repro

For every OUT/seed<S>/ folder: greedy accuracy on the held-out problems after SFT (grpo.py validates the merged SFT
model before its first step), after GRPO and after PPO (the last validation of each run), the accuracy ppo.py
measured on the same SFT model before its first step (equal to the first unless GPU kernels are nondeterministic), the SFT validation loss before
and after, the steps of each stage and the wall-clock of each stage (OUT/seed<S>/wall_s.txt, written by
repro.sh). With two seeds or more: the mean and the spread (max - min) of each accuracy. Also the commit, the
model's size and the number of held-out problems.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import log  # noqa: E402  (the repo's metrics reader)

ACCURACIES = ("acc_after_sft", "acc_after_grpo", "acc_after_ppo")


def vals(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that logged `key` with a value."""
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def seed_summary(folder: Path) -> dict:
    """The numbers of one seed's runs (see the module docstring)."""
    sft, grpo, ppo = (log.read_metrics(folder / name) for name in ("sft", "grpo", "ppo"))
    g_val, p_val, s_val = vals(grpo, "val/reward/mean"), vals(ppo, "val/reward/mean"), vals(sft, "val/loss")
    if not g_val or g_val[0][0] != 0 or not p_val or p_val[0][0] != 0:
        raise ValueError(f"{folder}: grpo and ppo must validate before training (trainer.val_before_train)")
    return {
        "acc_after_sft": g_val[0][1],
        "acc_after_grpo": g_val[-1][1],
        "acc_after_ppo": p_val[-1][1],
        "acc_after_sft_measured_by_ppo": p_val[0][1],
        "val_loss_before_sft": s_val[0][1],
        "val_loss_after_sft": s_val[-1][1],
        "steps": {"sft": sft[-1]["step"], "grpo": grpo[-1]["step"], "ppo": ppo[-1]["step"]},
        "wall_s": read_clock(folder / "wall_s.txt"),
    }


def read_clock(path: Path) -> dict[str, float]:
    """repro.sh's stage clock: lines "NAME SECONDS" -> {NAME: SECONDS} ({} without the file)."""
    if not path.is_file():
        return {}
    return {
        name: float(sec) for name, sec in (line.split() for line in path.read_text().splitlines() if line)
    }


def model_size(model_dir: Path) -> dict:
    """Layers, hidden size and parameter count (from the safetensors header: no weights are read)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    n = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, t in header.items():
            if name != "__metadata__":
                n += math.prod(t["shape"])
    return {"layers": cfg["num_hidden_layers"], "hidden_size": cfg["hidden_size"], "parameters": n}


def main(out: Path) -> dict:
    """Writes OUT/summary.json and returns it."""
    seeds = {p.name.removeprefix("seed"): seed_summary(p) for p in sorted(out.glob("seed*")) if p.is_dir()}
    if not seeds:
        raise FileNotFoundError(f"no seed<S>/ run folders under {out}")
    if (out / "data" / "rl").is_dir():  # TASK=arith3: toy.py's layout
        task = "three-digit addition and subtraction, worked columns or direct answers; model trained from scratch"
        model_dir, test_rows = out / "data" / "model", out / "data" / "rl" / "val.parquet"
    else:
        task = "countdown, 3-4 numbers in [1, 99], target in [1, 99]; model trained from scratch"
        model_dir, test_rows = out / "model", out / "data" / "test.parquet"
    summary = {
        "task": task,
        "commit": log.run_info()["commit"],  # $FLATRL_COMMIT where the tree is a copy (the GPU machine's)
        "model": model_size(model_dir) if model_dir.is_dir() else None,
        "n_test": _rows(test_rows) if test_rows.is_file() else None,
        "wall_s_data_and_model": read_clock(out / "wall_s.txt").get("data"),
        "seeds": seeds,
    }
    if len(seeds) > 1:
        summary["mean"] = {k: statistics.fmean(s[k] for s in seeds.values()) for k in ACCURACIES}
        summary["spread"] = {
            k: max(s[k] for s in seeds.values()) - min(s[k] for s in seeds.values()) for k in ACCURACIES
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/repro")), indent=2))
