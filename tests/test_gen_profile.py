"""bench/gen_profile.py: the sampled stacks of each vLLM generate call add up to where its seconds went; the wrapper
runs a script with every call profiled; bench_e2e sets grpo.py's calls beside the call alone. And the benches'
--toy shape no longer overrides a shape flag the user gave."""

from __future__ import annotations

import gc
import json
import sys
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_e2e  # noqa: E402
import bench_rollout  # noqa: E402
import gen_profile  # noqa: E402


def spin(seconds: float) -> int:
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def nap(seconds: float) -> None:
    time.sleep(seconds)


def test_sampler_splits_a_call_between_its_functions():
    with gen_profile.StackSampler(interval_s=0.002) as s:
        spin(0.3)
        nap(0.3)
    r = s.summary()
    assert r["samples"] > 50 and r["seconds"] == pytest.approx(0.6, abs=0.15)
    spun, slept = (
        r["inclusive_s"]["tests/test_gen_profile.py:spin"],
        r["inclusive_s"]["tests/test_gen_profile.py:nap"],
    )
    # each about half the block (sampling, and the GIL, blur it a little); the caller's frame holds all of it
    assert 0.15 < spun < 0.45 and 0.15 < slept < 0.45
    assert r["inclusive_s"]["tests/test_gen_profile.py:test_sampler_splits_a_call_between_its_functions"] == (
        pytest.approx(r["seconds"], rel=0.1)
    )
    assert r["self_s"]["tests/test_gen_profile.py:spin"] == pytest.approx(spun, rel=0.2)


def test_gc_timer_counts_the_collectors_pauses_by_generation():
    class Node:  # reference cycles: only the cyclic collector frees them
        def __init__(self):
            self.me = self

    keep = [Node() for _ in range(200_000)]  # objects a full collection walks
    with gen_profile.GCTimer() as t:
        gc.collect(0)
        gc.collect(2)
    r = t.summary()
    assert r["gc_runs_by_generation"][0] >= 1 and r["gc_runs_by_generation"][2] >= 1
    assert r["gc_s_by_generation"][2] > r["gc_s_by_generation"][0]  # the full walk is the longer one
    assert r["gc_s"] == pytest.approx(sum(r["gc_s_by_generation"]), abs=1e-3)
    assert t._callback not in gc.callbacks  # removed on exit
    del keep


def test_frame_key_cuts_site_packages():
    code = types.SimpleNamespace(
        co_filename="/x/lib/python3.12/site-packages/vllm/v1/core.py", co_name="step"
    )
    assert gen_profile.frame_key(code) == "vllm/v1/core.py:step"
    assert (
        gen_profile.frame_key(types.SimpleNamespace(co_filename="/w/main/rl.py", co_name="f"))
        == "main/rl.py:f"
    )


def test_wrapper_runs_the_script_with_each_generate_call_profiled(tmp_path, monkeypatch):
    """`python bench/gen_profile.py --out F -- script.py ARGS`: the script sees its own argv, and each call of
    vllm.LLM.generate (a stand-in module here) leaves one JSON line, written as it returns."""

    class LLM:
        def generate(self, seconds):
            spin(seconds)
            return seconds

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, json\nfrom vllm import LLM\n"
        "out = [LLM().generate(float(x)) for x in sys.argv[1:]]\n"
        "open(sys.argv[0] + '.done', 'w').write(json.dumps(out))\n"
    )
    out = tmp_path / "calls.jsonl"
    gen_profile.main(["--out", str(out), "--", str(script), "0.1", "0.2"])
    assert json.loads(Path(f"{script}.done").read_text()) == [0.1, 0.2]
    calls = [json.loads(x) for x in out.read_text().splitlines()]
    assert [c["call"] for c in calls] == [0, 1]
    for c, want in zip(calls, (0.1, 0.2), strict=True):
        assert c["seconds"] == pytest.approx(want, abs=0.05) and c["samples"] > 5
        assert c["inclusive_s"]["tests/test_gen_profile.py:spin"] == pytest.approx(c["seconds"], rel=0.35)
        assert 0 <= c["gc_s"] < c["seconds"]
    with pytest.raises(RuntimeError, match="profiled already"):  # one wrapper, not two nested
        gen_profile.install()


def test_compare_ranks_the_largest_differences_first():
    a, b = {"x": 1.0, "y": 0.5, "z": 0.2}, {"x": 0.4, "y": 0.5, "w": 0.3}
    assert gen_profile.compare(a, b, top=3) == [
        ["x", 1.0, 0.4, 0.6],
        ["w", 0.0, 0.3, -0.3],
        ["z", 0.2, 0.0, 0.2],
    ]
    calls = [{"inclusive_s": {"x": 1.0}}, {"inclusive_s": {"x": 3.0, "y": 2.0}}]
    assert gen_profile.mean_profile(calls) == {"x": 2.0, "y": 1.0}


def test_bench_e2e_sets_the_loops_calls_beside_the_call_alone():
    call = lambda s, x: {"seconds": s, "self_s": {"x": x}, "inclusive_s": {"x": x, "top": s}}  # noqa: E731
    flatrl = {
        "gen_profile": [call(9.0, 5.0), call(6.0, 2.0), call(6.4, 2.4)]
    }  # the first step's call left out
    bare = {"profile_by_run": {"bare_n8": call(5.0, 0.5), "flatrl_n8_call": call(5.0, 1.0),
                               "flatrl_n8_call#2": call(5.2, 1.2)}}  # fmt: skip
    split = bench_e2e.profile_split(flatrl, bare)
    assert split["seconds"] == [6.2, 5.1]
    assert split["gc_s"] == [0.0, 0.0]  # calls recorded before the collector was timed count 0
    assert split["inclusive_s"] == [["top", 6.2, 5.1, 1.1], ["x", 2.2, 1.1, 1.1]]  # a tie: by name
    assert split["self_s"] == [["x", 2.2, 1.1, 1.1]]
    assert (
        bench_e2e.profile_split({"gen_profile": [call(1, 1)]}, bare) is None
    )  # no call after the first step
    assert bench_e2e.profile_split(flatrl, {}) is None


def test_toy_shape_honours_the_flags_given():
    a = bench_e2e.parse(["--model", "toy", "--steps", "8", "--n", "4"])
    assert (a.steps, a.n, a.num_prompts, a.response_len, a.token_budget) == (8, 4, 4, 8, 512)
    a = bench_e2e.parse(["--model", "0.5b"])
    assert (a.steps, a.num_prompts, a.n, a.prompt_len, a.response_len) == (4, 64, 8, 256, 512)
    r = bench_rollout.parse(["--toy", "--response-len", "32"])
    assert (r.response_len, r.prompt_len, r.n, r.max_num_seqs, r.logprob_check_prompts) == (32, 16, 2, 16, 2)
    r = bench_rollout.parse([])
    assert (r.num_prompts, r.n, r.max_num_seqs) == (256, 8, 512)
