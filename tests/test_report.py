"""log.write_report: RUN/report.md from a synthetic run folder (numbers checked by hand), rank 0 only, a missing
metrics file; and the two call sites: sft.main (in process, on the toy) and rl.close."""

from __future__ import annotations

import importlib.metadata
import json
import types
from pathlib import Path

import config
import grpo
import log
import rl
import sft

CONFIG_YAML = "data:\n  train_batch_size: 16\ntrainer:\n  total_training_steps: 3\n"


def synthetic_run(run: Path) -> Path:
    """3 GRPO-like steps on 1 GPU: gen 2/2/2 s, update 1/1/1 s, step 3.5 s, val once (3 s) at step 3."""
    run.mkdir(parents=True)
    rows = [{"step": 0, "val/reward/mean": 0.25}]
    for s, tput, mem in ((1, 1000.0, 10.5), (2, 2000.0, 12.25), (3, 3000.0, 11.0)):
        rows.append(
            {
                "step": s,
                "reward/mean": 0.1 * s,
                "timing_s/gen": 2.0,
                "timing_s/update": 1.0,
                "timing_s/step": 3.5,
                "perf/throughput": tput,
                "perf/max_memory_allocated_gb": mem,
                "actor/grad_norm": None,
            }
        )
    rows[-1] |= {"val/reward/mean": 0.5, "timing_s/val": 3.0}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_report_of_a_synthetic_run(tmp_path):
    run = synthetic_run(tmp_path / "grpo-run")
    path = log.write_report(run, CONFIG_YAML, results={"val/reward/mean_before": 0.25, "global_step": 3})
    assert path == run / "report.md"
    text = path.read_text()
    lines = text.splitlines()
    assert lines[0] == "# Run report: grpo-run"
    assert "- steps logged: 4 (steps 0..3)" in lines
    # hardware and versions
    assert f"{log.hardware_info()['cpu_cores']} cores |" in text
    assert f"| torch | {importlib.metadata.version('torch')} |" in lines
    assert f"| transformers | {importlib.metadata.version('transformers')} |" in lines
    # final metrics: what the run returned, then the last logged value of each metric (null stays null)
    assert "| val/reward/mean_before | 0.25 |" in lines and "| global_step | 3 |" in lines
    assert "| val/reward/mean | 3 | 0.5 |" in lines and "| reward/mean | 3 | 0.3 |" in lines
    assert "| actor/grad_norm | 3 | null |" in lines
    # phases: means over the 3 timed steps; val ran once (3 s) so it costs 1 s a step
    assert "Mean seconds per step over 3 timed steps" in text
    assert "| gen | 2 | 6 |" in lines and "| update | 1 | 3 |" in lines
    assert "| step | 3.5 | 10.5 |" in lines and "| val | 1 | 3 |" in lines
    # throughput: mean of 1000, 2000, 3000; peak memory: the max
    assert "| tokens/s per rank (mean `perf/throughput`) | 2000 |" in lines
    assert "| peak GPU memory allocated (max `perf/max_memory_allocated_gb`) | 12.25 GiB |" in lines
    # the config, collapsed
    start = lines.index("<details><summary>resolved config (YAML)</summary>")
    want = ["```yaml", *CONFIG_YAML.splitlines(), "```"]
    assert lines[start + 2 : start + 2 + len(want)] == want


def test_only_rank0_writes_and_a_missing_metrics_file_is_reported(tmp_path):
    run = synthetic_run(tmp_path / "run")
    assert log.write_report(run, CONFIG_YAML, rank=1) is None
    assert not (run / "report.md").exists()
    empty = tmp_path / "failed-early"
    text = log.write_report(empty, CONFIG_YAML).read_text()
    assert f"No metrics logged ({empty / 'metrics.jsonl'} is missing)." in text
    assert "No `timing_s/*` metrics logged." in text and "| tokens/s | not logged |" in text
    assert "| peak GPU memory allocated | not measured (no CUDA) |" in text


def test_sft_main_writes_a_report(toy_dir, tmp_path, one_rank):
    run = tmp_path / "sft"
    cfg = sft.SFTConfig(
        data=sft.SFTDataConfig(
            train_files=str(toy_dir / "sft/train.parquet"), val_files=None, max_length=64,
            train_batch_size=8, micro_batch_size_per_gpu=4,
        ),
        model=sft.SFTModelConfig(partial_pretrain=str(toy_dir / "model")),
        optim=sft.SFTOptimConfig(lr=3e-3, warmup_steps_ratio=0.0),
        trainer=sft.SFTTrainerConfig(default_local_dir=str(run), logger=["jsonl"], total_training_steps=2),
    )  # fmt: skip
    results = sft.main(cfg)
    lines = (run / "report.md").read_text().splitlines()
    last = log.read_metrics(run)[-1]
    assert last["step"] == 2 and results["train/loss"] == last["train/loss"]
    assert f"| train/loss | {last['train/loss']:.6g} |" in lines  # returned by the run
    assert f"| train/loss | 2 | {last['train/loss']:.6g} |" in lines  # last logged
    assert (
        f"| tokens/s, all ranks (mean `perf/tokens_per_s`) | {log._mean(log.read_metrics(run), 'perf/tokens_per_s'):.4g} |"
        in lines
    )
    assert "  total_training_steps: 2" in lines  # the resolved config
    assert (
        config.parse(sft.SFTConfig, ["--config", str(run / "config.yaml")]).trainer.total_training_steps == 2
    )


def test_rl_close_writes_a_report(tmp_path):
    closed = []
    for rank in (1, 0):
        run_dir = synthetic_run(tmp_path / f"rank{rank}")
        fake = types.SimpleNamespace(
            logger=None,
            pool=types.SimpleNamespace(close=lambda: closed.append("pool")),
            scorer=types.SimpleNamespace(shutdown=lambda wait: closed.append("scorer")),
            ahead=None,
            dist=types.SimpleNamespace(rank=rank),
            run_dir=run_dir,
            cfg=grpo.GRPOConfig(trainer=rl.RLTrainerConfig(default_local_dir=str(run_dir))),
        )
        rl.close(fake, None)
        assert (run_dir / "report.md").exists() == (rank == 0)
    text = (tmp_path / "rank0" / "report.md").read_text()
    assert closed == ["scorer", "pool"] * 2 and "| reward/mean | 3 | 0.3 |" in text
    assert f"  default_local_dir: {tmp_path / 'rank0'}" in text
