"""flash_attn.ops.triton.cross_entropy's `cross_entropy_loss`, on torch kernels, for the verl bench.

verl's `logprobs_from_logits` (verl/utils/torch_functional.py) takes this kernel when flash-attn has it, as every
verl install with flash-attn does; without it verl falls back to `logprobs_from_logits_v2`, which loops in Python over
the rows of its logits. Under verl's padding-free micro-batches a row is a token, so that fallback launches one
logsumexp per token: on the H100 at 1a4c362 verl's old-logprob pass (a forward) took 26 s for 393k tokens. This
stand-in computes what the triton kernel computes, in blocks of rows:

    losses[i] = logsumexp(logits[i]) - logits[i, labels[i]]    (0 where labels[i] == ignore_index), float32
    d logits[i] = (softmax(logits[i]) - onehot(labels[i])) * grad[i]

With inplace_backward the gradient is written over the logits' own storage, as flash-attn's kernel does (verl
passes True: the logits are not needed after this loss's backward). label_smoothing, logit_scale, lse_square_scale,
precomputed_lse and process_group (vocabulary-parallel) are not here and raise NotImplementedError.
"""

from __future__ import annotations

import torch

_BLOCK_ELEMENTS = 2**26  # float32 elements a block of rows holds (256 MiB): bounds the upcast copy


def _blocks(rows: int, vocab: int) -> tuple[range, int]:
    step = max(1, _BLOCK_ELEMENTS // max(vocab, 1))
    return range(0, rows, step), step  # the block starts, rows a block


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, inplace_backward: bool):
        rows, vocab = logits.shape
        ignored = labels == ignore_index  # [N]
        safe = labels.masked_fill(ignored, 0)  # [N]
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)  # [N]
        starts, step = _blocks(rows, vocab)
        for i in starts:
            lse[i : i + step] = torch.logsumexp(logits[i : i + step].float(), dim=-1)
        picked = logits.gather(-1, safe[:, None]).squeeze(-1).float()  # [N]
        losses = (lse - picked).masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, lse, safe, ignored)
        ctx.inplace_backward = inplace_backward
        return losses

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, safe, ignored = ctx.saved_tensors
        rows, vocab = logits.shape
        # .data: the kernel writes through the pointer, unseen by autograd's version counter (as the triton one)
        out = logits.data if ctx.inplace_backward else torch.empty_like(logits)
        scale = grad.float().masked_fill(ignored, 0.0)  # [N]
        starts, step = _blocks(rows, vocab)
        for i in starts:
            j = slice(i, i + step)
            p = torch.exp(logits[j].float() - lse[j, None])  # [n, V] softmax
            p[torch.arange(p.shape[0], device=p.device), safe[j]] -= 1.0
            out[j] = (p * scale[j, None]).to(out.dtype)
        return out, None, None, None


def cross_entropy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    precomputed_lse: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    process_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of logits [N, V] against labels [N]: (losses [N] float32, z_losses [N] zeros)."""
    unsupported = dict(
        precomputed_lse=precomputed_lse is not None,
        label_smoothing=label_smoothing != 0.0,
        logit_scale=logit_scale != 1.0,
        lse_square_scale=lse_square_scale != 0.0,
        process_group=process_group is not None,
    )
    for name, given in unsupported.items():
        if given:
            raise NotImplementedError(f"flatrl's flash_attn stand-in: cross_entropy_loss has no {name}")
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy_loss wants logits [N, V] and labels [N], got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    losses = _CrossEntropy.apply(logits, labels, ignore_index, inplace_backward)
    return losses, torch.zeros_like(losses)
