"""Ulysses sequence parallelism (DeepSpeed-Ulysses, arXiv:2309.14509): one packed micro-batch split over SP ranks.

`model.fsdp_config.ulysses_sequence_parallel_size` = SP > 1 groups SP consecutive ranks (a [world / SP, SP] mesh
named ("dp", "sp"), beside FSDP's own mesh). Every rank of a group holds the same micro-batch; each runs the model
on 1/SP of its tokens:

    tokens [N] --pad to a multiple of SP, slice--> [N / SP] per rank
    embeddings, MLP, norms, logits: on the rank's own tokens (RoPE with the global position ids)
    attention: all-to-all [H, N / SP, D] -> [H / SP, N, D]   (sequence shards in, head shards out)
               causal varlen attention over the whole packed row (cu_seqlens of all N tokens)
               all-to-all [H / SP, N, D] -> [H, N / SP, D]   (back to sequence shards)
    per-token outputs (logprobs, entropy, values) all-gathered to [N], so the loss is the SP=1 one

    sp.setup(model, size, device.type, packed)         # after load_model, before fsdp.shard_model
    lp, ent, raw = sp.forward_logprobs(model, batch, labels, temperature, with_entropy)   # = losses.forward_logprobs
    values = sp.forward_logits(critic, batch)          # [B, T, 1] for the critic (logits gathered: small)

Gradients: every rank of a group computes the same loss; the gather's backward keeps the rank's own slice, the
all-to-alls route the rest, so the group's parameter gradients sum to the micro-batch's gradient. FSDP averages
over all ranks, so trainers keep `loss * world_size` and count each group's tokens once (`all_reduce(x) / SP`).

A model under SP run any other way (e.g. `model(**data.model_inputs(batch))` on whole sequences) raises ValueError
in its attention instead of mixing the ranks' batches.

The patch is an attention function registered with transformers (ULYSSES), not a fork of a model file: any model
whose attention layers call `ALL_ATTENTION_FUNCTIONS` takes it. Query heads must divide by SP; KV heads that do not
are repeated up to lcm(KV heads, SP) (which must divide the query heads), as verl's repeat_kv does.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import attention
import data
import fsdp
import losses

ULYSSES = "flatrl_ulysses"
"""attn_implementation of a model under sequence parallelism: all-to-all, attention.varlen, all-to-all."""
_row_tokens: int | None = None
"""The padded row length of the last batch shard_batch cut, which the attention checks its inputs against (kept
after the forward: gradient checkpointing reruns the attention in the backward)."""


def check_heads(model_config: Any, size: int) -> None:
    """Raises ValueError (naming the model's head counts) when attention heads cannot be split over `size` ranks."""
    heads = model_config.num_attention_heads
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    if heads % size or heads % math.lcm(kv, size):
        raise ValueError(
            f"ulysses_sequence_parallel_size={size} cannot split the model's attention: "
            f"num_attention_heads={heads}, num_key_value_heads={kv}; SP must divide num_attention_heads, and "
            f"lcm(num_key_value_heads, SP) must divide num_attention_heads (KV heads are repeated up to it)"
        )


def group_of(model: nn.Module) -> dist.ProcessGroup | None:
    """The SP group `setup` gave the model, or None (SP = 1)."""
    return getattr(model, "_flatrl_sp_group", None)


def size_of(model: nn.Module) -> int:
    """The model's SP degree (1 without sequence parallelism)."""
    g = group_of(model)
    return 1 if g is None else dist.get_world_size(g)


def data_parallel(size: int) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel degree) when groups of `size` ranks share data."""
    return dist.get_rank() // size, dist.get_world_size() // size


def setup(model: nn.Module, size: int, device_type: str, packed: bool) -> nn.Module:
    """Puts `model` under SP of degree `size` (collective); a no-op for size 1. Returns the model.

    Checks the head counts and the layout (`packed`: use_remove_padding, which SP needs), switches the model's
    attention to ULYSSES (saying on stderr when that replaces an attn_implementation other than sdpa), and
    records the SP group on every module (the attention function reads it).
    """
    if size == 1:
        return model
    if not packed:
        raise ValueError(
            "ulysses_sequence_parallel_size > 1 needs packed batches: set model.use_remove_padding=true"
        )
    check_heads(model.config, size)
    impl = model.config._attn_implementation
    if impl not in ("sdpa", attention.VARLEN) and dist.get_rank() == 0:
        print(
            f"ignored: attn_implementation={impl} (sequence parallelism runs flatrl's varlen attention between "
            "its all-to-alls)",
            file=sys.stderr,
        )
    group = fsdp.sp_mesh(device_type, size).get_group("sp")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ULYSSES, ulysses_attention_forward)
    AttentionMaskInterface.register(ULYSSES, attention._varlen_mask)
    model.config._attn_implementation = ULYSSES
    for m in model.modules():
        m._flatrl_sp_group = group
    return model


# ------------------------------------------------------------------------------------------ all-to-all


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x [P, ...] -> out [P, ...] with out[i] = rank i's x[my rank] (P = group size)."""
    x = x.contiguous()
    out = torch.empty_like(
        x
    )  # contiguous too (empty_like keeps a view's strides, which the collective ignores)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[H, n, D] (all heads, this rank's n tokens) -> [H / P, P * n, D] (this rank's heads, all tokens)."""
    P, (H, n, D) = dist.get_world_size(group), x.shape
    y = _all_to_all(x.reshape(P, H // P, n, D), group)  # [P (source rank = sequence shard), H / P, n, D]
    return y.transpose(0, 1).reshape(H // P, P * n, D)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[H / P, P * n, D] -> [H, n, D]; the inverse of _seq_to_heads."""
    P, (h, N, D) = dist.get_world_size(group), x.shape
    y = x.reshape(h, P, N // P, D).transpose(0, 1)  # [P (destination = sequence shard), H / P, n, D]
    return _all_to_all(y, group).reshape(P * h, N // P, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(g, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(g, ctx.group), None


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function behind ULYSSES. query [1, Hq, n, D], key/value [1, Hkv, n, D] hold this
    rank's n tokens; kwargs' cu_seq_lens_q / max_length_q describe all P * n tokens. Returns ([1, n, Hq, D], None)."""
    group = module._flatrl_sp_group
    P = dist.get_world_size(group)
    # a caller that ran the model on whole sequences (not through forward_logprobs / forward_logits) would
    # otherwise mix the ranks' different batches
    if attention_mask is not None or _row_tokens != P * query.shape[2]:
        raise ValueError(
            "this model runs under sequence parallelism: call it through sp.forward_logprobs or "
            "sp.forward_logits (its inputs must be a packed batch cut by sp.shard_batch)"
        )
    q, k, v = query[0], key[0], value[0]  # [H, n, D]
    if k.shape[0] % P:  # repeat KV heads up to lcm(Hkv, P); grouping is kept (head j -> j*r .. j*r + r - 1)
        r = math.lcm(k.shape[0], P) // k.shape[0]
        k, v = k.repeat_interleave(r, dim=0), v.repeat_interleave(r, dim=0)
    q, k, v = (_SeqToHeads.apply(t, group)[None] for t in (q, k, v))  # [1, H / P, N, D]
    kwargs.pop("position_ids", None)  # local ids; cu_seqlens already describe the whole row
    out, _ = attention.varlen_attention_forward(module, q, k, v, None, **kwargs)  # [1, N, Hq / P, D]
    out = _HeadsToSeq.apply(out[0].transpose(0, 1), group)  # [Hq, n, D]
    return out.transpose(0, 1)[None], None  # [1, n, Hq, D]


# ---------------------------------------------------------------------------------------- inputs, outputs


class _Gather(torch.autograd.Function):
    """All-gathers [B, n, ...] slices along dim 1; backward keeps this rank's slice (every rank of the group
    computes the same loss from the gathered tensor, so no reduction)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.n = group, x.shape[1]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        r = dist.get_rank(ctx.group)
        return g[:, r * ctx.n : (r + 1) * ctx.n].contiguous(), None


def shard_batch(
    batch: dict[str, torch.Tensor], group: dist.ProcessGroup
) -> tuple[dict[str, Any], slice, int]:
    """This rank's slice of a packed batch (data.pack_batch, with or without its N x N mask).

    The row of N tokens is padded to a multiple of P (the pad is one more sequence in cu_seqlens, positions
    0, 1, ...) and cut into P slices of n. Returns (model inputs for data.model_inputs: input_ids and
    position_ids [1, n], cu_seqlens [S + 1 or S + 2] and max_seqlen of the whole padded row; the slice of this
    rank in the padded row; N).
    """
    global _row_tokens
    if "cu_seqlens" not in batch:
        raise ValueError("sequence parallelism needs packed batches: set model.use_remove_padding=true")
    P, r = dist.get_world_size(group), dist.get_rank(group)
    ids, pos, cu = batch["input_ids"], batch["position_ids"], batch["cu_seqlens"]  # [1, N], [1, N], [S + 1]
    N = ids.shape[1]
    pad = -N % P
    longest = int(batch["max_seqlen"])
    if pad:
        ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)  # [1, N + pad]
        pos = torch.cat([pos, torch.arange(pad, device=pos.device)[None]], dim=1)
        cu = torch.cat([cu, cu.new_tensor([N + pad])])
        longest = max(longest, pad)
    n = (N + pad) // P
    _row_tokens = N + pad
    mine = slice(r * n, (r + 1) * n)
    local = dict(input_ids=ids[:, mine], position_ids=pos[:, mine], cu_seqlens=cu, max_seqlen=longest)
    return local, mine, N


def _slice(x: torch.Tensor, mine: slice, N: int) -> torch.Tensor:
    """[B, N, ...] -> this rank's [B, n, ...] of the row padded (with zeros) to P * n."""
    need = max(0, mine.stop - N)
    if need:
        x = torch.cat([x, x.new_zeros(x.shape[0], need, *x.shape[2:])], dim=1)
    return x[:, mine]


def gather(x: torch.Tensor, group: dist.ProcessGroup, N: int) -> torch.Tensor:
    """This rank's per-token [B, n, ...] -> the group's [B, N, ...] (pad dropped); differentiable."""
    return _Gather.apply(x, group)[:, :N]


def forward_logprobs(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_raw: bool = True,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """losses.forward_logprobs under the model's SP (the same call without it): the logits of this rank's
    tokens only ([1, n, V]: the vocabulary-sized tensor is split too), the per-token results gathered to [1, N]
    (with `with_sum_pi_squared`, a fourth: sum_v p_v^2, as losses.forward_logprobs)."""
    group = group_of(model)
    kw = dict(with_raw=with_raw, with_sum_pi_squared=with_sum_pi_squared)
    if group is None:
        return losses.forward_logprobs(model, batch, labels, temperature, with_entropy, **kw)
    local, mine, N = shard_batch(batch, group)
    lp, ent, raw, *sps = losses.forward_logprobs(
        model, local, _slice(labels, mine, N), temperature, with_entropy, **kw
    )
    lp = gather(lp, group, N)  # [1, N]
    ent = None if ent is None else gather(ent, group, N)
    extra = tuple(gather(t, group, N) for t in sps)  # [1, N] or nothing
    if temperature == 1.0:  # raw is lp, detached (losses.forward_logprobs): no second gather
        return lp, ent, lp.detach(), *extra
    return lp, ent, None if raw is None else gather(raw, group, N), *extra


def forward_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits [B, T, V] on a collated batch, under its SP (gathered: for small heads, e.g. the critic's
    V = 1), else the plain forward."""
    group = group_of(model)
    if group is None:
        return model(**data.model_inputs(batch)).logits
    local, _, N = shard_batch(batch, group)
    return gather(model(**data.model_inputs(local)).logits, group, N)


def share_samples(model: nn.Module, samples: list, n_prompts: int) -> tuple[list, int, list[int]]:
    """The samples of every rank of the model's SP group, on each of them: the same micro-batches then reach the
    whole group (RL: each rank generated its own). Without SP: (samples, n_prompts, their positions).

    Args:
        samples: this rank's actor.Sample list, `group` indexing its n_prompts prompts.
    Returns:
        (copies of the group's samples in rank order, each `group` shifted past the earlier ranks' prompts; the
        group's prompt count; the positions of this rank's own samples in that list).
    """
    group = group_of(model)
    if group is None:
        return samples, n_prompts, list(range(len(samples)))
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (samples, n_prompts), group=group)
    out, offset, mine = [], 0, []
    for r, (theirs, n) in enumerate(every):
        if r == dist.get_rank(group):
            mine = list(range(len(out), len(out) + len(theirs)))
        out += [dataclasses.replace(s, group=s.group + offset) for s in theirs]
        offset += n
    return out, offset, mine
