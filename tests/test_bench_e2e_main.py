"""bench_e2e.py's driver without a GPU: --out is rewritten after each framework (what has not run marked pending),
when one raises, and when the process is terminated; --skip-flatrl and --flatrl-from spare flatrl's run; the
update's micro-batch follows the shape (65,536 tokens, and 64 TRL sequences, at smollm2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_e2e  # noqa: E402
import e2e_verl  # noqa: E402


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """main() without building a model, checking prompts or timing the host."""
    monkeypatch.setattr(bench_e2e.common, "build_model", lambda shape, path: tmp_path / "model")
    monkeypatch.setattr(bench_e2e, "check_prompts", lambda *a: None)
    monkeypatch.setattr(bench_e2e.common, "hardware", lambda: {"gpu": None})
    monkeypatch.setattr(bench_e2e.signal, "signal", lambda *a: None)  # pytest's own SIGTERM handling stays


FLATRL = {"step_s": 10.0, "first_step_s": 12.0, "peak_device_used_gib": 40.0, "phases_s": {"gen": 6.0}}


def test_what_finished_survives_a_failing_and_a_terminated_framework(tmp_path, monkeypatch, offline):
    out = tmp_path / "e2e.json"
    seen = {}

    def trl_fails(*a):
        seen["during_trl"] = json.loads(out.read_text())  # flatrl's result is on disk before TRL starts
        raise RuntimeError("TRL's worker broke")

    def verl_is_terminated(*a):
        e = bench_e2e.Terminated("SIGTERM")
        e.result = {
            "error": "verl's main_ppo interrupted",
            "stall": {"stacks": "pid 7 [ray::vLLMHttpServer]"},
        }
        raise e

    monkeypatch.setattr(bench_e2e, "run_flatrl", lambda *a: dict(FLATRL))
    monkeypatch.setattr(bench_e2e, "run_trl", trl_fails)
    monkeypatch.setattr(e2e_verl, "run", verl_is_terminated)
    args = bench_e2e.parse(
        ["--model", "0.5b", "--peers", "trl,verl", "--workdir", str(tmp_path), "--out", str(out)]
    )
    with pytest.raises(bench_e2e.Terminated):
        bench_e2e.main(args)
    during = seen["during_trl"]
    assert during["flatrl"]["step_s"] == 10.0 and during["flatrl"]["samples_per_hour"] == 64 * 8 / 10.0 * 3600
    assert "running" in during["trl"] and "pending" in during["verl"]
    r = json.loads(out.read_text())
    assert r["flatrl"]["step_s"] == 10.0
    assert r["trl"]["error"] == "RuntimeError: TRL's worker broke" and "trl_fails" in r["trl"]["traceback"]
    assert r["verl"]["error"] == "interrupted: verl's main_ppo interrupted"
    assert r["verl"]["stall"]["stacks"].startswith("pid 7")  # where verl waited, kept
    assert r["ratios"]["flatrl_vs_trl_step_time"] is None and r["settings"]["token_budget"] == 16384


def test_a_flatrl_only_run_takes_its_peers_from_an_earlier_run(tmp_path, monkeypatch, offline, capsys):
    """--peers-from: the peers this run does not run come from an earlier --out (the defaults part's, on the same
    warm machine), so a lever's flatrl-only run gets its ratios; a peer that runs here is run, not taken."""
    monkeypatch.setattr(bench_e2e, "run_flatrl", lambda *a: dict(FLATRL))
    monkeypatch.setattr(bench_e2e, "run_trl", lambda *a: pytest.fail("TRL must not run"))
    earlier = tmp_path / "defaults.json"
    earlier.write_text(json.dumps({
        "model": "0.5b", "flatrl": {"step_s": 20.0}, "hardware": {"commit": "abc1234"},
        "trl": {"step_s": 32.0, "peak_device_used_gib": 53.0, "samples_per_hour": 57600.0},
        "verl": {"skipped": "not in --peers trl"},
        "settings": {"num_prompts": 64, "n": 8, "prompt_len": 256, "response_len": 512, "token_budget": 16384},
    }))  # fmt: skip
    base = ["--model", "0.5b", "--workdir", str(tmp_path), "--skip-trl"]
    r = bench_e2e.main(bench_e2e.parse([*base, "--peers-from", str(earlier), "--async-steps", "1"]))
    assert r["trl"]["step_s"] == 32.0 and r["trl"]["from_commit"] == "abc1234"
    assert r["ratios"]["flatrl_vs_trl_step_time"] == 10.0 / 32.0
    assert r["ratios"]["flatrl_vs_trl_peak_device_used"] == 40.0 / 53.0
    assert r["verl"]["skipped"] == "not in --peers (none)" and r["settings"]["peers_from"] == [str(earlier)]
    with pytest.raises(SystemExit):  # the file's shape must be this run's
        bench_e2e.parse([*base, "--num-prompts", "32", "--peers-from", str(earlier)])
    assert "ran other settings, (file, this run): {'num_prompts': (64, 32)}" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # every peer runs here: nothing to take
        bench_e2e.parse(["--model", "0.5b", "--peers", "trl,verl", "--peers-from", str(earlier)])
    assert "every peer runs here" in capsys.readouterr().err
    flatrl_only = tmp_path / "flatrl_only.json"
    flatrl_only.write_text(
        json.dumps({"model": "0.5b", "flatrl": {"step_s": 20.0}, "trl": {"error": "broke"}})
    )
    with pytest.raises(SystemExit):  # no peer with a step time in the file
        bench_e2e.parse([*base, "--peers-from", str(flatrl_only)])
    assert "no step_s for trl, verl" in capsys.readouterr().err

    # several files (the flatrl part's, then TRL's, then verl's on one machine): each peer from the first that
    # holds it; a file without any is said, not refused, while another holds one
    settings = {"num_prompts": 64, "n": 8, "prompt_len": 256, "response_len": 512, "token_budget": 16384}
    verl_run = tmp_path / "verl.json"
    verl_run.write_text(json.dumps({
        "model": "0.5b", "hardware": {"commit": "def5678"}, "settings": settings,
        "trl": {"step_s": 99.0}, "verl": {"step_s": 40.0, "peak_device_used_gib": 45.0},
    }))  # fmt: skip
    files = ["--peers-from", str(flatrl_only), "--peers-from", str(earlier), "--peers-from", str(verl_run)]
    r = bench_e2e.main(bench_e2e.parse([*base, *files]))
    assert f"--peers-from {flatrl_only}: no step_s for trl, verl" in capsys.readouterr().err
    assert r["trl"]["step_s"] == 32.0 and r["trl"]["from_file"] == str(earlier)  # the first file's, not 99.0
    assert r["verl"]["step_s"] == 40.0 and r["verl"]["from_commit"] == "def5678"
    assert r["ratios"]["flatrl_vs_verl_step_time"] == 10.0 / 40.0
    assert r["ratios"]["flatrl_vs_lower_peer_peak_device_used"] == 40.0 / 45.0
    with pytest.raises(SystemExit):  # none of the files holds a peer
        bench_e2e.parse([*base, "--peers-from", str(flatrl_only), "--peers-from", str(flatrl_only)])
    assert "none holds a step_s for trl, verl" in capsys.readouterr().err


def test_peers_alone_and_flatrl_from_an_earlier_run(tmp_path, monkeypatch, offline, capsys):
    monkeypatch.setattr(bench_e2e, "run_flatrl", lambda *a: pytest.fail("flatrl must not run"))
    monkeypatch.setattr(bench_e2e, "run_trl", lambda *a: {"step_s": 25.0, "peak_device_used_gib": 50.0})
    base = ["--model", "0.5b", "--workdir", str(tmp_path)]
    r = bench_e2e.main(bench_e2e.parse([*base, "--skip-flatrl", "--out", str(tmp_path / "peers.json")]))
    assert (
        r["flatrl"]["skipped"].startswith("--skip-flatrl") and r["ratios"]["flatrl_vs_trl_step_time"] is None
    )
    assert r["trl"]["step_s"] == 25.0 and r["verl"]["skipped"] == "not in --peers trl"

    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"model": "0.5b", "flatrl": FLATRL, "hardware": {"commit": "d146e60"},
                                   "settings": {"num_prompts": 64, "n": 8, "prompt_len": 256, "response_len": 512,
                                                "token_budget": 16384}}))  # fmt: skip
    r = bench_e2e.main(bench_e2e.parse([*base, "--flatrl-from", str(earlier)]))
    assert r["flatrl"]["from_file"] == str(earlier) and r["flatrl"]["from_commit"] == "d146e60"
    assert r["ratios"]["flatrl_vs_trl_step_time"] == 0.4
    with pytest.raises(SystemExit):
        bench_e2e.parse([*base, "--n", "4", "--flatrl-from", str(earlier)])
    assert "ran other settings, (file, this run): {'n': (8, 4)}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_e2e.parse([*base, "--flatrl-from", str(tmp_path / "none.json")])
    assert "none.json: not a readable JSON file" in capsys.readouterr().err
    # flatrl's own flags where flatrl does not run would do nothing: refused by name
    with pytest.raises(SystemExit):
        bench_e2e.parse([*base, "--skip-flatrl", "--async-steps", "1", "--engine-process"])
    assert (
        "--engine-process, --async-steps: flatrl's settings, and flatrl does not run"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):  # the default (on) is no flag; either form of it is
        bench_e2e.parse([*base, "--skip-flatrl", "--no-gradient-checkpointing"])
    assert "--[no-]gradient-checkpointing: flatrl's settings" in capsys.readouterr().err
    assert bench_e2e.parse([*base, "--skip-flatrl"]).gradient_checkpointing  # no flag: nothing refused
    for flag in (["--checkpoint-layers", "auto"], ["--no-expandable-segments"]):
        with pytest.raises(SystemExit):
            bench_e2e.parse([*base, "--skip-flatrl", *flag])
        assert f"{flag[0]}: flatrl's settings" in capsys.readouterr().err
    assert bench_e2e.parse([*base, "--checkpoint-layers", "12"]).checkpoint_layers == 12
    with pytest.raises(SystemExit):  # partial checkpointing needs checkpointing
        bench_e2e.parse([*base, "--no-gradient-checkpointing", "--checkpoint-layers", "auto"])
    assert "--checkpoint-layers auto needs gradient checkpointing on" in capsys.readouterr().err


def test_micro_batches_follow_the_shape(tmp_path, capsys):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):  # parse() only checks that they are there
        (folder / name).write_text("{}")
    args = bench_e2e.parse(["--model", "smollm2", "--model-path", str(folder)])
    assert args.token_budget == 65536 and args.trl_per_device_batch == 64
    worker = bench_e2e.parse(bench_e2e.worker_argv(args, str(folder), "/d.parquet", "/w", "/w/trl.json"))
    kw = bench_e2e.trl_kwargs(worker)
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"]) == (64, 8)
    kv = dict(o.lstrip("+").split("=", 1) for o in e2e_verl.overrides(args, "/m", "/d", "/run"))
    assert kv["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "65536"
    base = bench_e2e.parse(["--model", "0.5b"])
    assert base.token_budget == 16384 and base.trl_per_device_batch == 16
    assert bench_e2e.parse(["--model", "0.5b", "--token-budget", "32768"]).token_budget == 32768
    with pytest.raises(SystemExit):
        bench_e2e.parse(["--model", "0.5b", "--trl-per-device-batch", "48"])  # 512 sequences are not 48s
    assert "must divide --num-prompts x --n = 512" in capsys.readouterr().err


def test_async_steps_reach_grpo_py_s_config(tmp_path):
    """--async-steps 1 becomes rollout.async_steps in the generated grpo.py YAML, which grpo.py's parser takes."""
    import config
    import grpo

    args = bench_e2e.parse(["--toy", "--async-steps", "1"])
    path = bench_e2e.flatrl_config(
        args, str(tmp_path / "m"), str(tmp_path / "d.parquet"), str(tmp_path / "run")
    )
    cfg = config.parse(grpo.GRPOConfig, ["--config", path])
    assert cfg.rollout.async_steps == 1 and bench_e2e.parse(["--toy"]).async_steps == 0


def test_model_toy_is_the_toy_smoke_run():
    """`--model toy` sets what `--toy` sets (it used to build the toy model at the 256-token prompt shape, which
    its tokenizer cannot encode, and stop there)."""
    toy, named = bench_e2e.parse(["--toy"]), bench_e2e.parse(["--model", "toy"])
    assert named.toy and (named.num_prompts, named.n, named.prompt_len, named.response_len) == (4, 2, 32, 8)
    assert vars(named) == vars(toy)


def test_bare_vllm_runs_after_flatrl_and_gives_the_generation_floor(tmp_path, monkeypatch, offline, capsys):
    """--bare-vllm on: bare vLLM's generation runs after flatrl and before the peers, and its seconds give flatrl's
    generation against it and its share of each step; auto on CPU skips it with the reason; --flatrl-from takes
    the earlier file's figure with flatrl's."""
    order = []
    monkeypatch.setattr(bench_e2e, "run_flatrl", lambda *a: order.append("flatrl") or dict(FLATRL))
    monkeypatch.setattr(bench_e2e, "run_bare", lambda *a: order.append("bare") or {"gen_s": 4.0})
    monkeypatch.setattr(bench_e2e, "run_trl", lambda *a: order.append("trl") or {"step_s": 20.0})
    out = tmp_path / "e2e.json"
    base = ["--model", "0.5b", "--workdir", str(tmp_path)]
    r = bench_e2e.main(bench_e2e.parse([*base, "--bare-vllm", "on", "--out", str(out)]))
    assert order == ["flatrl", "bare", "trl"]
    q = r["ratios"]
    assert q["flatrl_gen_vs_bare_vllm"] == 6.0 / 4.0 and q["bare_vllm_share_of_flatrl_step"] == 4.0 / 10.0
    assert q["bare_vllm_share_of_trl_step"] == 4.0 / 20.0 and q["bare_vllm_share_of_verl_step"] is None
    assert r["targets"]["flatrl_gen_vs_bare_vllm"] == 1.1 and r["settings"]["bare_vllm"] == "on"
    taken = bench_e2e.main(bench_e2e.parse([*base, "--flatrl-from", str(out), "--skip-trl"]))
    # the earlier file's floor, with the host's speed around its run there (run_framework)
    floor, around = taken["bare_vllm"], r["bare_vllm"]["host_loop_s"]
    assert floor.pop("host_loop_s") == around and len(around) == 2
    assert floor == {"gen_s": 4.0, "from_file": str(out)}
    assert taken["ratios"]["bare_vllm_share_of_flatrl_step"] == 0.4 and order.count("bare") == 1
    with pytest.raises(SystemExit):  # asked for where flatrl does not run: refused, not skipped
        bench_e2e.parse([*base, "--skip-flatrl", "--bare-vllm", "on"])
    assert "--bare-vllm on: flatrl's settings, and flatrl does not run" in capsys.readouterr().err


def test_run_bare_asks_bench_rollout_for_this_runs_shape(tmp_path, monkeypatch):
    """run_bare's subprocess: bench_rollout.py's bare_n8 at this run's prompts, n, lengths and vLLM share, the
    seconds of its JSON returned; a failure is an error with its tail; auto without CUDA does not start it."""
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        out = Path(cmd[cmd.index("--out") + 1])
        run = {"seconds": 3.5, "tok_per_s": 74898.3, "tokens": 262144}
        runs = {
            "bare_n8": run,
            "flatrl_n8_call": run | {"seconds": 3.7},
            "flatrl_n8_check2": run | {"seconds": 3.6},
            "bare_n8_lp8": run | {"seconds": 3.8},
            "bare_n8_probe8": run | {"seconds": 3.55},
            "flatrl_n8_woken": run | {"seconds": 4.29},
            "bare_n8#2": run | {"seconds": 4.5, "gpu": {"sm_mhz_mean": 1755.0}},
            "flatrl_n8_call#2": run | {"seconds": 4.1},
        }
        out.write_text(json.dumps({"runs": runs, "engine_start_s": 31.0, "engine": {"x": 1}}))
        return bench_e2e.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench_e2e.subprocess, "run", fake_run)
    args = bench_e2e.parse(["--model", "1.5b", "--num-prompts", "32", "--gpu-memory-utilization", "0.25",
                            "--bare-vllm", "on"])  # fmt: skip
    r = bench_e2e.run_bare(args, "/m/1.5b", str(tmp_path))
    flags = dict(zip(seen["cmd"][2::2], seen["cmd"][3::2], strict=True))
    assert (
        seen["cmd"][1].endswith("bench/bench_rollout.py")
        and flags["--runs"]
        == "bare_n8,flatrl_n8_call,bare_n8_lp8,flatrl_n8_check2,bare_n8_probe8,flatrl_n8_woken,bare_n8#2,"
        "flatrl_n8_call#2"
    )
    assert (flags["--model"], flags["--num-prompts"], flags["--n"]) == ("1.5b", "32", "8")
    assert (flags["--prompt-len"], flags["--response-len"], flags["--gpu-memory-utilization"]) == (
        "256",
        "512",
        "0.25",
    )
    # the floor and flatrl's call alone: each the mean of its two interleaved calls, both kept
    assert "--model-path" not in flags and r["gen_s"] == 4.0 and r["gen_s_each"] == [3.5, 4.5]
    assert r["engine_start_s"] == 31.0 and r["tok_per_s"] == 262144 / 4.0
    assert r["flatrl_generate_s"] == 3.9 and r["flatrl_generate_s_each"] == [3.7, 4.1]
    assert r["flatrl_generate_check2_s"] == 3.6  # the same with the check's logprobs for 2 prompts
    # bare vLLM asking the check's logprobs (8 prompts, the default), and flatrl's call on a woken engine
    assert r["bare_lp_check_s"] == 3.8 and r["flatrl_generate_woken_s"] == 4.29
    assert r["bare_probe_check_s"] == 3.55  # the check's logprobs asked of 8 short extra requests instead
    assert r["gpu_by_run"]["bare_n8#2"] == {"sm_mhz_mean": 1755.0} and r["gpu_by_run"]["bare_n8"] is None
    q = bench_e2e.ratios({"phases_s": {"gen": 4.07}}, {}, {}, r)
    assert round(q["flatrl_generate_alone_vs_bare_vllm"], 6) == round(3.9 / 4.0, 6)
    assert round(q["flatrl_gen_vs_flatrl_generate_alone"], 6) == round(4.07 / 3.9, 6)
    assert round(q["bare_lp_check_vs_bare_vllm"], 6) == round(3.8 / 4.0, 6)
    assert round(q["bare_probe_check_vs_bare_vllm"], 6) == round(3.55 / 4.0, 6)
    assert round(q["flatrl_generate_woken_vs_alone"], 6) == round(4.29 / 3.9, 6)
    monkeypatch.setattr(
        bench_e2e.subprocess,
        "run",
        lambda cmd, **kw: bench_e2e.subprocess.CompletedProcess(cmd, 1, "", "boom"),
    )
    assert bench_e2e.run_bare(args, "/m/1.5b", str(tmp_path)) == {
        "error": "bench_rollout.py exited 1",
        "tail": "boom",
    }
    monkeypatch.setattr(bench_e2e.torch.cuda, "is_available", lambda: False)
    auto = bench_e2e.parse(["--model", "0.5b"])
    assert bench_e2e.run_bare(auto, "/m", str(tmp_path))["skipped"].startswith("no CUDA (--bare-vllm auto)")
