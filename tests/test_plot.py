"""plot.py on synthetic metrics.jsonl files: the series it extracts equal the numbers written, PNGs are valid
and skipped when their metrics are missing, phases stack as documented, runs are labelled apart."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import log
import plot

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_lines(run: Path, lines: list[str]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run


def grpo_like(run: Path) -> Path:
    """10 steps: val at 0, 5, 10; a null reward at step 3; step 4 logged twice (the second line wins); a last
    line cut short by a crash."""
    lines = [json.dumps({"step": 0, "val/reward/mean": 0.25})]
    for s in range(1, 11):
        row = {
            "step": s,
            "reward/mean": None if s == 3 else 0.1 * s,
            "actor/kl_loss": 0.001 * s,
            "actor/entropy": 2.0 - 0.1 * s,
            "response_length/mean": 30.0 + s,
            "actor/pg_clipfrac": 0.01,
            "timing_s/gen": 2.0,
            "timing_s/update": 1.0,
            "timing_s/step": 3.5,
        }
        if s % 5 == 0:
            row |= {"val/reward/mean": 0.25 + 0.05 * s, "timing_s/val": 4.0}
        lines.append(json.dumps(row))
        if s == 4:
            lines.append(json.dumps(row | {"reward/mean": 0.45}))  # the resumed run's line for step 4
    lines.append('{"step": 11, "reward/me')
    return write_lines(run, lines)


def sft_like(run: Path) -> Path:
    lines = [json.dumps({"step": 0, "val/loss": 5.5})]
    lines += [json.dumps({"step": s, "train/loss": 5.0 / s, "timing_s/step": 0.5}) for s in range(1, 5)]
    lines.append(json.dumps({"step": 4, "train/loss": 1.25, "val/loss": 1.5, "timing_s/step": 0.5}))
    return write_lines(run, lines)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_series_equal_the_numbers_written(tmp_path):
    s = plot.series(log.read_metrics(grpo_like(tmp_path / "grpo")))
    steps, values = s["reward/mean"]
    assert steps == [1, 2, 4, 5, 6, 7, 8, 9, 10]  # the null at step 3 is not a point; the cut line 11 is gone
    assert values[:3] == [0.1, 0.2, 0.45]  # step 4: the last of its two lines
    assert values[3:] == [0.1 * s for s in range(5, 11)]
    assert s["val/reward/mean"] == ([0, 5, 10], [0.25, 0.5, 0.75])
    assert s["actor/kl_loss"][1] == [0.001 * s for s in range(1, 11)]
    assert "train/loss" not in s

    sft = plot.series(log.read_metrics(sft_like(tmp_path / "sft")))
    assert sft["train/loss"] == ([1, 2, 3, 4], [5.0, 2.5, 5.0 / 3, 1.25])
    assert sft["val/loss"] == ([0, 4], [5.5, 1.5])


def test_phase_means_and_stack(tmp_path):
    rows = log.read_metrics(grpo_like(tmp_path / "grpo"))
    times = log.phase_times(rows)
    # 10 timed steps; val ran at steps 5 and 10 (4 s each): 8 s over 10 steps.
    assert times == {"gen": 2.0, "update": 1.0, "step": 3.5, "val": 0.8}
    assert plot.stack_phases(times) == {"gen": 2.0, "update": 1.0, "other": 0.5, "val": 0.8}
    assert plot.stack_phases({"step": 0.5}) == {"step": 0.5}  # sft.py times whole steps only
    assert plot.stack_phases({"gen": 1.0, "step": 1.0}) == {"gen": 1.0}  # nothing left over: no "other"


def test_pngs_written_valid_and_overlaid(tmp_path):
    a = grpo_like(tmp_path / "x" / "run")
    b = sft_like(tmp_path / "y" / "run")  # same folder name: labels must tell them apart
    assert plot.run_labels([a, b]) == ["x/run", "y/run"]
    out = tmp_path / "plots"
    written = plot.main(plot.PlotConfig(runs=[str(a), str(b)], out=str(out)))
    names = sorted(p.name for p in written)
    assert names == sorted(
        [
            "reward.png",
            "kl.png",
            "entropy.png",
            "response_length.png",
            "clipfrac.png",
            "loss.png",
            "timing.png",
        ]
    )
    for p in written:
        assert p.parent == out and p.stat().st_size > 2000, p
        assert png_size(p) == (480, 320), p
    first = {p.name: p.read_bytes() for p in written}
    plot.main(plot.PlotConfig(runs=[str(a), str(b)], out=str(out)))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # same data, same bytes


def test_missing_metrics_are_skipped(tmp_path):
    run = sft_like(tmp_path / "sft")
    written = plot.main(plot.PlotConfig(runs=[str(run / "metrics.jsonl")]))  # a metrics file works too
    assert sorted(p.name for p in written) == ["loss.png", "timing.png"]
    assert written[0].parent == run / "plots"  # one run: RUN/plots
    bare = write_lines(tmp_path / "bare", [json.dumps({"step": 1, "custom/x": 1.0})])
    assert plot.main(plot.PlotConfig(runs=[str(bare)], out=str(tmp_path / "o"))) == []


def test_cli(tmp_path):
    run = grpo_like(tmp_path / "grpo")
    p = subprocess.run(
        [sys.executable, str(ROOT / "plot.py"), str(run), "--out", str(tmp_path / "cli")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    printed = [Path(line) for line in p.stdout.splitlines()]
    assert [x.name for x in printed] == [
        "reward.png", "kl.png", "entropy.png", "response_length.png", "clipfrac.png", "timing.png"
    ]  # fmt: skip
    assert all(png_size(x) == (480, 320) for x in printed)
