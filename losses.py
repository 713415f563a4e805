"""Token-level RL math shared by grpo.py and ppo.py, the preference losses of dpo.py, and the chunked
logprob/entropy kernels of every trainer. The RL objectives themselves (PPO-clip, the value loss) live in grpo.py and
ppo.py; these are their building blocks.

Plain torch, no torch.distributed (data.py only for the model's input layout). Tensors are [B, T] (B sequences, T response positions),
`mask` (float or bool) marks response tokens; the kernels take packed rows [N, V]. Definitions match verl's
verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py on the same inputs.

- agg_loss: token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr. GRPO).
- kl_penalty: k1/k2/k3 estimators (http://joschu.net/blog/kl-approx.html), "+" suffix = straight-through.
- dpo_sigmoid_loss, ipo_loss, simpo_loss, kto_loss: dpo.py's per-pair (KTO: per-row) losses on sequence
  logprobs [P], one function per paper, TRL's formulas (trl/trainer/dpo_trainer.py, kto_trainer.py, cpo_trainer.py).
- token_logprobs_and_entropy[_from_hidden]: label logprob and entropy per row, in row chunks through one
  autograd Function, so fp32 [N, V] (from hidden states: any [N, V] logits) is never held whole; the
  backward recomputes each chunk. On request also sum_v pi_v^2 per row (no gradient), which grpo.py's
  optimal_token_baseline weighs tokens by.

Deviations from verl:
1. Counts in denominators are clamped to >= 1e-8: an all-masked micro-batch gives 0, not NaN.
2. agg_loss normalises by `global_tokens` / `global_seqs` (verl: batch_num_tokens / global_batch_size) and
   has no dp_size factor: the trainer multiplies by the world size itself when its gradient reduce averages.
3. Logprobs and entropy are always computed in fp32 (verl log_softmaxes bf16 logits in bf16).
"""

import functools
import warnings

import torch
import torch.nn.functional as F

import data

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x * mask; masked positions count as 0 even when x is NaN/inf there."""
    mask = mask.to(x.dtype)
    x = torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over mask (verl_F.masked_mean). x, mask: same shape; dim=None -> scalar, else reduces dim."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return _masked_sum(x, mask, dim) / count.clamp(min=1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Scalar variance of x over mask; unbiased applies Bessel's n/(n-1) as verl (needs >= 2 tokens)."""
    var = masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    if unbiased:
        n = mask.to(x.dtype).sum()
        if n < 2:  # verl raises too: n/(n-1) is undefined
            raise ValueError(f"masked_var(unbiased=True) needs at least 2 masked tokens, got {n.item()}")
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with mask statistics and unbiased var (verl_F.masked_whiten).

    With shift_mean=False the mean is added back (only the spread is normalised). Masked positions are
    transformed too, not zeroed, as in verl. Returns the shape of x."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Aggregate a [B, T] loss matrix into a scalar (verl core_algos.agg_loss).

    Modes, with S_i = sum_t mask*loss of row i, n_i its token count:
      token-mean              sum_i S_i / (global_tokens or sum_i n_i)
      seq-mean-token-sum      sum_i S_i / (global_seqs or B)
      seq-mean-token-mean     sum_i (S_i / n_i) / (global_seqs or B)
      seq-mean-token-sum-norm sum_i (S_i / norm_length) / (global_seqs or B)   (Dr. GRPO, arXiv:2503.20783)
    norm_length is verl's loss_scale_factor, default T = loss_mat.shape[-1] as verl: pass the configured max
    response length to keep it constant. B counts every row, fully masked ones too (verl since PR #4510).

    global_tokens / global_seqs: token / sequence counts of the whole optimiser mini-batch (all micro-batches,
    all ranks). Each call then returns its micro-batch's share of the global mean, and the shares summed
    (gradient accumulation, SUM all-reduce) give the mini-batch loss whatever the split. FSDP's reduce
    AVERAGES over ranks: multiply by the world size (verl's dp_size) before backward. Without them the
    batch's own counts are used."""
    if loss_agg_mode == "token-mean":
        count = mask.to(loss_mat.dtype).sum().clamp(min=1e-8) if global_tokens is None else global_tokens
        return _masked_sum(loss_mat, mask) / count
    seq_sums = _masked_sum(loss_mat, mask, dim=-1)  # [B]
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = seq_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_sums / (mask.to(loss_mat.dtype).sum(-1) + 1e-8)  # verl's epsilon
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = seq_sums / (loss_mat.shape[-1] if norm_length is None else norm_length)
    else:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {AGG_MODES}")
    return seq_losses.sum() / (loss_mat.shape[0] if global_seqs is None else global_seqs)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate [B, T] from sampled-token logprobs (verl core_algos.kl_penalty).

    kl|k1: d = logprobs - ref_logprobs;  abs: |d|;  mse|k2: d^2 / 2;
    low_var_kl|k3: exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10] as verl.
    A "+" suffix (k1+, k3+, low_var_kl+, ...) keeps that value in the forward but takes k2's gradient,
    which is unbiased for the KL gradient (verl's straight-through variant)."""
    straight_through = kl_type.endswith("+") and kl_type not in ("mse+", "k2+")
    name = kl_type[:-1] if kl_type.endswith("+") else kl_type
    d = logprobs - ref_logprobs  # [B, T]
    if name in ("kl", "k1"):
        kl = d
    elif name == "abs":
        kl = d.abs()
    elif name in ("mse", "k2"):
        kl = 0.5 * d.square()
    elif name in ("low_var_kl", "k3"):
        neg_d = torch.clamp(-d, min=-20.0, max=20.0)
        kl = torch.clamp(torch.exp(neg_d) - neg_d - 1.0, min=-10.0, max=10.0)
    else:
        raise ValueError(f"unknown kl_type {kl_type!r}; expected kl|k1 abs mse|k2 low_var_kl|k3 [+]")
    if not straight_through:
        return kl
    k2 = 0.5 * d.square()
    return k2 - k2.detach() + kl.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, in fp32: [..., V] -> [...]. Materialises all of it."""
    logits = logits.float()
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] in fp32: logits [..., V], labels [...] -> [...]. Materialises all of it."""
    return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


COMPILE = True
"""On CUDA, run the per-chunk math below through torch.compile: one fused kernel reads the bf16 logits once per
direction instead of ~10 fp32 [chunk, V] passes (H200, 0.5B GRPO update: 6.1 -> 5.1 s). Eager elsewhere, and
everywhere when False."""


def _chunk_stats(
    z: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    with_sum_pi_squared: bool = False,
):
    """(lse, logprob of labels, entropy or None, sum_j p_j^2 or None) of one chunk of logits z [n, V] (any float
    dtype), fp32 math, p = softmax(z / temperature)."""
    z = z.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, -1)  # [n]
    logprobs = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, -1) * z).sum(-1) if with_entropy else None  # H = lse - sum_j p_j z_j
    # p_j^2 = exp(2 (z_j - lse)): one chunk-sized temporary, never a whole [N, V]
    sum_pi_squared = torch.exp(2.0 * (z - lse.unsqueeze(-1))).sum(-1) if with_sum_pi_squared else None  # [n]
    return lse, logprobs, entropy, sum_pi_squared


def _chunk_grad(z, labels, lse, entropy, g_lp, g_ent, temperature: float) -> torch.Tensor:
    """d(g_lp . logprob + g_ent . entropy)/dz for one chunk of logits z [n, V], in z's dtype (fp32 math, two
    [n, V] buffers in eager). d logprob_i / dz_j = 1[j = label] - p_j;  d H / dz_j = -p_j (log p_j + H); both
    divided by the temperature. g_lp or g_ent may be None."""
    logp = z.to(torch.float32, copy=True)  # a fresh copy: the in-place ops below must not touch z
    if temperature != 1.0:
        logp.div_(temperature)
    logp.sub_(lse.unsqueeze(-1))  # [n, V]
    p = logp.exp()
    if g_ent is None:
        grad = p.mul_(-g_lp.unsqueeze(-1))
    else:
        coef = logp.add_(entropy.unsqueeze(-1)).mul_(-g_ent.unsqueeze(-1))
        if g_lp is not None:
            coef.sub_(g_lp.unsqueeze(-1))
        grad = coef.mul_(p)  # p * (-g_lp - g_ent (log p + H))
    if g_lp is not None:
        grad.scatter_add_(-1, labels.unsqueeze(-1), g_lp.unsqueeze(-1))
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(z.dtype)


def _or_eager(compiled, eager):
    """`compiled`, or `eager` from the first failure on (a GPU without a working Triton or C compiler): a warning
    names the error, and COMPILE turns False for the rest of the process. Out-of-memory errors propagate."""

    def call(*args):
        global COMPILE
        if COMPILE:
            try:
                return compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:
                COMPILE = False
                warnings.warn(
                    f"losses: the torch.compile'd logprob kernels failed ({type(e).__name__}: {e}); running them "
                    "eagerly from now on (losses.COMPILE = False), slower and with more memory",
                    stacklevel=2,
                )
        return eager(*args)

    return call


@functools.cache
def _compiled() -> tuple:
    """_chunk_stats and _chunk_grad through torch.compile (compiled at first call, per shape class)."""
    return (
        _or_eager(torch.compile(_chunk_stats, fullgraph=True), _chunk_stats),
        _or_eager(torch.compile(_chunk_grad, fullgraph=True), _chunk_grad),
    )


def _kernels(device: torch.device) -> tuple:
    return _compiled() if COMPILE and device.type == "cuda" else (_chunk_stats, _chunk_grad)


def _slice(x: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    return None if x is None else x[sl]


class _ChunkedTokenStats(torch.autograd.Function):
    """logits = x (weight None) or x @ weight.T, processed `chunk_size` rows at a time both ways. Outputs
    (logprobs [N], entropy [N] or [0], sum_pi_squared [N] or [0]); the last has no gradient."""

    @staticmethod
    def forward(ctx, x, weight, labels, chunk_size, with_entropy, temperature, with_sum_pi_squared=False):
        ctx.set_materialize_grads(False)  # an unused output (entropy for metrics only) costs no backward
        stats = _kernels(x.device)[0]
        n_rows = x.shape[0]
        lse, logprobs = (x.new_empty(n_rows, dtype=torch.float32) for _ in range(2))
        entropy = x.new_empty(n_rows if with_entropy else 0, dtype=torch.float32)
        sum_pi_squared = x.new_empty(n_rows if with_sum_pi_squared else 0, dtype=torch.float32)
        for s in range(0, n_rows, chunk_size):
            sl = slice(s, s + chunk_size)
            z = x[sl] if weight is None else x[sl] @ weight.T  # [n, V]
            lse[sl], logprobs[sl], ent, sps = stats(
                z, labels[sl], temperature, with_entropy, with_sum_pi_squared
            )
            if with_entropy:
                entropy[sl] = ent
            if with_sum_pi_squared:
                sum_pi_squared[sl] = sps
        ctx.save_for_backward(x, weight, labels, lse, entropy)
        ctx.chunk_size, ctx.with_entropy, ctx.temperature = chunk_size, with_entropy, temperature
        ctx.mark_non_differentiable(sum_pi_squared)  # a statistic for the advantages, not a loss term
        return logprobs, entropy, sum_pi_squared

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_sum_pi_squared):
        x, weight, labels, lse, entropy = ctx.saved_tensors
        g_ent = g_ent if ctx.with_entropy else None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None
        chunk_grad = _kernels(x.device)[1]
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        need_w = weight is not None and ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        for s in range(0, x.shape[0], ctx.chunk_size):
            sl = slice(s, s + ctx.chunk_size)
            z = x[sl] if weight is None else x[sl] @ weight.T
            ent = _slice(entropy, sl) if g_ent is not None else None
            g = chunk_grad(z, labels[sl], lse[sl], ent, _slice(g_lp, sl), _slice(g_ent, sl), ctx.temperature)
            if weight is None:  # g: [n, V] d loss / d logits, in the input dtype
                grad_x[sl] = g
                continue
            if grad_x is not None:
                grad_x[sl] = g @ weight
            if need_w:
                grad_w.add_(g.T @ x[sl])  # fp32 accumulation over chunks, no fp32 [V, H] temporary
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprob of `labels` and entropy of softmax(logits / temperature), in row chunks.

    logits [..., V] (bf16 or fp32, usually packed [N, V]), labels [...] int64 valid ids (mask afterwards).
    Each chunk of `chunk_size` rows is upcast to fp32 alone, forward and backward, so peak extra memory is
    a few fp32 [chunk_size, V] buffers. Differentiable w.r.t. logits; the gradient has the logits' dtype.
    Returns (logprobs, entropy or None), fp32, shaped like labels."""
    return token_stats(logits, labels, chunk_size, with_entropy, temperature)[:2]


def token_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    temperature: float = 1.0,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """token_logprobs_and_entropy, and with `with_sum_pi_squared` also sum_v p_v^2 per token, p = softmax(logits /
    temperature), from the same chunks (verl's calculate_sum_pi_squared_from_logits; grpo.py's
    optimal_token_baseline weighs tokens by it). That third output has no gradient. Returns (logprobs, entropy or
    None, sum_pi_squared or None), fp32, shaped like labels."""
    rows, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    lp, ent, sps = _ChunkedTokenStats.apply(
        rows, None, flat_labels, chunk_size, with_entropy, temperature, with_sum_pi_squared
    )
    shaped = lambda t, on: t.view(labels.shape) if on else None  # noqa: E731
    return lp.view(labels.shape), shaped(ent, with_entropy), shaped(sps, with_sum_pi_squared)


def token_logprobs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As token_logprobs_and_entropy, with logits = hidden @ weight.T computed one chunk at a time.

    hidden [..., H] (the final hidden states), weight [V, H] (lm_head, unsharded, no bias), labels [...].
    Neither fp32 nor bf16 [N, V] logits are ever materialised; the backward recomputes each chunk's logits
    and accumulates the weight gradient in fp32 (one [V, H] fp32 buffer). Differentiable w.r.t. hidden and
    weight. Returns (logprobs, entropy or None), fp32, shaped like labels."""
    rows, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    lp, ent, _ = _ChunkedTokenStats.apply(rows, weight, flat_labels, chunk_size, with_entropy, temperature)
    return lp.view(labels.shape), ent.view(labels.shape) if with_entropy else None


def forward_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 1024,
    with_raw: bool = True,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The model's per-token logprob of `labels` (and entropy) on a collated batch, padded or packed.

    Args:
        batch: as data.pad_batch / data.pack_batch make them (a packed batch without its N x N mask runs
            the model's variable-length attention: data.model_inputs).
        labels: [B, T] next-token ids (data.shift_labels).
    Returns:
        (logprobs [B, T] of softmax(logits / temperature), entropy [B, T] or None, raw_logprobs [B, T] at
        temperature 1 — what vLLM reports, for the weight-push check; the first tensor, detached, when
        temperature is 1; None without `with_raw` at another temperature, which spares a pass over the logits).
        All fp32; callers mask them with their label mask. With `with_sum_pi_squared` a fourth tensor follows:
        sum_v p_v^2 [B, T] at `temperature`, no gradient (token_stats; not with the fused head).
    """
    if getattr(model, FUSED_HEAD, False):
        if with_sum_pi_squared:
            raise ValueError(
                "sum_pi_squared is not computed with model.use_fused_kernels (the fused head; verl refuses "
                "calculate_sum_pi_squared with fused kernels too): set model.use_fused_kernels=false"
            )
        return _fused_forward_logprobs(model, batch, labels, temperature, with_entropy, chunk_size, with_raw)
    logits = model(**data.model_inputs(batch)).logits  # [B, T, V]
    extra = ()
    if with_sum_pi_squared:  # from the same chunks as the logprobs
        lp, ent, sps = token_stats(logits, labels, chunk_size, with_entropy, temperature, True)
        extra = (sps,)
    else:
        lp, ent = token_logprobs_and_entropy(logits, labels, chunk_size, with_entropy, temperature)
    if temperature == 1.0:
        return lp, ent, lp.detach(), *extra
    if not with_raw:
        return lp, ent, None, *extra
    with torch.no_grad():
        raw = token_logprobs_and_entropy(logits, labels, chunk_size, False, 1.0)[0]
    return lp, ent, raw, *extra


FUSED_HEAD = "flatrl_fused_lm_head"
"""The model attribute `fuse_lm_head` sets: forward_logprobs then never makes the [B, T, V] logits."""
# Config fields of architectures whose logits are more than lm_head(hidden): the fused path would skip that step.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def fuse_lm_head(model: torch.nn.Module) -> None:
    """Makes forward_logprobs on `model` compute each row chunk's logits from the final hidden states and the LM
    head's weight (token_logprobs_and_entropy_from_hidden) inside the model's forward, in place of the head: no
    [B, T, V] logits, nor their gradient, are ever held (at 16,384 tokens and Qwen's 151,936 ids, 9.3 GiB in bf16);
    the backward recomputes each chunk's logits. The head runs inside the model's own forward, so FSDP2's gathered
    weight and its gradient hooks are the ones the plain head would use. Refused, with the reason, where the
    logits are not the head's plain matmul (a bias, softcapping or scaling in the config)."""
    head = model.get_output_embeddings()
    name = type(model.config).__name__
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"model.use_fused_kernels: {name}'s output layer is {type(head).__name__} with a bias or not "
                         "a Linear; the fused head needs a Linear without bias")  # fmt: skip
    transforms = [k for k in _LOGIT_TRANSFORMS if getattr(model.config, k, None) not in (None, 1.0)]
    if transforms:
        raise ValueError(f"model.use_fused_kernels: {name} transforms its logits ({', '.join(transforms)}); the fused "
                         "head computes lm_head(hidden) only")  # fmt: skip
    _head_place(model, head)
    setattr(model, FUSED_HEAD, True)


def _head_place(model: torch.nn.Module, head: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the module that holds `head` as a child, the child's name): where the fused head goes for a forward."""
    for module in model.modules():
        for attr, child in module.named_children():
            if child is head:
                return module, attr
    raise ValueError(
        f"model.use_fused_kernels: the output layer of {type(model).__name__} is not one of its modules"
    )


class _FusedHead(torch.nn.Module):
    """Stands in for the LM head during one forward: (logprob, entropy) per token from the hidden states."""

    def __init__(
        self, head: torch.nn.Linear, labels, temperature, with_entropy, chunk_size, with_raw
    ) -> None:
        super().__init__()
        self.__dict__["head"] = head  # not a child module: the parameter names stay the model's
        self.args = (labels, chunk_size, with_entropy, temperature)
        self.with_raw, self.raw = with_raw, None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        labels, chunk_size, with_entropy, temperature = self.args
        weight = self.head.weight
        lp, ent = token_logprobs_and_entropy_from_hidden(
            hidden, weight, labels, chunk_size, with_entropy, temperature
        )
        if self.with_raw and temperature != 1.0:
            with torch.no_grad():
                self.raw = token_logprobs_and_entropy_from_hidden(
                    hidden, weight, labels, chunk_size, False, 1.0
                )[0]
        # Returned as the model's logits, so that its output is what the loss reads (FSDP2's backward hooks
        # hang on the root module's outputs).
        return lp.unsqueeze(-1) if ent is None else torch.stack([lp, ent], -1)


def _fused_forward_logprobs(model, batch, labels, temperature, with_entropy, chunk_size, with_raw):
    """forward_logprobs with the LM head swapped for _FusedHead for one forward (fuse_lm_head)."""
    head = model.get_output_embeddings()
    owner, attr = _head_place(model, head)
    fused = _FusedHead(head, labels, temperature, with_entropy, chunk_size, with_raw)
    setattr(owner, attr, fused)
    try:
        out = model(**data.model_inputs(batch)).logits  # [B, T, 1 or 2]
    finally:
        setattr(owner, attr, head)
    lp, ent = out[..., 0], out[..., 1] if with_entropy else None
    if temperature == 1.0:
        return lp, ent, lp.detach()
    return lp, ent, fused.raw


# ------------------------------------------------------------------------------ preference losses (dpo.py)
# Inputs are sequence logprobs [P] (P pairs, or KTO rows): the sum of the completion's token logprobs (the IPO and
# SimPO recipes pass the mean instead: dpo.py's `length_normalised`). Each returns the per-pair loss [P]; dpo.py
# takes the mean over the global batch.


def dpo_sigmoid_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7), with conservative DPO's label smoothing (cDPO,
    Mitchell 2023: the label is flipped with probability eps):

        h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))
        loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)

    Args: logprobs [P] of the chosen (y_w) and rejected (y_l) completions under the policy and the reference;
    beta the strength of the implicit KL constraint; label_smoothing eps in [0, 0.5).
    Returns: loss [P]."""
    h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)  # [P]
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def ipo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """IPO (Azar et al. 2023, arXiv:2310.12036, eq. 17), a squared loss that regresses the log-ratio margin to
    1 / (2 beta) (beta is the paper's tau) instead of pushing it to infinity:

        h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))
        loss = (h - 1 / (2 beta))^2

    TRL feeds it per-token mean logprobs, and so does dpo.py (the paper's are sums). Returns: loss [P]."""
    h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)  # [P]
    return (h - 1 / (2 * beta)) ** 2


def simpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """SimPO (Meng et al. 2024, arXiv:2405.14734, eq. 6), reference-free, on length-normalised logprobs
    (chosen_logps = log pi(y_w|x) / |y_w|) with a target margin gamma; label smoothing as cDPO (TRL's CPO trainer):

        h = beta * (chosen_logps - rejected_logps) - gamma
        loss = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)

    Returns: loss [P]."""
    h = beta * (chosen_logps - rejected_logps) - gamma  # [P]
    return -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024, arXiv:2402.01306, eq. 8) on unpaired rows:

        r = log pi(y|x) - log pi_ref(y|x)
        z0 = max(0, KL estimate)              (given: `kl`, no gradient flows through it)
        v = sigmoid(beta (r - z0)) if y is desirable, sigmoid(beta (z0 - r)) if undesirable
        loss = lambda_y (1 - v)               (lambda_D = desirable_weight, lambda_U = undesirable_weight)

    The KL estimate (the paper's section 4.1, TRL's KTOTrainer) is the batch mean of log pi(y'|x) -
    log pi_ref(y'|x) over mismatched pairs: each prompt with another row's completion; dpo.py computes it over
    the global batch and clamps it at 0.
    Args: logps, ref_logps [B]; desirable [B] bool (the row's label); kl a scalar. Returns: loss [B]."""
    r = logps - ref_logps  # [B]
    z0 = torch.as_tensor(kl, dtype=r.dtype, device=r.device).detach().clamp(min=0)
    good = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))  # [B]
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))  # [B]
    return torch.where(desirable, good, bad)
