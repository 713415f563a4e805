"""Every bench script runs once at toy size on CPU, as a user runs it (`python bench/x.py --toy --out FILE`), and
prints one JSON line with its figures: the scripts stay runnable between GPU runs. Slow: each starts vLLM.
The benchmark models' tokenizer is checked as AutoTokenizer loads it under this venv's transformers and 5.17 (the
H200's, from a local wheel when there is one)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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
    default_runs = "bare_n1,bare_n8,bare_n8_lp,flatrl_n8_call,flatrl_n8_all"
    more = ",flatrl_n8_check1,bare_n8#2,bare_n8_lp2,flatrl_n8_woken,bare_n8_probe2,flatrl_n8_threadsall"
    more += ",flatrl_n8_onrollouts"
    r = run_bench("bench_rollout.py", tmp_path, work, "--runs", default_runs + more, "--profile-gen")
    runs = r["runs"]
    # --profile-gen: each run's one vLLM call, its sampled seconds mostly inside LLM.generate; the host's loop
    # ms during the run where a sample of common.HostWatch (every 0.5 s) fell in it
    for name, run in runs.items():
        assert run["host"]["loop_ms"] is None or 0 < run["host"]["loop_ms"] < 2000, name
        prof = run["profile"]
        assert prof["seconds"] == pytest.approx(run["seconds"], rel=0.2, abs=0.05), name
        assert prof["inclusive_s"]["vllm/entrypoints/llm.py:generate"] > 0.5 * prof["seconds"], name
    assert set(runs) == {
        "bare_n1",
        "bare_n8",
        "bare_n8_lp",
        "flatrl_n8_call",
        "flatrl_n8_all",
        "flatrl_n8_check1",
        "bare_n8#2",
        "bare_n8_lp2",
        "flatrl_n8_woken",
        "bare_n8_probe2",
        "flatrl_n8_threadsall",
        "flatrl_n8_onrollouts",
    }
    # bare vLLM asking the logprobs of the 2 prompts flatrl's call checks (--toy: 2 of 4), every other prompt none
    assert runs["bare_n8_lp2"]["logprobs"]["prompts"] == 2 and runs["bare_n8_lp"]["logprobs"]["prompts"] == -1
    assert runs["bare_n8_lp2"]["tokens"] == 4 * 2 * 16 and r["ratios"]["bare_n8_lp2_vs_bare_n8"] > 0
    # the CPU engine has no sleep mode: the woken run is flatrl's call, said so
    assert runs["flatrl_n8_woken"]["woken"] is False and runs["flatrl_n8_woken"]["tokens"] == 4 * 2 * 16
    assert runs["flatrl_n8_woken"]["logprobs"] == runs["flatrl_n8_call"]["logprobs"]
    # 2 short extra requests ask the logprobs (--toy's 16 tokens < 32), their tokens not counted
    probe = runs["bare_n8_probe2"]
    assert probe["tokens"] == 4 * 2 * 16 and r["ratios"]["bare_n8_probe2_vs_bare_n8"] > 0
    assert probe["logprobs"] == {"probes": 2, "probe_tokens": 16, "probes_with_logprobs": 2}
    # flatrl's call checks on 2 probes (--toy's 16 tokens < 32), the rollouts without logprobs; as before
    # 2026-12-07, on the 2 checked prompts' 4 rollouts, or with the process's torch threads (the engine's cfg back)
    assert runs["flatrl_n8_call"]["logprobs"] == {
        "logprob_check_prompts": 2, "samples_with_logprobs": 0, "probes": 2, "probe_tokens": 32
    }  # fmt: skip
    before = runs["flatrl_n8_onrollouts"]
    assert before["logprobs"]["samples_with_logprobs"] == 4 and before["logprobs"]["probes"] == 0
    assert before["cfg"] == {"logprob_check_tokens": 0} and before["tokens"] == 4 * 2 * 16
    assert runs["flatrl_n8_threadsall"]["cfg"] == {"generate_threads": 0}
    assert runs["flatrl_n8_threadsall"]["logprobs"] == runs["flatrl_n8_call"]["logprobs"]
    assert r["ratios"]["flatrl_n8_call_vs_flatrl_n8_onrollouts"] > 0
    # `#2`: bare_n8 again, its own call and entry; no device clocks on the CPU
    assert runs["bare_n8#2"]["tokens"] == 4 * 2 * 16 and runs["bare_n8#2"]["logprobs"] is None
    # a ratio takes a run with its repeats: bare_n8's tokens over its two calls' seconds
    both = runs["bare_n8"]["seconds"] + runs["bare_n8#2"]["seconds"]
    call = runs["flatrl_n8_call"]["tokens"] / runs["flatrl_n8_call"]["seconds"]
    assert r["ratios"]["flatrl_n8_call_vs_bare_n8"] == pytest.approx(call / (2 * 4 * 2 * 16 / both))
    assert all(v["gpu"] is None for v in runs.values())
    seconds = [{k: x for k, x in v["host"].items() if k != "loop_ms"} for v in runs.values()]
    assert all(h["cpu_s"] > 0 and min(h.values()) >= 0 for h in seconds)
    # by name: the push check's logprobs for 1 prompt (n=2) instead of --logprob-check-prompts
    assert runs["flatrl_n8_check1"]["logprobs"]["probes"] == 1
    assert runs["bare_n1"]["tokens"] == 4 * 16 and runs["bare_n8"]["tokens"] == 4 * 2 * 16  # ignore_eos
    assert runs["bare_n8_lp"]["tokens"] == runs["flatrl_n8_call"]["tokens"] == 4 * 2 * 16
    assert runs["flatrl_n8_all"]["tokens"] == 4 * 2 * 16
    assert runs["bare_n8"]["logprobs"] is None and runs["bare_n8_lp"]["logprobs"]["logprobs"] == 0
    # --toy checks 2 of the 4 prompts (flatrl_n8_call: on probes, above); flatrl_n8_all on all 8 samples, no probes
    all_ = {"logprob_check_prompts": -1, "samples_with_logprobs": 8, "probes": 0, "probe_tokens": 0}
    assert runs["flatrl_n8_all"]["logprobs"] == all_
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
    r = run_bench(
        "bench_update.py", tmp_path, work, "--modes", "packed,padded,fused,compiled",
        "--gradient-checkpointing", "--checkpoint-layers", "1",
    )  # fmt: skip
    toy = r["sizes"]["toy"]
    assert r["settings"]["checkpoint_layers"] == 1
    for mode in ("packed", "padded", "fused", "compiled"):
        assert toy[mode]["tok_per_s"] > 0 and 0 < toy[mode]["mfu"] < 1 and toy[mode]["tokens"] > 0
    assert toy["packed"]["tokens"] == toy["padded"]["tokens"]  # the same samples, padding not counted
    # actor.update's split (one update timed): the samples' micro-batches, cut in two mini-batches (at most one
    # more), and their seconds
    for mode in ("packed", "padded"):
        parts, whole = toy[mode]["update_parts_s"], toy[mode]["micro_batches"]
        assert whole <= parts["micro_batch_count"] <= whole + 1 and parts["micro_batches_s"] > 0
    assert toy["packed_vs_padded"] > 0 and toy["plan_update_gib"] > 0
    # the fused head (model.use_fused_kernels) runs the packed layout's micro-batches
    assert toy["fused"]["tokens"] == toy["packed"]["tokens"] and toy["fused_vs_packed"] > 0
    assert toy["fused"]["micro_batches"] == toy["packed"]["micro_batches"]
    # model.compile_layers: the same packed micro-batches through the compiled layers
    assert toy["compiled"]["tokens"] == toy["packed"]["tokens"] and toy["compiled_vs_packed"] > 0
    assert toy["compiled"]["micro_batches"] == toy["packed"]["micro_batches"]


@pytest.mark.slow
def test_bench_e2e(tmp_path, work):
    r = run_bench("bench_e2e.py", tmp_path, work)
    f = r["flatrl"]
    assert "error" not in f, f.get("tail")
    assert f["step_s"] > 0 and f["samples_per_hour"] > 0 and len(f["steps_s"]) == 2
    assert f["logprob_diff_mean"] < 1e-3 and f["mfu"] > 0  # grpo.py logs perf/mfu
    # the collector's pauses by phase (perf/gc/*): every phase of the step has one, and none exceeds the step's
    assert {"gen", "sleep", "update", "sync", "step"} <= set(f["gc_s_by_phase"])
    assert max(f["gc_s_by_phase"].values()) == f["gc_s_by_phase"]["step"] and f["gc_full_collections"] >= 0
    # the generation phase in parts (perf/gen_*_s): vLLM's own call is most of it, and no part exceeds it
    parts, gen = f["gen_parts_s"], f["phases_s"]["gen"]
    assert set(parts) == set("wake params engine outputs engine_cpu engine_steal engine_compile".split())
    wall = [parts[k] for k in ("wake", "params", "engine", "outputs")]  # the others are CPU seconds
    assert 0.5 * gen < parts["engine"] <= gen and max(wall) <= gen and parts["engine_cpu"] > 0
    assert len(f["gen_s_each"]) == 1 and f["gen_s_each"][0] == gen  # the steps after the first, each
    each = f["gen_call_each"]  # and vLLM's call in them, with its CPU and steal seconds
    assert each["engine"] == [parts["engine"]] and each["engine_cpu"][0] > 0 and each["engine_steal"][0] >= 0
    # the update in parts (perf/actor_*): its micro-batches and optimizer step inside the phase
    up = f["update_parts_s"]
    assert (
        up["micro_batch_count"] >= 1
        and up["micro_batches_s"] + up["optimizer_step_s"] <= f["phases_s"]["update"]
    )
    # CPU: no CUDA memory per phase; the console's memory lines are a list (vLLM's own where it logs them)
    assert f["outside_torch_by_phase_gib"] == {} and isinstance(f["memory_log"], list)
    assert r["trl"]["skipped"]  # TRL is a GPU-only peer
    # the host's Python speed just before and after flatrl's run, beside the one at the bench's start
    assert len(f["host_loop_s"]) == 2 and all(
        0 < x < 20 * r["hardware"]["host_loop_s"] for x in f["host_loop_s"]
    )


@pytest.mark.slow
def test_bench_e2e_profiles_grpos_generate_calls(tmp_path, work):
    """--profile-gen: grpo.py runs under bench/gen_profile.py, and each step's vLLM call comes back profiled, with
    the garbage collector's pauses."""
    r = run_bench("bench_e2e.py", tmp_path, work, "--profile-gen", "--steps", "3")
    f = r["flatrl"]
    assert "error" not in f, f.get("tail")
    assert r["settings"]["steps"] == 3 and len(f["steps_s"]) == 3
    calls = f["gen_profile"]
    assert [c["call"] for c in calls] == [0, 1, 2]  # one call a step
    for c, engine in zip(calls[1:], f["gen_call_each"]["engine"], strict=True):  # grpo.py's own timing of it
        assert c["seconds"] == pytest.approx(engine, rel=0.25, abs=0.05)
        assert c["inclusive_s"]["vllm/entrypoints/llm.py:generate"] > 0.5 * c["seconds"]
        assert 0 <= c["gc_s"] < c["seconds"]
    assert "gen_profile_loop_vs_alone" not in r  # no bare runs on the CPU


# What grpo.py and TRL see of a benchmark folder: AutoTokenizer.from_pretrained over bench/common.py's config.json
# and tokenizer, in a fresh process (argv: folder; "write" the tokenizer, or not), printed as one JSON line.
TOKENIZER_CHECK = """
import json, sys
sys.path.insert(0, "bench")
import common, transformers
from transformers import AutoTokenizer
folder, mode = sys.argv[1:]
common.model_config("0.5b").save_pretrained(folder)
if mode == "write":
    common.make_tokenizer().save_pretrained(folder)
tok = AutoTokenizer.from_pretrained(folder)
ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ("qwertyzab", "<|im_start|>user\\nhi<|im_end|>")]
sampled = common.random_prompts(1, 64, common.VOCAB)[0] + [common.VOCAB - 1]
print(json.dumps({"version": transformers.__version__, "cls": type(tok).__name__, "len": len(tok), "ids": ids,
                  "decoded": [tok.decode(i) for i in ids], "sampled": len(tok.decode(sampled))}))
"""


def check_tokenizer(folder: Path, mode: str, pythonpath: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    p = subprocess.run([sys.executable, "-c", TOKENIZER_CHECK, str(folder), mode], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def assert_bench_tokenizer(r: dict) -> None:
    # A letter is one id, its rank in the sorted byte-level alphabet: "!" (33) is 0, so "a" is 97 - 33 = 64.
    assert r["cls"] == "Qwen2Tokenizer" and r["len"] == 151936, r
    assert r["ids"][0] == [ord(c) - 33 for c in "qwertyzab"], r
    assert r["ids"][1] == [151644] + [ord(c) - 33 for c in "user"] + [198, 71, 72, 151645], r  # "\n" is 198
    assert r["decoded"] == ["qwertyzab", "<|im_start|>user\nhi<|im_end|>"]
    assert r["sampled"] > 64  # every id the model can sample decodes to text


def test_probe_memory_marks_each_piece_of_the_set_up(tmp_path, work):
    """The probe's marks come in the set-up's order, and the process groups it counts are the ones it made: the
    trainer's default group, then a second one (vLLM's groups add to this count on a GPU); without a process
    group none. On CPU the memory figures are absent rather than zero."""
    r = run_bench("probe_memory.py", tmp_path, work)
    groups = {m["mark"]: m["process_groups"] for m in r["marks"]}
    assert list(groups) == [
        "cuda context", "process group", "first all_reduce", "second group", "bf16 matmul",
        "engine started", "generated", "engine asleep", "engine awake",
    ]  # fmt: skip
    assert groups["cuda context"] == 0 and groups["process group"] == 1 and groups["second group"] == 2
    assert groups["engine awake"] == 2 and not any("device_used_gib" in m for m in r["marks"])
    assert r["settings"]["backend"] == "gloo"  # on CPU; and at one rank on a GPU (fsdp.backend_for)
    # bound to the device: the same groups (on CUDA each NCCL communicator then starts at once)
    bound = run_bench("probe_memory.py", tmp_path, work, "--bind-device")
    assert [(m["mark"], m["process_groups"]) for m in bound["marks"]] == list(groups.items())
    alone = run_bench("probe_memory.py", tmp_path, work, "--no-process-group")
    assert alone["settings"]["backend"] is None
    assert [m["mark"] for m in alone["marks"]][:2] == ["cuda context", "bf16 matmul"]
    assert all(m["process_groups"] == 0 for m in alone["marks"])


def test_bench_tokenizer(tmp_path):
    assert_bench_tokenizer(check_tokenizer(tmp_path / "m", "write"))


def test_folder_without_tokenizer_encodes_to_nothing(tmp_path, monkeypatch):
    # The H200's e2e failure: config.json without the tokenizer gives a one-id Qwen2Tokenizer that drops every
    # character; build_model no longer reuses such a folder, and bench_e2e.check_prompts stops on it.
    r = check_tokenizer(tmp_path / "m", "config-only")
    assert r["cls"] == "Qwen2Tokenizer" and r["len"] == 1 and r["ids"] == [[], []]
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_e2e

    data = bench_e2e.write_prompts(tmp_path / "prompts.parquet", rows=3, length=16)
    with pytest.raises(SystemExit, match=r"Qwen2Tokenizer of 1 ids encodes .* to \[0\] tokens"):
        bench_e2e.check_prompts(str(tmp_path / "m"), str(data), 16)


def test_trl_timings_are_kept_per_step_and_block(monkeypatch):
    """bench_e2e's TRL worker keeps the seconds of the blocks TRL times itself (ProfilingContext._log_metrics,
    TRL 1.16's interface, stood in by a module here): summed per step, median over the steps after the first."""
    import types

    logged = []

    class ProfilingContext:  # TRL's: name "<Trainer>.<block>", the trainer's global step, then _log_metrics
        def __init__(self, name, step):
            self.name, self.step = name, step

        def _log_metrics(self, duration):
            logged.append(duration)

    fake = types.ModuleType("trl.extras.profiling")
    fake.ProfilingContext = ProfilingContext
    monkeypatch.setitem(sys.modules, "trl.extras.profiling", fake)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_e2e

    timings = bench_e2e.keep_trl_timings()
    for step, name, seconds in [
        (0, "vLLM.generate", 9.0),
        (1, "vLLM.generate", 4.0),
        (2, "vLLM.generate", 6.0),
        (1, "sync_weights", 0.5),
        (1, "sync_weights", 0.25),
        (2, "trl_reward", 0.1),
    ]:
        ProfilingContext(f"GRPOTrainer.{name}", step)._log_metrics(seconds)  # fmt: skip
    assert len(logged) == 6  # TRL's own logging still runs
    assert bench_e2e.phase_medians(timings) == {"vLLM.generate": 5.0, "sync_weights": 0.75, "trl_reward": 0.1}


@pytest.fixture(scope="module")
def transformers_517(tmp_path_factory) -> str:
    """transformers 5.17 (the H200's) and a huggingface_hub it accepts, installed from local wheels into a folder."""
    wheels = [
        sorted(Path("/opt/pypi/files").glob(g))
        for g in ("transformers-5.17.0-*.whl", "huggingface_hub-1.*.whl")
    ]
    if not all(wheels):
        pytest.skip("no transformers 5.17 / huggingface_hub 1.x wheel under /opt/pypi/files")
    target = tmp_path_factory.mktemp("tf517")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target)]
    p = subprocess.run([*cmd, wheels[0][-1], wheels[1][-1]], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return str(target)


@pytest.mark.slow  # installs a wheel, three processes
def test_bench_tokenizer_transformers_517(tmp_path, transformers_517):
    # Written and read under 5.17, and written under 5.17 but read under this venv's version.
    r = check_tokenizer(tmp_path / "m", "write", pythonpath=transformers_517)
    assert r["version"] == "5.17.0"
    assert_bench_tokenizer(r)
    assert_bench_tokenizer(check_tokenizer(tmp_path / "m", "read"))
    r = check_tokenizer(tmp_path / "bare", "config-only", pythonpath=transformers_517)
    assert (
        r["version"] == "5.17.0" and r["len"] == 1 and r["ids"] == [[], []]
    )  # the failure is not 5.19's alone


def test_e2e_table_ratios_match_the_bench(monkeypatch):
    """bench/e2e_table.py's rows from a stored H200 run: its step and memory ratios are the ones bench_e2e wrote."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e_table

    path = ROOT / "bench" / "results" / "e2e_0.5b_defaults_f7812f0.json"
    d = json.loads(path.read_text())
    rows = {r[1]: r for r in e2e_table.rows(str(path))}
    assert set(rows) == {"flatrl", "trl"}
    step, memory = rows["trl"][-1].split(", ")
    assert float(step.split()[1]) == pytest.approx(d["ratios"]["flatrl_vs_trl_step_time"], abs=1e-3)
    assert float(memory.split()[1]) == pytest.approx(d["ratios"]["flatrl_vs_trl_peak_device_used"], abs=1e-3)
    assert float(rows["flatrl"][2]) == pytest.approx(d["flatrl"]["step_s"], abs=0.01)
    assert "| trl |" in e2e_table.table([str(path)])


def test_e2e_table_sets_each_vllm_call_beside_the_hosts_speed(monkeypatch, tmp_path):
    """memory_notes: each step's vLLM call (gen_call_each) beside the host's loop ms and the device's busy % in
    that step's generation, '-' where no sample fell in it or the file lacks it; without both, no such line."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e_table

    path = tmp_path / "e2e.json"
    flatrl = {"gen_parts_s": {"engine": 5.0}, "gen_call_each": {"engine": [5.42, 6.71]}}
    more = {"host_loop_ms_gen_each": [7.7, None], "gpu_busy_pct_gen_each": [61.25, 48.0]}
    path.write_text(json.dumps({"flatrl": flatrl | more}))
    notes = e2e_table.memory_notes([str(path)])
    assert "device's busy share meanwhile: 5.42 s / 7.7 ms / 61.2 %, 6.71 s / - / 48.0 %" in notes
    path.write_text(json.dumps({"flatrl": flatrl | {"host_loop_ms_gen_each": [7.7, 8.0]}}))  # no busy share
    assert "5.42 s / 7.7 ms / -, 6.71 s / 8.0 ms / -" in e2e_table.memory_notes([str(path)])
    path.write_text(json.dumps({"flatrl": flatrl}))
    assert "host's loop" not in e2e_table.memory_notes([str(path)])
    assert "largest device-used sample" not in e2e_table.memory_notes([str(path)])
    where = {"gib": 41.834, "step": 2, "s_into_step": 15.2, "phase": "untimed", "after": "sync"}
    path.write_text(json.dumps({"flatrl": flatrl | {"peak_device_used_where": where}}))
    assert (
        "the steps' largest device-used sample: 41.83 GiB in step 2, 15.20 s in, phase untimed (after sync)"
        in e2e_table.memory_notes([str(path)])
    )


def test_bench_rollout_refuses_an_unknown_run_before_the_engine(monkeypatch, capsys):
    """--runs is checked at parse time (an engine start costs minutes): a misspelt run, a count of 0 or none where
    one is needed, each named in one line with the allowed forms; the documented ones parse."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_rollout

    good = "bare_n1,bare_n8_lp,bare_n8_lp8#2,bare_n8_probe8,flatrl_n8_check2#3,flatrl_n8_woken,flatrl_n8_threadsall"
    assert bench_rollout.parse(["--runs", good]).runs == good
    for bad in ("bare_n8_lp0", "bare_n8_probe", "flatrl_n8_wokn", "bare_n8#"):
        with pytest.raises(SystemExit):
            bench_rollout.parse(["--runs", f"bare_n8,{bad}"])
        err = capsys.readouterr().err
        assert f"--runs: unknown run(s) ['{bad}']" in err and "bare_n8_probeK" in err


def test_e2e_table_shows_the_exposed_generation_of_an_async_run(monkeypatch):
    """An async run (001eeb6, H200) times `gen` at ~0 s in the step and the wait for the background generation as
    `gen_wait`: the table's generation column is their sum, and the rest is the step less it."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e_table

    path = ROOT / "bench" / "results" / "e2e_0.5b_async012_001eeb6.json"
    phases = json.loads(path.read_text())["flatrl"]["phases_s"]
    (row,) = e2e_table.rows(str(path))
    assert float(row[5]) == pytest.approx(phases["gen"] + phases["gen_wait"], abs=0.01)
    assert float(row[5]) > 1.9  # 1.97 s of waiting; `gen` alone is 4e-5 s
    assert float(row[6]) == pytest.approx(phases["step"] - phases["gen"] - phases["gen_wait"], abs=0.01)


def test_e2e_table_has_bare_vllms_generation_and_its_shares(monkeypatch, tmp_path):
    """A file with bare vLLM's generation (bench_e2e.py --bare-vllm): a last row with its seconds, flatrl's
    generation against it and its share of each step, from the file's ratios."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_e2e
    import e2e_table

    d = json.loads((ROOT / "bench" / "results" / "e2e_defaults_0.5b_h100_1a4c362.json").read_text())
    d["bare_vllm"] = {"gen_s": 7.0}
    d["ratios"] = bench_e2e.ratios(d["flatrl"], d["trl"], d["verl"], d["bare_vllm"])
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(d))
    row = e2e_table.rows(str(path))[-1]
    assert row[1] == "bare vLLM, generation only" and row[5] == "7.00"
    gen, flatrl, trl = row[-1].split("; ")
    assert gen == f"flatrl's generation {8.1511 / 7.0:.3f}x"
    assert (
        flatrl == f"{7.0 / d['flatrl']['step_s']:.3f} of flatrl's step"
        and trl == f"{7.0 / 34.7017:.3f} of TRL's step"
    )
    d["bare_vllm"]["flatrl_generate_s"] = 7.5  # since flatrl_n8_call joined the bare run
    path.write_text(json.dumps(d))
    assert e2e_table.rows(str(path))[-1][-1].split("; ")[1] == "flatrl's engine.generate alone 7.50 s"
    d["bare_vllm"]["flatrl_generate_check2_s"] = 7.25
    path.write_text(json.dumps(d))
    alone = e2e_table.rows(str(path))[-1][-1].split("; ")[1]
    assert alone == "flatrl's engine.generate alone 7.50 s (7.25 s checking 2 prompts)"
    d["bare_vllm"] |= {"flatrl_generate_woken_s": 7.9, "bare_lp_check_s": 7.1, "bare_probe_check_s": 7.05}
    path.write_text(json.dumps(d))  # since 6e02cb0's 135M run
    alone = e2e_table.rows(str(path))[-1][-1].split("; ")[1]
    assert alone.endswith(
        "(7.25 s checking 2 prompts), 7.90 s on a woken engine, bare vLLM asking the check's logprobs 7.10 s, "
        "with the check on short probes 7.05 s"
    )
    d["bare_vllm"]["gen_s_each"] = [6.5, 7.5]  # the interleaved bare calls, since 01e8306's drift
    path.write_text(json.dumps(d))
    assert e2e_table.rows(str(path))[-1][-1].split("; ")[1] == "bare calls 6.50 / 7.50 s (first / last)"


def test_e2e_table_notes_the_memory_outside_torch(monkeypatch, tmp_path):
    """Below the table: each file's flatrl memory outside torch's allocator by phase and its memory lines, its
    generation and update phases in parts; a file from before they were kept gives nothing."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e_table

    old = ROOT / "bench" / "results" / "e2e_smollm2_h100_f8597ea.json"
    assert e2e_table.memory_notes([str(old)]) == ""
    d = json.loads(old.read_text())
    d["flatrl"]["outside_torch_by_phase_gib"] = {"gen": 4.29, "sleep": -19.62}
    d["flatrl"]["memory_log"] = ["memory at engine started: device used 29.14 GiB, torch reserved 24.80"]
    d["flatrl"]["gen_parts_s"] = {"wake": 0.0, "params": 0.001, "engine": 5.12, "outputs": 0.04}
    d["flatrl"]["update_parts_s"] = {
        "micro_batches_s": 9.6,
        "optimizer_step_s": 0.81,
        "micro_batch_count": 24.0,
    }
    path = tmp_path / "e2e_new.json"
    path.write_text(json.dumps(d))
    notes = e2e_table.memory_notes([str(old), str(path)]).splitlines()
    assert notes == [
        "e2e_new, flatrl:",
        "  generation phase 4.04 s, its generate() calls in parts (s): wake 0.00, params 0.00, engine 5.12, "
        "outputs 0.04",
        f"  update phase {d['flatrl']['phases_s']['update']:.2f} s: 24 micro-batches 9.60 s (0.400 s each), "
        "optimizer step 0.81 s",
        "  outside torch's allocator at each phase's end (GiB): gen 4.29, sleep -19.62",
        "  memory at engine started: device used 29.14 GiB, torch reserved 24.80",
    ]


def test_run_h200_job_outlives_its_call(tmp_path):
    """bench/run_h200.sh's long parts run their bench as a job in its own process session: a call that ends first
    says so and keeps what the bench wrote so far, no other part starts beside it, and the part `wait` in the next
    call follows it to its end and keeps its JSON for later parts. bench_e2e.py is a stub here that writes its JSON
    twice, 5 s apart."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text(
        "#!/usr/bin/env bash\n"
        '[ "$1" = bench/bench_e2e.py ] || exit 0  # the imports, pip: nothing to do here\n'
        'while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
        'echo \'{"flatrl": {"running": "since now"}}\' > "$out"; sleep 5\n'
        'echo \'{"flatrl": {"step_s": 1.5}}\' > "$out"\n'
    )
    (stub / "python3").chmod(0o755)
    work, env = tmp_path / "work", dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", POLL_S="1")

    def part(name: str, out: Path, wait_s: int) -> subprocess.CompletedProcess:
        e = env | {"WORK": str(work), "OUT": str(out), "WAIT_S": str(wait_s), "FLATRL_COMMIT": "test"}
        cmd = ["bash", str(ROOT / "bench" / "run_h200.sh"), name]
        return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=60)

    first = part("defaults", tmp_path / "out1", 1)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "e2e-defaults-0.5b still running after this call's 1 s: send the part wait now" in first.stdout
    assert json.loads((tmp_path / "out1" / "e2e_defaults_0.5b.json").read_text())["flatrl"] == {
        "running": "since now"
    }
    assert not (work / "json").exists()  # not for other parts' ratios until it ends well

    beside = part("gpu-tests", tmp_path / "out2", 1)
    assert beside.returncode == 2 and "e2e-defaults-0.5b is still running on this GPU" in beside.stdout

    last = part("wait", tmp_path / "out3", 30)
    assert last.returncode == 0 and "== e2e-defaults-0.5b exited 0" in last.stdout, last.stdout
    for kept in (tmp_path / "out3", work / "json"):
        assert json.loads((kept / "e2e_defaults_0.5b.json").read_text())["flatrl"] == {"step_s": 1.5}
    # nothing running: it reports the last one again
    assert part("wait", tmp_path / "out4", 30).returncode == 0

    # a job killed before it could write its exit status: `wait` says so at once instead of waiting out WAIT_S
    assert part("flatrl", tmp_path / "out5", 1).returncode == 0
    pid = int((work / "jobs" / "e2e-flatrl-0.5b" / "pid").read_text())
    os.killpg(pid, signal.SIGKILL)  # setsid made the job's shell the leader of its own process group
    t0 = time.monotonic()
    gone = part("wait", tmp_path / "out6", 30)
    assert "e2e-flatrl-0.5b ended without an exit status" in gone.stdout and time.monotonic() - t0 < 15


def bench_e2e_stub(tmp_path: Path, out_json: str) -> dict[str, str]:
    """The environment of a run_h200.sh call whose python3 is a stub: bench_e2e.py's arguments are appended to
    tmp_path/calls and its --out gets `out_json`; any other python3 command does nothing."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text(
        "#!/usr/bin/env bash\n"
        '[ "$1" = bench/bench_e2e.py ] || exit 0\n'
        f'echo "$*" >> {tmp_path}/calls\n'
        'while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
        f'mkdir -p "$(dirname "$out")"; echo \'{out_json}\' > "$out"\n'
    )
    (stub / "python3").chmod(0o755)
    return dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", POLL_S="1")


def test_run_h200_parts_take_the_peers_from_every_part_before_them(tmp_path):
    """The flatrl-only parts pass bench_e2e one --peers-from for each earlier part's JSON on this machine (the
    flatrl part's, TRL's, verl's), and the trl part runs TRL alone against the flatrl part's figures, refusing
    to start without them. bench_e2e.py is a stub that logs its arguments and writes its --out."""
    work = tmp_path / "work"
    env = bench_e2e_stub(tmp_path, '{"trl": {"step_s": 2.0}}') | {"WORK": str(work), "FLATRL_COMMIT": "test"}

    def part(name: str, **extra: str) -> subprocess.CompletedProcess:
        e = env | {"OUT": str(tmp_path / f"out_{name}"), "WAIT_S": "30"} | extra
        cmd = ["bash", str(ROOT / "bench" / "run_h200.sh"), name]
        return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=60)

    refused = part("trl", MODEL="1.5b")
    assert refused.returncode == 2 and "e2e_defaults_1.5b.json is missing" in refused.stdout
    assert part("flatrl", MODEL="1.5b").returncode == 0
    assert part("trl", MODEL="1.5b").returncode == 0
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "--peers trl --flatrl-from " + str(work / "json" / "e2e_defaults_1.5b.json") in calls[-1]
    (work / "json" / "e2e_verl_1.5b.json").write_text("{}")
    assert part("fast", MODEL="1.5b", EAGER="0").returncode == 0
    last = (tmp_path / "calls").read_text().splitlines()[-1]
    assert last.count("--peers-from") == 3
    for name in ("e2e_defaults_1.5b.json", "e2e_trl_1.5b.json", "e2e_verl_1.5b.json"):
        assert f"--peers-from {work / 'json' / name}" in last


def test_run_h200_tokens_part_runs_both_and_keeps_the_defaults_for_trl(tmp_path):
    """The tokens part: flatrl's defaults, then one run per TOKENS entry BUDGET[:LAYERS] (4096:auto when unset),
    none with bare vLLM; the defaults' JSON (from a run that exited 0) becomes the flatrl figures of the trl part that
    follows; DEFAULTS=0 runs the entries alone."""
    work = tmp_path / "work"
    env = bench_e2e_stub(tmp_path, '{"flatrl": {"step_s": 1.0}}')
    env |= {"WORK": str(work), "FLATRL_COMMIT": "test", "MODEL": "1.5b", "WAIT_S": "30"}
    cmd = ["bash", str(ROOT / "bench" / "run_h200.sh")]
    out = tmp_path / "out"
    p = subprocess.run(
        [*cmd, "tokens"], cwd=ROOT, env=env | {"OUT": str(out)}, capture_output=True, text=True
    )
    assert p.returncode == 0 and "FAILED" not in p.stdout, p.stdout + p.stderr
    defaults, tokens = (tmp_path / "calls").read_text().splitlines()
    assert (
        "--bare-vllm off" in defaults
        and "--token-budget" not in defaults
        and "--checkpoint-layers" not in defaults
    )
    assert "--bare-vllm off" in tokens and "--token-budget 4096 --checkpoint-layers auto" in tokens
    assert (out / "e2e_tokens_4096_auto_1.5b.json").exists()
    kept = work / "json" / "e2e_defaults_1.5b.json"
    assert kept.read_bytes() == (out / "e2e_tokens_defaults_1.5b.json").read_bytes()
    p = subprocess.run(
        [*cmd, "trl"], cwd=ROOT, env=env | {"OUT": str(tmp_path / "o2")}, capture_output=True, text=True
    )
    assert p.returncode == 0 and f"--flatrl-from {kept}" in (tmp_path / "calls").read_text().splitlines()[-1]
    (tmp_path / "calls").unlink()
    extra = {"OUT": str(tmp_path / "o3"), "DEFAULTS": "0", "TOKENS": "8192:0 16384:14 2048"}
    p = subprocess.run([*cmd, "tokens"], cwd=ROOT, env=env | extra, capture_output=True, text=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert p.returncode == 0 and len(calls) == 3, p.stdout + p.stderr
    for call, args in zip(calls, ("8192 --checkpoint-layers 0", "16384 --checkpoint-layers 14",
                                  "2048 --checkpoint-layers auto"), strict=True):  # fmt: skip
        assert f"--token-budget {args} " in call
    assert (tmp_path / "o3" / "e2e_tokens_16384_14_1.5b.json").exists()


def test_run_h200_usage_names_every_part(tmp_path):
    """An unknown part prints the usage line and exits 2; that line names each part the script dispatches on."""
    script = (ROOT / "bench" / "run_h200.sh").read_text()
    parts = set(re.findall(r'\[ "\$part" = ([\w.-]+) \]', script))
    env = bench_e2e_stub(tmp_path, "{}") | {"OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work")}
    cmd = ["bash", str(ROOT / "bench" / "run_h200.sh"), "nope"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    usage = next(line for line in p.stdout.splitlines() if line.startswith("usage:"))
    assert p.returncode == 2 and len(parts) > 20
    assert parts <= set(usage.split()[-1].split("|")), sorted(parts - set(usage.split()[-1].split("|")))
