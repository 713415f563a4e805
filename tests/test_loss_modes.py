"""grpo.py's policy-loss modes beyond PPO-clip (actor.policy_loss.loss_mode geo_mean, gpg, cispo, sapo) and the
GPG estimator: hand-built cases against each paper's formula written out here, the on-policy gradient of every
mode, verl's command-line keys, and policy_loss on a micro-batch of the tiny model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_verl_cli import assert_accounted, print_config

import actor
import config
import grpo
import losses
import ppo

torch.set_num_threads(1)

MODES = ["vanilla", "gspo", "geo_mean", "gpg", "cispo", "sapo"]


def cfg_of(mode: str, **kw) -> actor.ActorConfig:
    return actor.ActorConfig(policy_loss=actor.PolicyLossConfig(loss_mode=mode), **kw)


def pg_loss(logprobs, old, adv, mask, a: actor.ActorConfig):
    """The policy term as policy_loss aggregates it (one micro-batch = the mini-batch); also the clip masks."""
    pg, clipped, lower = grpo.surrogate(logprobs, old, adv, mask, a)
    mode = "seq-mean-token-mean" if a.policy_loss.loss_mode in grpo.PER_SEQUENCE else a.loss_agg_mode
    return losses.agg_loss(pg, mask, mode), clipped, lower


# ------------------------------------------------------------------------------- each formula by hand


def test_geo_mean_is_the_geometric_mean_of_clipped_token_ratios():
    """GMPO (clip 0.4 / 0.4 as verl's example), each token clipped on its pessimistic side only. Sequence 0 (A = 1,
    three tokens): log-ratios 0.35, 0.45, -0.45; A > 0 caps them from above, so 0.45 becomes 0.4 and -0.45
    stays: sequence ratio (e^0.35 e^0.4 e^-0.45)^(1/3) = e^0.1. Sequence 1 (A = -2, two tokens, a third masked): A < 0
    floors them, so -0.7 becomes -0.4 and 0.6 stays: e^0.1 again. The loss is the mean over sequences of -A times
    the ratio, (-e^0.1 + 2 e^0.1) / 2; a clipped token has no gradient, an unclipped one -A ratio / n / S."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -9.0]])
    log_ratio = torch.tensor([[0.35, 0.45, -0.45], [-0.7, 0.6, 4.0]])
    logprobs = (old + log_ratio).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    a = cfg_of("geo_mean", clip_ratio_low=0.4, clip_ratio_high=0.4)
    loss, clipped, lower = pg_loss(logprobs, old, adv, mask, a)
    # the paper's objective: per sequence, -A (prod_t clip_A(r_t))^(1/|o|), clip_A pessimistic for A's sign
    r = torch.exp(logprobs - old)
    lo, hi = math.exp(-0.4), math.exp(0.4)
    r_clip = torch.where(adv > 0, torch.clamp(r, max=hi), torch.clamp(r, min=lo))
    r_clip = torch.where(mask.bool(), r_clip, torch.ones_like(r_clip))  # masked tokens: factor 1
    geo = torch.prod(r_clip, dim=-1) ** (1.0 / mask.sum(-1))  # [S]
    want = (-adv[:, 0] * geo).mean()
    e = math.exp(0.1)
    assert abs(loss.item() - e / 2) < 1e-6
    assert abs(loss.item() - want.item()) < 1e-6
    (grad,) = torch.autograd.grad(loss, logprobs)
    (want_grad,) = torch.autograd.grad(want, logprobs)
    torch.testing.assert_close(grad, want_grad)
    torch.testing.assert_close(grad, torch.tensor([[-e / 6, 0.0, -e / 6], [0.0, e / 2, 0.0]]))
    # verl's clip fractions: tokens outside [-0.4, 0.4], split by the advantage's sign (clipped or not)
    assert clipped.tolist() == [[False, True, True], [False, False, False]]
    assert lower.tolist() == [
        [False, False, False],
        [True, True, True],
    ]  # the masked 4.0 too (masked when logged)


def test_gpg_is_minus_the_mean_of_logprob_times_advantage():
    """GPG: -A log pi, aggregated as actor.loss_agg_mode says; no ratio, so the old logprobs do not enter."""
    logprobs = torch.tensor([[-0.5, -1.5, -2.0], [-0.1, -3.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[0.7, 0.7, 0.7], [-1.3, -1.3, -1.3]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    n = 5
    want = -(logprobs * adv * mask).sum() / n
    for old in (logprobs.detach(), torch.full((2, 3), -7.0)):
        loss, clipped, lower = pg_loss(logprobs, old, adv, mask, cfg_of("gpg"))
        assert abs(loss.item() - want.item()) < 1e-6
        assert abs(loss.item() - (0.7 * 4.0 - 1.3 * 3.1) / n) < 1e-6
        assert not clipped.any() and not lower.any()
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, -adv * mask / n)
    # another aggregation is honoured (verl passes loss_agg_mode through): sum per sequence, mean over sequences
    loss, _, _ = pg_loss(logprobs, old, adv, mask, cfg_of("gpg", loss_agg_mode="seq-mean-token-sum"))
    assert abs(loss.item() - (0.7 * 4.0 - 1.3 * 3.1) / 2) < 1e-6


@pytest.mark.parametrize("low", [10.0, 0.2])
def test_cispo_weight_is_clipped_and_detached(low):
    """CISPO: loss -sg(clip(r, 1 - low, 1 + 0.2)) A log pi, token-mean. Log-ratios 0.5 (r 1.65, capped at 1.2),
    -0.5 (r 0.61: kept with verl's example clip_ratio_low 10, raised to 0.8 with 0.2) and 0. The gradient of a
    token is -A w / n whether its weight was clipped or not: w itself carries none."""
    old = torch.tensor([[-1.5, -0.5, -2.0]])
    logprobs = (old + torch.tensor([[0.5, -0.5, 0.0]])).requires_grad_()
    adv = torch.tensor([[1.5, 1.5, 1.5]])
    mask = torch.ones(1, 3)
    a = cfg_of("cispo", clip_ratio_low=low, clip_ratio_high=0.2)
    loss, clipped, lower = pg_loss(logprobs, old, adv, mask, a)
    r = [math.exp(0.5), math.exp(-0.5), 1.0]
    w = [1.2, max(r[1], 1 - low), 1.0]
    want = sum(-wi * 1.5 * lp for wi, lp in zip(w, logprobs.tolist()[0], strict=True)) / 3
    assert abs(loss.item() - want) < 1e-6
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[-wi * 1.5 / 3 for wi in w]]))
    assert grad[0, 0] != 0  # clipped, yet it still pushes (PPO-clip's gradient there is 0)
    assert clipped.tolist() == [[True, low < 1, False]] and not lower.any()


def test_sapo_gate_values_and_gradient():
    """SAPO with tau_pos 1, tau_neg 3 (apart, so a swap shows): f(r) = sigmoid(tau (r - 1)) 4 / tau. At r = 1 the
    gate is 2 / tau (2 and 2/3) and its slope 1; at r = e^0.4 for A > 0 and e^-0.4 for A < 0 it is the sigmoid's
    value there. Loss: seq-mean-token-mean of -A f(r); d/dlogprob = -A 4 s (1 - s) r with s the sigmoid."""
    old = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    log_ratio = torch.tensor([[0.0, 0.4], [0.0, -0.4]])
    logprobs = (old + log_ratio).requires_grad_()
    adv = torch.tensor([[1.0, 1.0], [-0.5, -0.5]])
    mask = torch.ones(2, 2)
    a = cfg_of("sapo", tau_pos=1.0, tau_neg=3.0)
    pg, clipped, lower = grpo.surrogate(logprobs, old, adv, mask, a)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    r_hi, r_lo = math.exp(0.4), math.exp(-0.4)
    gate = [[2.0, sig(r_hi - 1) * 4], [2 / 3, sig(3 * (r_lo - 1)) * 4 / 3]]
    torch.testing.assert_close(pg, -adv * torch.tensor(gate))
    assert not clipped.any() and not lower.any()
    loss, _, _ = pg_loss(logprobs, old, adv, mask, a)
    assert (
        abs(loss.item() - ((-adv * torch.tensor(gate)).mean()).item()) < 1e-6
    )  # equal lengths: a plain mean
    (grad,) = torch.autograd.grad(loss, logprobs)
    s_hi, s_lo = sig(r_hi - 1), sig(3 * (r_lo - 1))
    slope = [[1.0, 4 * s_hi * (1 - s_hi) * r_hi], [1.0, 4 * s_lo * (1 - s_lo) * r_lo]]  # df/dr * dr/dlogprob
    torch.testing.assert_close(grad, -adv * torch.tensor(slope) / 4)  # / (2 tokens x 2 sequences)
    # verl's defaults
    assert (actor.ActorConfig().tau_pos, actor.ActorConfig().tau_neg) == (1.0, 1.05)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_the_policy_gradient_on_policy(mode):
    """At ratio 1 (logprobs == old) every mode's gradient is the policy gradient -A grad log pi, aggregated as
    the mode aggregates (seq-mean-token-mean for gspo, geo_mean and sapo; actor.loss_agg_mode else)."""
    g = torch.Generator().manual_seed(3)
    lengths = [4, 1, 6, 3]
    mask = (torch.arange(6)[None] < torch.tensor(lengths)[:, None]).float()  # [4, 6]
    logprobs = (-torch.rand(4, 6, generator=g) * 3).requires_grad_()
    adv = torch.tensor([1.2, -0.4, 0.9, -2.0])[:, None].expand(4, 6) * mask  # one number a sequence
    for agg_mode in ("token-mean", "seq-mean-token-sum"):
        a = cfg_of(mode, loss_agg_mode=agg_mode)
        loss, clipped, lower = pg_loss(logprobs, logprobs.detach(), adv, mask, a)
        (grad,) = torch.autograd.grad(loss, logprobs)
        per_seq = "seq-mean-token-mean" if mode in grpo.PER_SEQUENCE else agg_mode
        (want,) = torch.autograd.grad(losses.agg_loss(-adv * logprobs, mask, per_seq), logprobs)
        torch.testing.assert_close(grad, want)
        assert not (clipped * mask).any() and not (lower * mask).any()


# ------------------------------------------------------------------------------------ GPG's estimator


def test_gpg_advantages_by_hand_and_as_verl():
    """Group 0 scores 1, 0, 0, 0 (mean 0.25), group 1 scores 1, 1, 1, 0 (mean 0.75): 4 of 8 nonzero, alpha 2."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    want = [1.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -1.5]
    torch.testing.assert_close(grpo.gpg_advantages(scores, groups), torch.tensor(want))
    # verl's compute_gpg_outcome_advantage, per element, on random groups (all of size >= 2)
    g = torch.Generator().manual_seed(0)
    index = [k for k in range(6) for _ in range(4)]
    scores = torch.randint(0, 3, (24,), generator=g).float() / 2
    alpha = len(scores) / max(int(torch.count_nonzero(scores)), 1)
    verl = torch.tensor(
        [
            alpha * (scores[i] - scores[[j for j in range(24) if index[j] == index[i]]].mean())
            for i in range(24)
        ]
    )
    torch.testing.assert_close(grpo.gpg_advantages(scores, torch.tensor(index)), verl)
    # alpha counts the whole batch (all ranks): here 1 of 2 scores is nonzero (alpha 2), over all 1 of 4 (alpha 4)
    one = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    torch.testing.assert_close(grpo.gpg_advantages(*one), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(grpo.gpg_advantages(*one, total=(4.0, 1.0)), torch.tensor([2.0, -2.0]))


def test_compute_advantages_runs_gpg(one_rank):
    samples = [actor.Sample([1], [2, 3], None, "stop", k // 2, score=float(k == 0)) for k in range(4)]
    grpo.compute_advantages(samples, grpo.AlgorithmConfig(adv_estimator="gpg"))
    assert [s.advantages for s in samples] == [2.0, -2.0, 0.0, 0.0]  # alpha 4 / 1, group 0's mean 0.5


# ------------------------------------------------------------------------------ verl's command lines


def test_verl_loss_mode_keys(tmp_path):
    """verl's example keys for each mode load in grpo.py: GMPO through `grpo.py ... --print-config`, the others
    through the same parser in process. ppo.py refuses them, naming grpo.py's modes."""
    gmpo = [
        "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean",
        "actor_rollout_ref.actor.clip_ratio_low=0.4",
        "actor_rollout_ref.actor.clip_ratio_high=0.4",
    ]
    c, err = print_config("grpo.py", gmpo, grpo.GRPOConfig, tmp_path)
    assert (c.actor.policy_loss.loss_mode, c.actor.clip_ratio_low, c.actor.clip_ratio_high) == (
        "geo_mean",
        0.4,
        0.4,
    )
    assert_accounted(gmpo, err, grpo.GRPOConfig)
    key = "actor_rollout_ref.actor."
    c = config.parse(grpo.GRPOConfig, ["algorithm.adv_estimator=gpg", f"{key}policy_loss.loss_mode=gpg"])
    assert (c.algorithm.adv_estimator, c.actor.policy_loss.loss_mode) == ("gpg", "gpg")
    cispo = [f"{key}policy_loss.loss_mode=cispo", f"{key}clip_ratio_low=10", f"{key}clip_ratio_high=0.2"]
    c = config.parse(grpo.GRPOConfig, cispo)
    assert (c.actor.policy_loss.loss_mode, c.actor.clip_ratio_low, c.actor.clip_ratio_high) == (
        "cispo",
        10,
        0.2,
    )
    sapo = [f"{key}policy_loss.loss_mode=sapo", f"{key}tau_pos=1.0", f"{key}tau_neg=1.2"]
    c = config.parse(grpo.GRPOConfig, sapo)
    assert (c.actor.policy_loss.loss_mode, c.actor.tau_pos, c.actor.tau_neg) == ("sapo", 1.0, 1.2)
    with pytest.raises(SystemExit) as e:
        config.parse(grpo.GRPOConfig, [f"{key}tau_neg=0"])
    assert "actor.tau_neg" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        config.parse(ppo.PPOConfig, [f"{key}policy_loss.loss_mode=sapo"])
    assert "cannot be honoured" in str(e.value.code) and "sapo: grpo.py" in str(e.value.code)
    flatrl = config.parse(ppo.PPOConfig, ["--actor.policy_loss.loss_mode", "cispo"])  # a flatrl flag
    with pytest.raises(
        SystemExit, match=r"loss_mode=cispo is grpo.py's \(gspo, geo_mean, gpg, cispo, sapo\)"
    ):
        ppo.main(flatrl)


# ---------------------------------------------------------------------------- policy_loss end to end


def test_policy_loss_runs_every_mode_on_a_micro_batch(one_rank, tiny_qwen2):
    """grpo.policy_loss on a micro-batch of the tiny model, on policy (the forward's own old logprobs): the loss
    is each formula's value at ratio 1, and the weights' gradient is the policy gradient, so the token-mean
    modes (vanilla, gpg, cispo) agree with each other, as do the per-sequence ones (gspo, geo_mean, sapo)."""
    from test_grpo import _grpo_cfg, _random_samples, _tiny_policy

    device = one_rank.device
    model, _, _ = _tiny_policy(tiny_qwen2, device)
    samples = _random_samples()
    layout = actor.Layout(True, 0, device)
    tokens = sum(len(s.response_ids) for s in samples)
    mb = actor.MicroBatch.of(samples, layout, global_tokens=tokens, global_seqs=len(samples))
    with torch.no_grad():
        lp, _ = actor.forward(model, mb, 1.0)
    adv = mb.per_token("advantages")
    token_mean = float(losses.agg_loss(-adv, mb.mask, "token-mean"))
    seq_mean = float(losses.agg_loss(-adv, mb.mask, "seq-mean-token-mean"))
    reinforce = float(losses.agg_loss(-adv * lp, mb.mask, "token-mean"))
    want = dict(vanilla=token_mean, gspo=seq_mean, geo_mean=seq_mean, gpg=reinforce, cispo=reinforce)
    gate = torch.where(adv > 0, 2 / 1.0, 2 / 1.05)  # SAPO's at ratio 1: 2 / tau, verl's default taus
    want["sapo"] = float(losses.agg_loss(-adv * gate, mb.mask, "seq-mean-token-mean"))
    grads, base = {}, _grpo_cfg()
    for mode in MODES:
        a = dataclasses.replace(base.actor, policy_loss=actor.PolicyLossConfig(loss_mode=mode))
        cfg = dataclasses.replace(base, actor=a)
        model.zero_grad(set_to_none=True)
        loss, m = grpo.policy_loss(model, mb, cfg, None)
        loss.backward()
        assert abs(loss.item() - want[mode]) < 1e-5, (mode, loss.item(), want[mode])
        assert float(m["actor/pg_clipfrac"]) == 0 and abs(float(m["actor/ppo_kl"])) < 1e-6, (mode, m)
        grads[mode] = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
        assert grads[mode].norm() > 1e-3, mode
    for group in (("vanilla", "gpg", "cispo"), ("gspo", "geo_mean", "sapo")):
        for mode in group[1:]:
            torch.testing.assert_close(grads[mode], grads[group[0]], atol=1e-6, rtol=1e-4)
    # the two aggregations differ on responses of unequal lengths
    assert not torch.allclose(grads["vanilla"], grads["gspo"])
