"""ppo.py's math: GAE against plain loops (verl's formula included), the KL controllers by hand."""

from __future__ import annotations

import random

import pytest
import torch

import losses
import ppo
import rl

torch.set_num_threads(1)


def gae_loop(rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float):
    """One sequence, plain Python: GAE over the positions with mask 1 only, in order, then returns."""
    kept = [t for t, m in enumerate(mask) if m]
    adv = {}
    next_value, next_adv = 0.0, 0.0
    for t in reversed(kept):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        next_value = values[t]
        adv[t] = next_adv
    return adv, {t: adv[t] + values[t] for t in kept}


def verl_gae_loop(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """verl's original compute_gae_advantage_return (no mask in the recursion), written out per element."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        last = 0.0
        for t in reversed(range(T)):
            next_value = values[b, t + 1].item() if t < T - 1 else 0.0
            last = rewards[b, t].item() + gamma * next_value - values[b, t].item() + gamma * lam * last
            adv[b, t] = last
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_a_plain_loop_with_holes_and_padding(gamma, lam):
    rng = random.Random(0)
    B, T = 6, 9
    rewards = torch.randn(B, T, dtype=torch.float64)
    values = torch.randn(B, T, dtype=torch.float64)
    mask = torch.ones(B, T)
    mask[0, 6:] = 0  # padding at the end
    mask[1, 2:4] = 0  # a hole in the middle (e.g. tool output inside a multi-turn response)
    mask[2, [1, 5, 8]] = 0  # holes and the last position
    mask[3, :] = 0  # nothing at all
    mask[4, 0] = 0  # starts late
    for b in range(B):  # padded positions carry junk that must not leak in
        for t in range(T):
            if not mask[b, t]:
                rewards[b, t], values[b, t] = rng.uniform(-50, 50), rng.uniform(-50, 50)
    adv, ret = ppo.gae_unwhitened(rewards, values, mask, gamma, lam)
    for b in range(B):
        want_adv, want_ret = gae_loop(rewards[b].tolist(), values[b].tolist(), mask[b].tolist(), gamma, lam)
        for t, a in want_adv.items():
            assert abs(adv[b, t].item() - a) < 1e-9, (b, t)
            assert abs(ret[b, t].item() - want_ret[t]) < 1e-9, (b, t)
    # whitened: zero mean, unit (unbiased) variance over the masked tokens
    w, _ = ppo.gae(rewards, values, mask, gamma, lam)
    assert abs(losses.masked_mean(w, mask).item()) < 1e-9
    assert abs(losses.masked_var(w, mask).item() - 1.0) < 1e-6


def test_gae_equals_verls_formula_on_end_padded_batches():
    """With padding only at the end, values zeroed there (as verl's critic output is masked) and rewards 0
    there, the skip-holes recursion and verl's original one agree to 1e-6, whitening included."""
    torch.manual_seed(1)
    B, T = 5, 12
    lengths = [12, 7, 1, 9, 3]
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).double()
    values = torch.randn(B, T, dtype=torch.float64) * mask
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), torch.tensor(lengths) - 1] = torch.randn(B, dtype=torch.float64)
    rewards -= 0.01 * torch.rand(B, T, dtype=torch.float64) * mask  # a KL penalty on every token
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95)]:
        adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
        ref = verl_gae_loop(rewards, values, gamma, lam)
        torch.testing.assert_close(ret * mask, (ref + values) * mask, atol=1e-6, rtol=0)
        torch.testing.assert_close(adv * mask, losses.masked_whiten(ref, mask) * mask, atol=1e-6, rtol=0)


def test_gae_outcome_reward_gamma_lambda_one_is_reward_minus_value():
    # One sequence of 3 tokens, reward 1 at the end, values (0.2, 0.5, 0.9): with gamma = lam = 1 the
    # advantage at t is the sum of future rewards (1) minus V_t, and every return is 1.
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.5, 0.9]])
    adv, ret = ppo.gae_unwhitened(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.5, 0.1]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))
    # lam = 0: one-step TD errors r_t + V_{t+1} - V_t = (0.3, 0.4, 0.1)
    adv, _ = ppo.gae_unwhitened(rewards, values, torch.ones(1, 3), 1.0, 0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.3, 0.4, 0.1]]))


def test_adaptive_kl_controller_by_hand():
    ctrl = rl.KLController(rl.KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.1, horizon=1000))
    # kl 0.15: error 0.15/0.1 - 1 = 0.5, clipped to 0.2; 100 sequences: 0.2 * (1 + 0.2 * 100/1000) = 0.204
    ctrl.update(0.15, n_steps=100)
    assert abs(ctrl.value - 0.204) < 1e-12
    # kl 0.09: error -0.1; 500 sequences: 0.204 * (1 - 0.1 * 0.5) = 0.1938
    ctrl.update(0.09, n_steps=500)
    assert abs(ctrl.value - 0.1938) < 1e-12
    # kl 0: error -1 clipped to -0.2; 1000 sequences: 0.1938 * 0.8 = 0.15504
    ctrl.update(0.0, n_steps=1000)
    assert abs(ctrl.value - 0.15504) < 1e-12
    fixed = rl.KLController(rl.KLControlConfig(type="fixed", kl_coef=0.05))
    fixed.update(10.0, n_steps=10**6)
    assert fixed.value == 0.05
    with pytest.raises(ValueError, match="horizon"):
        rl.KLController(rl.KLControlConfig(type="adaptive", horizon=0))


def test_value_loss_clipping():
    """ppo.value_loss by hand, through a stand-in critic whose values at the response positions are vpreds.
    cliprange 0.5. (0,0): v 1 clipped to 0.5, R 2: max(1, 2.25) = 2.25, the clipped term wins; (0,1): v 0.2
    inside, R 1: 0.64 both; (1,0): v 2 clipped to 1.5, R 1: max(1, 0.25) = 1; (1,1): past the response."""
    from types import SimpleNamespace

    import actor

    vpreds = torch.tensor([[1.0, 0.2], [2.0, 9.0]], requires_grad=True)
    samples = [actor.Sample([5], [6, 7], None, "stop", 0), actor.Sample([5], [6], None, "stop", 0)]
    samples[0].values, samples[0].returns = torch.tensor([0.0, 0.0]), torch.tensor([2.0, 1.0])
    samples[1].values, samples[1].returns = torch.tensor([1.0]), torch.tensor([1.0])
    mb = actor.MicroBatch.of(
        samples, actor.Layout(False, 0, torch.device("cpu")), global_tokens=3, global_seqs=2
    )

    def critic(**inputs):  # [B, T, 1] logits whose response positions hold vpreds
        values = torch.zeros(inputs["input_ids"].shape)
        values = values.reshape(-1).index_put((mb.inputs["response_index"],), vpreds[mb.mask.bool()])
        return SimpleNamespace(logits=values.reshape(inputs["input_ids"].shape)[..., None])

    cfg = ppo.PPOConfig(critic=ppo.CriticConfig(cliprange_value=0.5))
    loss, m = ppo.value_loss(critic, mb, cfg)
    assert abs(float(loss) - 0.5 * (2.25 + 0.64 + 1.0) / 3) < 1e-6
    assert abs(float(m["critic/vf_clipfrac"]) - 1 / 3) < 1e-6
    # gradient 0.5 * 2 (v - R) / 3 where the unclipped term is active, 0 where the clipped one is
    (grad,) = torch.autograd.grad(loss, vpreds)
    torch.testing.assert_close(grad, torch.tensor([[0.0, (0.2 - 1.0) / 3], [(2.0 - 1.0) / 3, 0.0]]))
    cfg = ppo.PPOConfig(critic=ppo.CriticConfig(cliprange_value=0.5, loss_agg_mode="seq-mean-token-sum"))
    assert abs(float(ppo.value_loss(critic, mb, cfg)[0]) - 0.5 * ((2.25 + 0.64) + 1.0) / 2) < 1e-6


@pytest.mark.parametrize("checkpointing", [False, True])
def test_update_critic_recomputes_with_checkpointing_and_leaves_eval_mode(
    one_rank, tiny_qwen2, checkpointing
):
    """As the policy's (tests/test_grpo.py): the critic's update (actor.update with ppo.value_loss) runs in train
    mode, so with checkpointing each decoder layer runs twice per micro-batch; compute_values and what follows run
    in eval mode."""
    import functools

    import actor
    import optim

    device = one_rank.device
    mcfg = actor.ModelConfig(path=str(tiny_qwen2), enable_gradient_checkpointing=checkpointing)
    critic, _ = actor.load(mcfg, device, value_head=True)
    optimizer, _ = optim.build(critic.parameters(), optim.OptimConfig(lr=1e-2), total_steps=4)
    gen = torch.Generator().manual_seed(1)
    samples = []
    for g in range(4):  # 4 prompts x 2 responses of 3 to 8 tokens
        for _ in range(2):
            ids = torch.randint(1, 64, (5 + int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen)
            samples.append(actor.Sample(ids[:5].tolist(), ids[5:].tolist(), None, "stop", g))
    cfg = ppo.PPOConfig(critic=ppo.CriticConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=3))
    layout = actor.Layout(True, 0, device)
    modes = []  # the layer's training flag at each call (a pre-hook: a recompute stops before the end)
    critic.model.layers[0].register_forward_pre_hook(lambda m, args: modes.append(m.training))

    critic.train()  # whatever mode it is left in, the value pass runs in eval
    ppo.compute_values(critic, samples, cfg.critic, layout)
    assert modes == [False] * 3  # 8 samples, 3 a micro-batch
    modes.clear()
    for s in samples:
        s.returns = torch.rand(len(s.response_ids), generator=gen)
    loss_fn = functools.partial(ppo.value_loss, cfg=cfg)
    losses_seen = []
    for _ in range(3):
        m = actor.update(
            critic, optimizer, optim.SkipGuard(5), samples, 4, cfg.critic, layout, loss_fn, "critic/"
        )
        losses_seen.append(m["critic/vf_loss"])
    assert losses_seen[0] > 0 and losses_seen[2] < losses_seen[0], losses_seen  # it fits the returns
    assert modes == [True] * 3 * 3 * (2 if checkpointing else 1)
    assert not any(m.training for m in critic.modules())


# ------------------------------------------------------------------------------- PF-PPO (algorithm.use_pf_ppo)


def _scored(scores: list[float]) -> list:
    import actor

    return [actor.Sample([1], [2, 3], None, "stop", i, score=float(x)) for i, x in enumerate(scores)]


def test_pf_ppo_redraws_by_score(one_rank):
    """verl's compute_pf_ppo_reweight_data: as many draws as samples, with replacement, by |score|^pow, by the
    batch's extreme scores, or 0.4 at the top against 0.1; copies, so a twice-drawn response trains twice."""
    samples = _scored([0.0, 1.0, 2.0, 0.5] * 500)
    gen = torch.Generator().manual_seed(0)
    drawn = ppo.pf_ppo_resample(samples, ppo.PFPPOConfig("pow", 2.0), gen)
    share = {x: sum(s.score == x for s in drawn) / len(drawn) for x in (0.0, 0.5, 1.0, 2.0)}
    assert len(drawn) == len(samples) and share[0.0] == 0  # weights 1e-8 : 0.25 : 1 : 4
    assert abs(share[2.0] - 4 / 5.25) < 0.03 and abs(share[0.5] - 0.25 / 5.25) < 0.02, share
    assert len({id(s) for s in drawn}) == len(drawn)  # each draw its own Sample
    extremes = ppo.pf_ppo_resample(samples, ppo.PFPPOConfig("max_min"), gen)
    assert {s.score for s in extremes} == {0.0, 2.0}
    top = ppo.pf_ppo_resample(samples, ppo.PFPPOConfig("max_random"), gen)
    share_top = sum(s.score == 2.0 for s in top) / len(top)
    assert abs(share_top - 0.4 / (0.4 + 3 * 0.1)) < 0.03, share_top  # 500 at 0.4 against 1500 at 0.1


def _pf_rank_main(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks: rank 0 holds scores 0 and 1, rank 1 scores 1 and 2."""
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mine = _scored([0.0, 1.0] * 50 if rank == 0 else [1.0, 2.0] * 50)
    drawn = ppo.pf_ppo_resample(mine, ppo.PFPPOConfig("max_min"), torch.Generator().manual_seed(rank))
    Path(out, f"rank{rank}.json").write_text(json.dumps(sorted({s.score for s in drawn})))
    dist.destroy_process_group()


def test_pf_ppo_extremes_are_the_whole_batchs(tmp_path):
    """max_min keeps the batch's lowest (0, on rank 0) and highest (2, on rank 1) scores: the 1s on both ranks
    are neither, though each is an extreme of its own rank's share."""
    import json

    from conftest import free_port

    torch.multiprocessing.spawn(_pf_rank_main, args=(free_port(), str(tmp_path)), nprocs=2)
    kept = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert kept == [[0.0], [2.0]], kept


def test_pf_ppo_on_the_toy_trains_the_redraw(one_rank, toy_dir, tmp_path, monkeypatch):
    """ppo.py with use_pf_ppo on the toy (hf engine, 4 prompts x 2, max_min): both updates get the redraw, which
    holds only the step's extreme scores; pf_ppo/unique_fraction says how much of the batch was drawn."""
    import dataclasses

    from conftest import read_metrics, toy_grpo_config

    import actor

    fn = tmp_path / "length_reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 3)\n"
    )
    g = toy_grpo_config(toy_dir, tmp_path / "run", fn, steps=2, lr=1e-3)
    critic = ppo.CriticConfig(
        model=dataclasses.replace(g.model, path=""), ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4
    )
    algorithm = ppo.AlgorithmConfig(use_pf_ppo=True, pf_ppo=ppo.PFPPOConfig("max_min"))
    shared = {
        f.name: getattr(g, f.name) for f in dataclasses.fields(g) if f.name not in ("algorithm", "trainer")
    }
    trainer = ppo.PPOTrainerConfig(
        **{f.name: getattr(g.trainer, f.name) for f in dataclasses.fields(g.trainer)}
    )
    cfg = ppo.PPOConfig(**shared, critic=critic, algorithm=algorithm, trainer=trainer)
    seen, real_update = [], actor.update

    def update(model, optimizer, guard, samples, *args, **kw):
        seen.append(sorted({s.score for s in samples}))
        return real_update(model, optimizer, guard, samples, *args, **kw)

    monkeypatch.setattr(actor, "update", update)
    ppo.main(cfg)
    rows = [r for r in read_metrics(tmp_path / "run") if "timing_s/step" in r]
    assert len(rows) == 2 and len(seen) == 4  # critic and actor, two steps
    for r, (critic_scores, actor_scores) in zip(rows, zip(seen[::2], seen[1::2], strict=True), strict=True):
        assert critic_scores == actor_scores and len(critic_scores) <= 2  # only the step's extremes
        assert 0 < r["pf_ppo/unique_fraction"] <= 1
    assert min(r["pf_ppo/unique_fraction"] for r in rows) < 1  # 8 draws with replacement repeat some
