"""algorithm.adv_estimator=optimal_token_baseline (verl's OTB): the advantages against a plain loop over the
formula, the chunked kernel's sum_v pi_v^2 against a full softmax, grpo.py on the toy, and verl's command line."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import actor
import config
import grpo
import losses
import ppo

OTB = "optimal_token_baseline"


def _samples(seed: int) -> list[actor.Sample]:
    """Three groups: 3 responses of lengths 2, 4, 3; 2 of lengths 5, 1; one alone (length 3). Random old
    logprobs, sum_v pi_v^2 and engine logprobs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group, lengths, scores in [(0, [2, 4, 3], [1.0, 0.0, 0.5]), (1, [5, 1], [0.0, 2.0]), (2, [3], [1.5])]:
        for L, score in zip(lengths, scores, strict=True):
            old = -2.0 * torch.rand(L, generator=g)  # [L], pi in (e^-2, 1]
            s = actor.Sample([7], [3] * L, (old + 0.3 * torch.randn(L, generator=g)).tolist(), "stop", group)
            s.score, s.old_logprobs = score, old
            s.sum_pi_squared = 0.05 + 0.9 * torch.rand(L, generator=g)  # [L]
            out.append(s)
    return out


def _loop(
    samples: list[actor.Sample], threshold: float | None = None, is_mean: float = 1.0
) -> list[list[float]]:
    """The OTB advantages by the formula, one number at a time: G = the score (its only reward is on the last
    token; 0 when rejection dropped that token), w_t = 1 - 2 pi_t + sum pi^2 (times the squared truncated IS
    weight), W_t = the sum of the kept w_j, j <= t, B_t = sum_i G_i W_t,i / (sum_i W_t,i + 1e-8) over the group's
    responses that keep a token at t, 0 for a group of one; A_t = G - B_t at kept tokens, else 0."""
    keep = [[1.0] * len(s.response_ids) if s.loss_mask is None else s.loss_mask.tolist() for s in samples]
    G = [s.score * k[-1] for s, k in zip(samples, keep, strict=True)]
    W = []
    for s, k in zip(samples, keep, strict=True):
        acc, row = 0.0, []
        for t in range(len(s.response_ids)):
            w = 1.0 - 2.0 * math.exp(float(s.old_logprobs[t])) + float(s.sum_pi_squared[t])
            if threshold is not None:
                rho = min(math.exp(float(s.old_logprobs[t]) - s.rollout_logprobs[t]), threshold) / is_mean
                w *= rho**2
            acc += w * k[t]
            row.append(acc)
        W.append(row)
    out = []
    for i, s in enumerate(samples):
        members = [j for j, o in enumerate(samples) if o.group == s.group]
        row = []
        for t in range(len(s.response_ids)):
            if len(members) == 1:
                baseline = 0.0
            else:
                reach = [j for j in members if t < len(samples[j].response_ids) and keep[j][t]]
                num = sum(G[j] * W[j][t] for j in reach)
                baseline = num / (sum(W[j][t] for j in reach) + 1e-8)
            row.append((G[i] - baseline) * keep[i][t])
        out.append(row)
    return out


@pytest.mark.parametrize("with_is", [False, True])
def test_otb_advantages_match_the_formula_by_hand(with_is):
    samples = _samples(3)
    is_mean = 1.5 if with_is else 1.0
    cfg = grpo.AlgorithmConfig(
        adv_estimator=OTB, rollout_is=with_is, rollout_is_threshold=1.2 if with_is else None
    )
    assert grpo.compute_advantages(samples, cfg, is_mean=is_mean) == {}
    expected = _loop(samples, 1.2 if with_is else None, is_mean)
    for s, row in zip(samples, expected, strict=True):
        assert s.advantages.shape == (len(s.response_ids),)
        torch.testing.assert_close(s.advantages, torch.tensor(row), atol=1e-5, rtol=1e-5)
    assert samples[-1].advantages.tolist() == pytest.approx([1.5] * 3)  # alone: no baseline, the return
    # the baseline moves along the response: the 4-token response's advantages are not all equal
    assert samples[1].advantages.std() > 1e-3
    if with_is:  # the weights matter: other numbers than without them
        plain = _samples(3)
        grpo.compute_advantages(plain, grpo.AlgorithmConfig(adv_estimator=OTB))
        assert not torch.allclose(plain[1].advantages, samples[1].advantages)


def test_otb_needs_the_old_pass_outputs():
    samples = _samples(0)
    samples[2].sum_pi_squared = None
    with pytest.raises(ValueError, match="sum_pi_squared"):
        grpo.compute_advantages(samples, grpo.AlgorithmConfig(adv_estimator=OTB))


def test_otb_with_rejected_tokens_leaves_them_out():
    """rollout_rs's drops (loss_mask 0) are out of W, the baseline and the advantage, as verl's modified
    response_mask; a response whose last token is dropped has return 0 (verl puts the score there)."""
    samples = _samples(5)
    samples[1].loss_mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    samples[3].loss_mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    grpo.compute_advantages(samples, grpo.AlgorithmConfig(adv_estimator=OTB))
    assert samples[1].advantages[1] == 0.0 and samples[3].advantages[4] == 0.0
    for s, row in zip(samples, _loop(samples), strict=True):
        torch.testing.assert_close(s.advantages, torch.tensor(row), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_kernels_sum_pi_squared_matches_a_full_softmax(temperature):
    """10 rows in chunks of 4 (two full chunks and a short one): sum_v softmax(z / T)_v^2 per row, with no
    gradient, beside logprobs and entropies (and their gradient) unchanged."""
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 5, 33, generator=g)).requires_grad_(True)  # [B, T, V]
    labels = torch.randint(0, 33, (2, 5), generator=g)
    lp, ent, sps = losses.token_stats(logits, labels, 4, True, temperature, with_sum_pi_squared=True)
    ref = (torch.softmax(logits.detach() / temperature, -1) ** 2).sum(-1)  # [B, T]
    assert sps.shape == labels.shape and not sps.requires_grad
    torch.testing.assert_close(sps, ref, atol=1e-6, rtol=1e-5)
    plain_lp, plain_ent = losses.token_logprobs_and_entropy(logits, labels, 4, temperature=temperature)
    torch.testing.assert_close(lp, plain_lp)
    torch.testing.assert_close(ent, plain_ent)
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), logits)
    (plain_grad,) = torch.autograd.grad(plain_lp.sum() + plain_ent.sum(), logits)
    torch.testing.assert_close(grad, plain_grad)
    assert losses.token_stats(logits, labels, 4, False, temperature)[1:] == (None, None)


def test_grpo_with_otb_on_the_toy_runs_the_old_pass_and_varies_along_responses(
    one_rank, toy_dir, tmp_path, monkeypatch
):
    """Two steps on the toy with one optimizer step a batch (no old-logprob pass for grpo): with OTB the pass runs
    (timing_s/old_logprob), fills sum_v pi_v^2 in (0, 1], and the advantages vary along some response."""
    from conftest import read_metrics, toy_grpo_config

    fn = tmp_path / "length_reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 3)\n"
    )
    seen = []
    real = grpo.compute_advantages

    def advantages(samples, cfg, kl_ctrl=None, baselines=None, is_mean=1.0):
        metrics = real(samples, cfg, kl_ctrl, baselines, is_mean)
        seen.append([(s.sum_pi_squared.clone(), s.advantages.clone(), s.score) for s in samples])
        return metrics

    monkeypatch.setattr(grpo, "compute_advantages", advantages)
    run_dir = tmp_path / "otb"
    cfg = toy_grpo_config(
        toy_dir, run_dir, fn, steps=2, lr=1e-2, n=3, algorithm=grpo.AlgorithmConfig(adv_estimator=OTB)
    )
    assert grpo.actor.one_optimizer_step(cfg.actor, cfg.data.train_batch_size)
    results = grpo.main(cfg)
    rows = [r for r in read_metrics(run_dir) if "timing_s/step" in r]
    assert len(rows) == len(seen) == 2 and all("timing_s/old_logprob" in r for r in rows)
    assert results["global_step"] == 2
    everything = [x for step in seen for x in step]
    assert all(((0 < sps) & (sps <= 1 + 1e-6)).all() for sps, _, _ in everything)
    assert all(len(a) == len(sps) for sps, a, _ in everything)
    assert any(len(a) > 1 and float(a.max() - a.min()) > 1e-4 for _, a, _ in everything)
    assert all(torch.isfinite(a).all() for _, a, _ in everything)

    # the fused LM head computes no sum_v pi_v^2: refused in one line before anything loads
    fused = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, use_fused_kernels=True))
    with pytest.raises(SystemExit, match="optimal_token_baseline does not go with model.use_fused_kernels"):
        grpo.main(fused)


def test_verls_otb_command_line_parses(capsys):
    """verl's examples/otb_trainer/run_qwen2_5-7b.sh keys: the estimator reaches grpo.py, calculate_sum_pi_squared
    is said as ignored with why (grpo.py computes it whenever the estimator needs it); ppo.py and the multi-turn
    tir_optimal_token_baseline are refused by name."""
    c = config.parse(
        grpo.GRPOConfig,
        [
            f"algorithm.adv_estimator={OTB}",
            "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
            "actor_rollout_ref.model.use_fused_kernels=False",
            "actor_rollout_ref.rollout.n=8",
        ],
    )
    assert c.algorithm.adv_estimator == OTB and not c.model.use_fused_kernels
    err = capsys.readouterr().err
    assert "ignored: actor_rollout_ref.actor.calculate_sum_pi_squared=True" in err and OTB in err
    for cls, value in [(ppo.PPOConfig, OTB), (grpo.GRPOConfig, "tir_optimal_token_baseline")]:
        with pytest.raises(SystemExit, match=f"got '{value}'.*tir_optimal_token_baseline"):
            config.parse(cls, [f"algorithm.adv_estimator={value}"])
