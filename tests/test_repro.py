"""scripts/repro.sh at toy size on CPU (SIZE=toy: 2 ranks, a 0.5M-parameter model, a few steps per stage): every
stage runs, every file the README's table is made from is written, and the summary's numbers hang together."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("repro_summary", ROOT / "scripts" / "repro_summary.py")
summary_mod = sys.modules.setdefault("repro_summary", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(summary_mod)
FIGURES = {"reward", "kl", "entropy", "response_length", "clipfrac", "loss", "timing"}


def fake_seed(folder: Path, sft_acc: float, grpo_acc: float, ppo_acc: float) -> None:
    """The metrics.jsonl lines repro_summary reads, for one seed."""
    lines = {
        "sft": [{"step": 0, "val/loss": 5.8}, {"step": 1, "train/loss": 3.0}, {"step": 2, "val/loss": 1.5}],
        "grpo": [{"step": 0, "val/reward/mean": sft_acc}, {"step": 5, "val/reward/mean": grpo_acc}],
        "ppo": [{"step": 0, "val/reward/mean": sft_acc}, {"step": 3, "val/reward/mean": 0.0},
                {"step": 6, "val/reward/mean": ppo_acc}],
    }  # fmt: skip
    for stage, rows in lines.items():
        (folder / stage).mkdir(parents=True)
        (folder / stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "wall_s.txt").write_text("sft 100.5\nmerge 3.0\ngrpo 200.0\nppo 210.25\n")


def test_summary_of_two_seeds_by_hand(tmp_path):
    fake_seed(tmp_path / "seed0", 0.25, 0.5, 0.375)
    fake_seed(tmp_path / "seed1", 0.35, 0.4, 0.5)
    (tmp_path / "wall_s.txt").write_text("data 40.0\n")
    s = summary_mod.main(tmp_path)
    assert s == json.loads((tmp_path / "summary.json").read_text())
    assert s["seeds"]["0"] == {
        "acc_after_sft": 0.25, "acc_after_grpo": 0.5, "acc_after_ppo": 0.375, "acc_after_sft_measured_by_ppo": 0.25,
        "val_loss_before_sft": 5.8, "val_loss_after_sft": 1.5, "steps": {"sft": 2, "grpo": 5, "ppo": 6},
        "wall_s": {"sft": 100.5, "merge": 3.0, "grpo": 200.0, "ppo": 210.25},
    }  # fmt: skip
    assert s["mean"] == pytest.approx({"acc_after_sft": 0.3, "acc_after_grpo": 0.45, "acc_after_ppo": 0.4375})
    assert s["spread"] == pytest.approx({"acc_after_sft": 0.1, "acc_after_grpo": 0.1, "acc_after_ppo": 0.125})
    assert s["wall_s_data_and_model"] == 40.0 and s["model"] is None and s["n_test"] is None
    (tmp_path / "seed1" / "grpo" / "metrics.jsonl").write_text('{"step": 5, "val/reward/mean": 0.4}\n')
    with pytest.raises(ValueError, match="seed1: grpo and ppo must validate before training"):
        summary_mod.main(tmp_path)


@pytest.mark.slow
def test_repro_pipeline_at_toy_size(tmp_path):
    out = tmp_path / "repro"
    env = dict(os.environ, SIZE="toy", OUT=str(out), DOCS="")
    p = subprocess.run(
        ["bash", "scripts/repro.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["n_test"] == 64 and summary["model"]["layers"] == 2 and summary["model"]["hidden_size"] == 128
    )
    assert 4e5 < summary["model"]["parameters"] < 7e5
    s = summary["seeds"]["0"]
    assert s["steps"] == {"sft": 40, "grpo": 2, "ppo": 2}
    # Random init starts near ln(293) = 5.7 (TASK=arith3's vocabulary); 40 SFT steps at lr 3e-3 fall well below.
    assert s["val_loss_before_sft"] > 5.0 and s["val_loss_after_sft"] < 0.6 * s["val_loss_before_sft"]
    for k in ("acc_after_sft", "acc_after_grpo", "acc_after_ppo"):
        assert 0.0 <= s[k] <= 1.0 and (s[k] * 64).is_integer(), (k, s[k])  # a share of the 64 problems
    # grpo.py and ppo.py both validate the same merged SFT model greedily before their first step.
    assert s["acc_after_sft_measured_by_ppo"] == s["acc_after_sft"]
    assert set(s["wall_s"]) == {"sft", "merge", "grpo", "ppo"} and all(v > 0 for v in s["wall_s"].values())
    assert summary["wall_s_data_and_model"] > 0
    run = out / "seed0"
    assert {p.stem for p in (run / "plots").glob("*.png")} == FIGURES
    for stage in ("sft", "grpo", "ppo"):
        report = (run / stage / "report.md").read_text()
        assert report.startswith(f"# Run report: {stage}") and "## Time per phase" in report
    assert "mean" not in summary  # one seed: no spread
