"""rollout.async_steps=1 (one-step off-policy rollouts) in grpo.py, on the toy with the hf engine, one rank."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import toy_grpo_config

import grpo
import rl
import rollout

torch.set_num_threads(1)
GENERATE = rl.generate  # the unpatched function: each run wraps this one, not the last run's wrapper


def _run(toy_dir, run_dir, monkeypatch, *, async_steps: int, lr: float, steps: int = 3, **trainer_kw) -> dict:
    """grpo.main on the toy (hf engine, 4 prompts x 2, 8 tokens); returns {"responses": {step: [ids...]}
    (every rollout batch generated, by the step it trains), "rows": metrics.jsonl's lines}."""
    responses: dict[int, list[list[int]]] = {}

    def recording(run, engine, prompts, mine, step, **kw):
        samples, mine_prompts = GENERATE(run, engine, prompts, mine, step, **kw)
        responses[step] = [s.response_ids for s in samples]
        return samples, mine_prompts

    monkeypatch.setattr(rl, "generate", recording)
    fn = (
        run_dir.parent / "length_reward.py"
    )  # varies within a group, so the advantages (and updates) are not 0
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return float(len(solution_str) % 3)\n")  # fmt: skip
    cfg = toy_grpo_config(
        toy_dir, run_dir, fn, steps=steps, lr=lr, rollout_kw={"async_steps": async_steps}, **trainer_kw
    )
    grpo.main(cfg)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return {"responses": responses, "rows": [r for r in rows if "timing_s/step" in r]}


def test_async_rollouts_come_from_the_weights_one_update_old(one_rank, toy_dir, tmp_path, monkeypatch):
    """Step 2's rollouts of an async run are token for token those of a run whose weights never move (lr 0: every
    batch from the initial weights), while a synchronous run's step 2 differs from both (it samples from the
    updated weights); step 1 is the same in all three. Steps 2-3 log staleness 1 and the one-update policy
    difference, and their push check from a short response generated with their own weights."""
    frozen = _run(toy_dir, tmp_path / "frozen", monkeypatch, async_steps=0, lr=1e-12)
    sync = _run(toy_dir, tmp_path / "sync", monkeypatch, async_steps=0, lr=5e-2)
    ahead = _run(toy_dir, tmp_path / "async", monkeypatch, async_steps=1, lr=5e-2)
    assert ahead["responses"][0] == sync["responses"][0] == frozen["responses"][0]
    assert ahead["responses"][1] == frozen["responses"][1]
    assert sync["responses"][1] != frozen["responses"][1]  # the sync run's step 2 sampled from new weights
    assert ahead["responses"][2] != frozen["responses"][2]  # step 3 from the weights after one update
    staleness = [r["rollout/staleness"] for r in ahead["rows"]]
    assert staleness == [0.0, 1.0, 1.0]
    assert "rollout/logprob_diff_mean" in ahead["rows"][0]  # the push check, on the fresh first batch
    assert ahead["rows"][0]["rollout/logprob_diff_mean"] < 1e-4
    for r in ahead["rows"][1:]:
        assert r["rollout/offpolicy_diff_mean"] > 1e-4 and "timing_s/push_check" in r
        assert r["rollout/logprob_diff_mean"] < 1e-4  # the probe: the engine runs the pushed weights
    assert "perf/gen_ahead_s" in ahead["rows"][0] and "perf/gen_ahead_s" not in ahead["rows"][-1]
    rewards = lambda run: [r["reward/mean"] for r in run["rows"]]  # noqa: E731
    assert rewards(ahead)[:2] == rewards(frozen)[:2]


def test_async_push_check_catches_an_engine_that_kept_old_weights(one_rank, toy_dir, tmp_path, monkeypatch):
    """With every push after the first dropped, an async run fails at step 2, the first stale batch: its probe's
    response comes from the initial weights, which the trainer left at step 1 (a synchronous run's check would
    catch it too; before the probe an async run trained on to the end)."""
    import hf_rollout

    pushes = []
    real_push = hf_rollout.HFEngine.push_weights

    def first_only(self, named_params):
        pushes.append(1)
        if len(pushes) == 1:
            real_push(self, named_params)
        else:
            for _ in named_params:  # gathered and dropped
                pass

    monkeypatch.setattr(hf_rollout.HFEngine, "push_weights", first_only)
    with pytest.raises(RuntimeError, match="step 2: vLLM's logprobs differ from the trainer's"):
        _run(toy_dir, tmp_path / "broken", monkeypatch, async_steps=1, lr=5e-2)
    assert len(pushes) == 2  # the first push, then step 1's (dropped); step 2's probe saw it


def test_checkpointed_backward_leaves_the_global_generator_alone(tiny_qwen2, tmp_path, monkeypatch):
    """Under gradient checkpointing (the default) a backward of a model without dropout never sets torch's global
    generator. It did (the recompute's stash and restore), while an async rollout sampled from it in another
    thread: that run's step-2 responses then differed from the frozen run's in 2 of 8 runs of the test above on a
    busy CPU, and in 0 of 12 after. A model with dropout still stashes it, so its recompute draws the same masks."""
    import fsdp

    dropped = tmp_path / "dropout"  # the same model with attention dropout in its config
    dropped.mkdir()
    for f in tiny_qwen2.iterdir():
        (dropped / f.name).write_bytes(f.read_bytes())
    config = json.loads((dropped / "config.json").read_text())
    (dropped / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.1}))
    sets = []
    real = torch.set_rng_state
    monkeypatch.setattr(torch, "set_rng_state", lambda state: sets.append(1) or real(state))
    for path, stashes in ((tiny_qwen2, False), (dropped, True)):
        model = fsdp.load_model(str(path), gradient_checkpointing=True)
        assert fsdp.has_dropout(model) is stashes
        model.train()
        sets.clear()
        ids = torch.arange(8).view(1, 8)
        model(input_ids=ids, labels=ids).loss.backward()
        assert bool(sets) is stashes, (path.name, len(sets))


def test_async_checkpoint_keeps_the_batch_drawn_ahead(one_rank, toy_dir, tmp_path, monkeypatch):
    """A checkpoint after step 2 of an async run records the data position after step 2's batch, not after the
    batch drawn ahead for step 3, so resuming from it trains step 3 on the same prompts as an uninterrupted run."""
    _run(toy_dir, tmp_path / "async", monkeypatch, async_steps=1, lr=5e-2, save_freq=2)
    _run(toy_dir, tmp_path / "sync", monkeypatch, async_steps=0, lr=5e-2, save_freq=2)
    state = lambda d: json.loads(  # noqa: E731
        next((d / "global_step_2").glob("**/trainer_state.json")).read_text()
    )
    assert (
        state(tmp_path / "async")["sampler"]
        == state(tmp_path / "sync")["sampler"]
        == {"epoch": 0, "batch": 2}
    )


def test_async_is_refused_where_it_does_not_apply(one_rank, toy_dir, tmp_path):
    """ppo.py refuses rollout.async_steps=1 by name."""
    import ppo

    cfg = ppo.PPOConfig(rollout=rollout.RolloutConfig(name="hf", async_steps=1))
    with pytest.raises(SystemExit, match="rollout.async_steps=1"):
        ppo.main(cfg)


@pytest.mark.slow
def test_async_on_two_ranks(toy_dir, tmp_path):
    """grpo.py on 2 gloo ranks with rollout.async_steps=1 (hf engine, each rank generating ahead in its own
    thread beside the other rank's collectives): every step trains (weights move), steps 2-3 are one update old,
    and the run ends with a complete checkpoint."""
    from conftest import read_metrics, torchrun
    from test_multinode import grpo_args

    import checkpoint

    args = grpo_args(toy_dir, tmp_path, **{"rollout.name": "hf", "rollout.async_steps": 1})
    args += ["--trainer.total_training_steps", "3"]
    torchrun("grpo.py", args, nproc=2)
    rows = read_metrics(tmp_path / "run")
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[0]["rollout/logprob_diff_max"] < 1e-3 and all(r["actor/grad_norm"] > 0 for r in rows)
    assert all(r["rollout/offpolicy_diff_mean"] > 0 for r in rows[1:])
    assert checkpoint.checkpoint_problem(tmp_path / "run" / "global_step_3") is None
