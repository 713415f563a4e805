"""Every bench script runs once at toy size on CPU, as a user runs it (`python bench/x.py --toy --out FILE`), and
prints one JSON line with its figures: the scripts stay runnable between GPU runs. Slow: each starts vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, tmp_path: Path, work: Path, *extra: str) -> dict:
    out = tmp_path / f"{script}.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / script),
        "--toy",
        "--workdir",
        str(work),
        "--out",
        str(out),
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    line = json.loads(p.stdout.strip().splitlines()[-1])  # the printed line ...
    assert json.loads(out.read_text()) == line  # ... is the file's
    assert line["hardware"]["commit"] and line["hardware"]["torch"]
    return line


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-work")  # the toy model is built once and shared


@pytest.mark.slow
def test_bench_attention(tmp_path, work):
    r = run_bench("bench_attention.py", tmp_path, work)
    assert r["bench"] == "attention" and r["tokens"] > 0
    assert r["varlen"]["logprob_max_abs_diff"] < 1e-4 and r["varlen"]["grad_rel_diff"] < 1e-4  # fp32, exact
    assert all(r[k]["fwd_bwd_s"] > 0 for k in ("varlen", "dense", "padded"))


@pytest.mark.slow
def test_bench_rollout(tmp_path, work):
    r = run_bench("bench_rollout.py", tmp_path, work)
    runs = r["runs"]
    assert set(runs) == {"bare_n1", "bare_n8", "bare_n8_lp", "flatrl_n8_call", "flatrl_n8_all"}
    assert runs["bare_n1"]["tokens"] == 4 * 16 and runs["bare_n8"]["tokens"] == 4 * 2 * 16  # ignore_eos
    assert runs["bare_n8_lp"]["tokens"] == runs["flatrl_n8_call"]["tokens"] == 4 * 2 * 16
    assert runs["flatrl_n8_all"]["tokens"] == 4 * 2 * 16
    assert runs["bare_n8"]["logprobs"] is None and runs["bare_n8_lp"]["logprobs"]["logprobs"] == 0
    # --toy checks 2 of the 4 prompts (n=2): 4 samples carry logprobs; flatrl_n8_all all 8
    assert runs["flatrl_n8_call"]["logprobs"] == {"logprob_check_prompts": 2, "samples_with_logprobs": 4}
    assert runs["flatrl_n8_all"]["logprobs"] == {"logprob_check_prompts": -1, "samples_with_logprobs": 8}
    assert all(v["tok_per_s"] > 0 for v in runs.values())
    ratios = r["ratios"]
    for k in ("flatrl_n8_call_vs_bare_n8", "bare_n8_lp_vs_bare_n8", "flatrl_n8_all_vs_bare_n8_lp"):
        assert ratios[k] > 0
    assert ratios["flatrl_n8_request_vs_bare_n8"] is None  # not in the default runs
    assert r["default"] == "flatrl_n8_call"
    assert r["engine"]["max_num_seqs"] == 16 and r["engine"]["logprobs_mode"] == "raw_logprobs"


@pytest.mark.slow
def test_bench_push(tmp_path, work):
    r = run_bench("bench_push.py", tmp_path, work)
    toy = r["sizes"]["toy"]
    assert toy["params"] > 0 and toy["gather"]["median_s"] > 0 and toy["push_awake"]["median_s"] > 0
    assert toy["level2"]["cycle_median_s"] > 0 and toy["level1"]["cycle_median_s"] > 0
    assert toy["logprob_diff_mean"] < 1e-3  # the engine runs the pushed weights (fp32 on CPU)


@pytest.mark.slow
def test_bench_update(tmp_path, work):
    r = run_bench("bench_update.py", tmp_path, work)
    toy = r["sizes"]["toy"]
    for mode in ("packed", "padded"):
        assert toy[mode]["tok_per_s"] > 0 and 0 < toy[mode]["mfu"] < 1 and toy[mode]["tokens"] > 0
    assert toy["packed"]["tokens"] == toy["padded"]["tokens"]  # the same samples, padding not counted
    assert toy["packed_vs_padded"] > 0 and toy["plan_update_gib"] > 0


@pytest.mark.slow
def test_bench_e2e(tmp_path, work):
    r = run_bench("bench_e2e.py", tmp_path, work)
    f = r["flatrl"]
    assert "error" not in f, f.get("tail")
    assert f["step_s"] > 0 and f["samples_per_hour"] > 0 and len(f["steps_s"]) == 2
    assert f["logprob_diff_mean"] < 1e-3 and f["mfu"] > 0  # grpo.py logs perf/mfu
    assert r["trl"]["skipped"]  # TRL is a GPU-only peer
