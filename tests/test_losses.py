"""losses.py: hand-derived numbers for the RL math, and the chunked kernels against plain log_softmax."""

import math

import pytest
import torch

import losses

torch.set_num_threads(1)
NAN = float("nan")


def close(actual: torch.Tensor, expected, tol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_and_whiten():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    close(losses.masked_mean(x, mask), (1 + 3 + 4) / 3)
    close(losses.masked_mean(x, mask, dim=-1), [1.0, 3.5])
    # values 1, 2, 3 (100 masked): mean 2, unbiased var ((-1)^2 + 0 + 1^2) / (3 - 1) = 1
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    close(losses.masked_var(x, mask), 1.0)
    close(losses.masked_var(x, mask, unbiased=False), 2 / 3)
    s = 1 / math.sqrt(1 + 1e-8)
    close(losses.masked_whiten(x, mask), [[-s, 0.0, s, 98 * s]])  # masked slot transformed too, as verl
    close(losses.masked_whiten(x, mask, shift_mean=False), [[2 - s, 2.0, 2 + s, 2 + 98 * s]])
    with pytest.raises(ValueError):
        losses.masked_var(x, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- aggregation

# rows: [1, 2 | 3 masked], [4 | 5, NaN masked] -> S = (3, 4), n = (2, 1), B = 2, T = 3
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", {}, (3 + 4) / 2),
        ("seq-mean-token-mean", {}, (3 / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", {}, (3 / 3 + 4 / 3) / 2),  # default norm_length = T = 3
        ("seq-mean-token-sum-norm", {"norm_length": 7}, (3 / 7 + 4 / 7) / 2),
        ("token-mean", {"global_tokens": 10}, 7 / 10),
        ("seq-mean-token-sum", {"global_seqs": 5}, 7 / 5),
        ("seq-mean-token-mean", {"global_seqs": 4}, 5.5 / 4),
        ("seq-mean-token-sum-norm", {"global_seqs": 4, "norm_length": 2}, (3 / 2 + 4 / 2) / 4),
    ],
)
def test_agg_loss_modes(mode, kwargs, expected):
    close(losses.agg_loss(LOSS, MASK, mode, **kwargs), expected)


def test_agg_loss_rejects_unknown_mode_and_survives_empty_mask():
    with pytest.raises(ValueError, match="token-sum-mean"):
        losses.agg_loss(LOSS, MASK, "token-sum-mean")
    close(losses.agg_loss(LOSS, torch.zeros_like(MASK)), 0.0)  # verl would give NaN


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_global_normalisation_of_halves_sums_to_whole(mode):
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(6, 5, generator=g, requires_grad=True)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    whole = losses.agg_loss(loss_mat, mask, mode)
    norm = {"global_tokens": mask.sum(), "global_seqs": 6}
    halves = losses.agg_loss(loss_mat[:2], mask[:2], mode, **norm) + losses.agg_loss(
        loss_mat[2:], mask[2:], mode, **norm
    )
    close(halves, whole.item())
    (g_whole,) = torch.autograd.grad(whole, loss_mat)
    (g_halves,) = torch.autograd.grad(halves, loss_mat)
    torch.testing.assert_close(g_halves, g_whole, atol=1e-7, rtol=1e-6)
    if mode != "seq-mean-token-sum-norm":  # without global counts the halves are not a split of the mean
        unnormed = losses.agg_loss(loss_mat[:2], mask[:2], mode) + losses.agg_loss(
            loss_mat[2:], mask[2:], mode
        )
        assert abs(unnormed.item() - whole.item()) > 1e-3


# ---------------------------------------------------------------- policy loss (grpo.py's and ppo.py's copies)


def _surrogate(module, logprobs, adv, low=0.2, high=0.28, c=3.0):
    import actor

    cfg = actor.ActorConfig(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    return module.clipped_surrogate(logprobs, torch.zeros_like(logprobs), adv, cfg)


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_policy_loss_clip_higher_and_dual_clip(script):
    module = __import__(script)
    # clip_ratio_low 0.2, high 0.28, c 3. r = exp(logprobs - old_logprobs); loss = max(-A r, -A clip(r)).
    ratio = torch.tensor([[1.5, 0.5, 1.1], [0.5, 4.0, math.e**5]])
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # (0,0) A>0, r=1.5 above 1.28: max(-1.5, -1.28) = -1.28, clipped, no gradient
    # (0,1) A>0, r=0.5 below 0.8: max(-0.5, -0.8) = -0.5, unclipped (A>0 is only clipped above)
    # (0,2) A<0, r=1.1 inside: 1.1, dual bound 3 not hit
    # (1,0) A<0, r=0.5: max(0.5, 0.8) = 0.8, clipped
    # (1,1) A<0, r=4: max(4, 1.28) = 4 > 3 -> dual clip gives 3, counted as dual only
    # (1,2) masked
    logprobs = ratio.log().requires_grad_(True)
    pg, clipped, dual = _surrogate(module, logprobs, adv)
    loss = losses.agg_loss(pg, mask)
    close(loss, (-1.28 - 0.5 + 1.1 + 0.8 + 3.0) / 5)
    close(losses.masked_mean(clipped.float(), mask), 2 / 5)
    close(losses.masked_mean(dual.float(), mask), 1 / 5)
    # d loss / d logprob = -A r / 5 on the unclipped tokens, 0 where a clip or the dual bound is active
    (grad,) = torch.autograd.grad(loss, logprobs)
    close(grad, [[0.0, -0.5 / 5, 1.1 / 5], [0.0, 0.0, 0.0]])
    # symmetric clip 0.2: (0,0) is now clipped at 1.2 -> -1.2
    close(
        losses.agg_loss(_surrogate(module, logprobs, adv, high=0.2)[0], mask),
        (-1.2 - 0.5 + 1.1 + 0.8 + 3.0) / 5,
    )


def test_grpo_and_ppo_objectives_agree_on_random_inputs():
    """The PPO-clip surrogate is written twice (grpo.py, ppo.py) so that a fork edits one file: the copies agree."""
    import grpo
    import ppo

    g = torch.Generator().manual_seed(0)
    logprobs, adv = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g) * 2
    a, b = _surrogate(grpo, logprobs, adv), _surrogate(ppo, logprobs, adv)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert a[1].any() and a[2].any()  # both clips were exercised


def test_dual_clip_bound_must_exceed_one():
    import actor
    import config

    with pytest.raises(config.ConfigError, match=r"actor.clip_ratio_c=1.0 must be > 1"):
        config.check_ranges(actor.ActorConfig(clip_ratio_c=1.0), "actor.")


def test_agg_loss_modes_on_an_on_policy_surrogate():
    import grpo

    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    import actor

    pg = grpo.clipped_surrogate(logprobs, logprobs, adv, actor.ActorConfig())[0]  # r = 1: per-token loss = -A
    # S = (-2, 2), n = (2, 1)
    close(losses.agg_loss(pg, mask, "seq-mean-token-mean"), (-2 / 2 + 2 / 1) / 2)
    close(losses.agg_loss(pg, mask, global_tokens=6.0), 0.0 / 6)
    close(losses.agg_loss(pg, mask, "seq-mean-token-sum", global_seqs=4), 0.0)
    pg_abs = grpo.clipped_surrogate(logprobs, logprobs, adv.abs(), actor.ActorConfig())[0]
    close(losses.agg_loss(pg_abs, mask, "seq-mean-token-sum", global_seqs=4), (-2 - 2) / 4)


# ---------------------------------------------------------------- KL


def test_kl_penalty_types():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])  # d = logprobs - ref = (0.5, -1, 0)
    for name in ("kl", "k1"):
        close(losses.kl_penalty(logprobs, ref, name), [[0.5, -1.0, 0.0]])
    close(losses.kl_penalty(logprobs, ref, "abs"), [[0.5, 1.0, 0.0]])
    for name in ("mse", "k2"):
        close(losses.kl_penalty(logprobs, ref, name), [[0.125, 0.5, 0.0]])
    k3 = [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1, 0.0]]  # exp(-d) + d - 1
    for name in ("low_var_kl", "k3"):
        close(losses.kl_penalty(logprobs, ref, name), k3)
    # clamps: -d = 20 -> e^20 - 21, clipped to 10; -d = -30 -> clamped to -20 -> e^-20 + 19, clipped to 10
    far = losses.kl_penalty(torch.tensor([[0.0, 0.0]]), torch.tensor([[20.0, -30.0]]), "k3")
    close(far, [[10.0, 10.0]])
    with pytest.raises(ValueError, match="k4"):
        losses.kl_penalty(logprobs, ref, "k4")


def test_kl_straight_through_has_k3_value_and_k2_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    kl = losses.kl_penalty(logprobs, ref, "k3+")
    close(kl, losses.kl_penalty(logprobs, ref, "k3").detach())
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    close(grad, [[0.5, -1.0, 0.0]])  # d/dlogprobs of d^2/2 = d


# ---------------------------------------------------------------- logprobs and entropy


def test_plain_logprobs_and_entropy_by_hand():
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])  # probs (1/2, 1/2) and (1/4, 3/4)
    labels = torch.tensor([0, 1])
    close(losses.logprobs_from_logits(logits, labels), [-math.log(2), math.log(0.75)])
    h = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    close(losses.entropy_from_logits(logits), h)
    lp, ent = losses.token_logprobs_and_entropy(logits, labels, chunk_size=1)
    close(lp, [-math.log(2), math.log(0.75)])
    close(ent, h)


def _reference(logits, labels, temperature):
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 8, 10, 37, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logits_match_full_log_softmax(chunk_size, temperature):
    g = torch.Generator().manual_seed(chunk_size)
    n, v = 37, 50
    logits = (3 * torch.randn(n, v, generator=g)).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    lp, ent = losses.token_logprobs_and_entropy(logits, labels, chunk_size, temperature=temperature)
    (grad,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), logits)
    ref_lp, ref_ent = _reference(logits, labels, temperature)
    (ref_grad,) = torch.autograd.grad((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum(), logits)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)

    # each output alone (the other one unused, so its gradient is skipped)
    for use_entropy in (False, True):
        lp, ent = losses.token_logprobs_and_entropy(logits, labels, chunk_size, temperature=temperature)
        (grad,) = torch.autograd.grad((ent * w_ent).sum() if use_entropy else (lp * w_lp).sum(), logits)
        ref_lp, ref_ent = _reference(logits, labels, temperature)
        ref_out = (ref_ent * w_ent).sum() if use_entropy else (ref_lp * w_lp).sum()
        (ref_grad,) = torch.autograd.grad(ref_out, logits)
        torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_chunked_without_entropy_batched_shape_and_bf16():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 40, generator=g).requires_grad_(True)
    labels = torch.randint(0, 40, (2, 5), generator=g)
    lp, ent = losses.token_logprobs_and_entropy(logits, labels, chunk_size=3, with_entropy=False)
    assert ent is None and lp.shape == (2, 5)
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    ref_lp = losses.logprobs_from_logits(logits, labels)
    (ref_grad,) = torch.autograd.grad(ref_lp.sum(), logits)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)
    # bf16 logits: computed in fp32 from the same bf16 values; the gradient comes back in bf16
    bf = logits.detach().bfloat16().requires_grad_(True)
    lp, ent = losses.token_logprobs_and_entropy(bf, labels, chunk_size=4)
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), bf)
    ref_lp, ref_ent = _reference(bf.detach().float().requires_grad_(True), labels, 1.0)
    assert lp.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 7, 64])
def test_chunked_from_hidden_matches_full_logits(chunk_size):
    g = torch.Generator().manual_seed(2)
    n, h, v = 23, 16, 60
    hidden = torch.randn(n, h, generator=g).requires_grad_(True)
    weight = (0.5 * torch.randn(v, h, generator=g)).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    lp, ent = losses.token_logprobs_and_entropy_from_hidden(
        hidden, weight, labels, chunk_size, temperature=0.8
    )
    grads = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), (hidden, weight))
    ref_lp, ref_ent = _reference(hidden @ weight.T, labels, 0.8)
    ref_grads = torch.autograd.grad((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum(), (hidden, weight))
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # frozen head (LoRA): only the hidden-state gradient is asked for
    lp, _ = losses.token_logprobs_and_entropy_from_hidden(hidden, weight.detach(), labels, chunk_size)
    (g_h,) = torch.autograd.grad(lp.sum(), hidden)
    ref_lp, _ = _reference(hidden @ weight.detach().T, labels, 1.0)
    (ref_g_h,) = torch.autograd.grad(ref_lp.sum(), hidden)
    torch.testing.assert_close(g_h, ref_g_h, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_compiled_chunk_kernels_match_eager(device, monkeypatch):
    """The torch.compile'd chunk math (losses.COMPILE, what CUDA runs) gives the eager results: fp32 and bf16
    logits, a short last chunk (a second shape), entropy on and off, a temperature, the head inside."""
    g = torch.Generator().manual_seed(3)
    n, h, v = 45, 16, 300
    hidden = torch.randn(n, h, generator=g).to(device)
    weight = (0.5 * torch.randn(v, h, generator=g)).to(device)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    w_lp, w_ent = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)

    def run(dtype, with_entropy, temperature):
        x, w = hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True)
        lp, ent = losses.token_logprobs_and_entropy_from_hidden(x, w, labels, 16, with_entropy, temperature)
        out = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0)
        return (lp, ent, *torch.autograd.grad(out, (x, w)))

    cases = [(torch.float32, True, 0.7), (torch.float32, False, 1.0), (torch.bfloat16, True, 1.0)]
    eager = [run(*c) for c in cases]
    monkeypatch.setattr(losses, "COMPILE", True)
    monkeypatch.setattr(losses, "_kernels", lambda _device: losses._compiled())
    for case, want in zip(cases, eager, strict=True):
        got = run(*case)
        tol = 1e-5 if case[0] == torch.float32 else 2e-2  # bf16: the gradient is rounded to bf16 either way
        for a, b in zip(got, want, strict=True):
            if b is not None:
                torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    assert losses.COMPILE, "the compiled kernels failed and fell back to eager (see the warning)"


def test_a_failing_compile_falls_back_to_eager_with_a_warning(monkeypatch):
    """A compiled kernel that raises (no working Triton, say): the eager result, one warning naming the error,
    and losses.COMPILE off for the rest of the process; an out-of-memory error is not swallowed."""
    monkeypatch.setattr(losses, "COMPILE", True)
    g = torch.Generator().manual_seed(4)
    z, labels = torch.randn(5, 30, generator=g), torch.randint(0, 30, (5,), generator=g)

    def broken(*args):
        raise RuntimeError("triton: no C compiler")

    stats = losses._or_eager(broken, losses._chunk_stats)
    with pytest.warns(UserWarning, match="no C compiler"):
        got = stats(z, labels, 1.0, True)
    for a, b in zip(got, losses._chunk_stats(z, labels, 1.0, True), strict=True):
        torch.testing.assert_close(a, b)
    assert losses.COMPILE is False

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(losses, "COMPILE", True)
    with pytest.raises(torch.OutOfMemoryError):
        losses._or_eager(oom, losses._chunk_stats)(z, labels, 1.0, True)


@pytest.mark.parametrize("tied, lora_rank", [(True, 0), (False, 0), (True, 4)])
def test_fused_lm_head_matches_the_plain_head_under_fsdp2(tmp_path, one_rank, tied, lora_rank, monkeypatch):
    """model.use_fused_kernels (losses.fuse_lm_head): the logprobs, entropies and raw logprobs of a sharded
    (FSDP2) two-layer Qwen2 with checkpointing, at temperature 0.7, and every parameter's gradient after two
    backward passes (the head's own, tied to the embedding or not; LoRA's adapters), as with the plain head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import actor

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 10), generator=gen)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(10).expand(2, 10),
    }
    labels = torch.randint(0, 64, (2, 10), generator=gen)
    calls = {"hidden": 0, "logits": 0}

    def counted(key, real):
        def call(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        return call

    for key, name in (
        ("hidden", "token_logprobs_and_entropy_from_hidden"),
        ("logits", "token_logprobs_and_entropy"),
    ):
        monkeypatch.setattr(losses, name, counted(key, getattr(losses, name)))
    results = {}
    for fused in (False, True):
        torch.manual_seed(2)  # the same fresh LoRA adapters in both runs
        model_cfg = actor.ModelConfig(path=str(tmp_path / "m"), use_fused_kernels=fused, lora_rank=lora_rank)
        model, _ = actor.load(model_cfg, one_rank.device)
        model.train()
        for _ in range(2):
            lp, ent, raw = losses.forward_logprobs(model, batch, labels, 0.7, with_entropy=True)
            (-(lp.sum() + 0.1 * ent.sum())).backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
        # the plain path made logits twice per forward (temperature 0.7, then raw at 1); the fused one never did
        assert calls == ({"hidden": 0, "logits": 4} if not fused else {"hidden": 4, "logits": 4}), calls
        results[fused] = (lp.detach(), ent.detach(), raw, grads)
    (lp0, ent0, raw0, g0), (lp1, ent1, raw1, g1) = results[False], results[True]
    assert torch.allclose(lp0, lp1, atol=1e-6) and torch.allclose(ent0, ent1, atol=1e-6)
    assert torch.allclose(raw0, raw1, atol=1e-6) and not torch.allclose(raw1, lp1)  # raw is at temperature 1
    assert g0.keys() == g1.keys() and len(g1) > 0
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-6, rtol=1e-5), name
    if lora_rank == 0:  # the head's own gradient, from the fused kernel's backward
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        assert g1[head].abs().sum() > 0 and ("lm_head.weight" in g1) != tied
    else:
        assert all("lora" in name for name in g1)


def test_fused_lm_head_refuses_heads_that_transform_their_logits(tmp_path):
    """A config that caps or scales its logits, or a head with a bias: one line naming the reason."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="transforms its logits \\(final_logit_softcapping\\)"):
        losses.fuse_lm_head(model)
    model.config.final_logit_softcapping = None
    model.lm_head = torch.nn.Linear(32, 64, bias=True)
    with pytest.raises(ValueError, match="needs a Linear without bias"):
        losses.fuse_lm_head(model)
    model.lm_head = torch.nn.Linear(32, 64, bias=False)
    losses.fuse_lm_head(model)
    assert getattr(model, losses.FUSED_HEAD)
