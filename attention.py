"""Padding-free attention for training: `VARLEN`, what `load_model`'s attn_implementation="sdpa" becomes on CUDA.

`VARLEN` ("flatrl_varlen") is transformers' sdpa for padded batches and dense masks, and for padding-free batches
(data.pack_batch(mask_dtype=None), which passes `cu_seq_lens_q`) torch's variable-length flash kernel,
`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, no extra install; it skips the blocks the causal document
mask removes and needs no N x N mask). Without that kernel (CPU, fp32, an older torch) the packed rows are
scattered into [S, L] and run through sdpa with is_causal, which is exact too (right padding never reaches a
real token).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VARLEN = "flatrl_varlen"
"""attn_implementation of sdpa with the padding-free path (no "sdpa"/"flash" in the name: transformers keys
its own checks on those substrings)."""


@functools.cache
def _torch_varlen() -> tuple[Any, dict[str, Any], bool, bool] | None:
    """torch's varlen_attn and how to call it causally: (fn, causal kwargs, takes enable_gqa, takes scale).

    Its signature moved between releases: torch 2.10 has `is_causal`, later ones `window_size=(-1, 0)`, and
    `enable_gqa` appeared later still, so the call is built from the signature. None when there is no such API.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


def _varlen_by_padding(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float | None
) -> torch.Tensor:
    """Causal attention within each packed sequence via sdpa on a [S, H, L, D] copy. [N, H, D] -> [N, Hq, D].

    Exact: each sequence is right-padded to L, and under a causal mask a real query never sees a later pad.
    """
    lens = cu.diff().long()  # [S]
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), lens)  # [N]
    pos = torch.arange(q.shape[0], device=q.device) - cu[:-1].long()[seq]  # [N]

    def pad(t: torch.Tensor) -> torch.Tensor:  # [N, H, D] -> [S, H, L, D]
        out = t.new_zeros(lens.numel(), longest, *t.shape[1:])
        out[seq, pos] = t
        return out.transpose(1, 2)

    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)[seq, pos]  # [N, Hq, D]


def causal_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float | None
) -> torch.Tensor:
    """Causal self-attention within each of S packed sequences.

    Args:
        q [N, Hq, D], k and v [N, Hkv, D] (Hq a multiple of Hkv); cu [S + 1] int32 sequence starts, then N;
        longest: the longest sequence; scale: softmax scale (None: 1 / sqrt(D)).
    Returns:
        [N, Hq, D]. torch's flash varlen kernel for bf16/fp16 CUDA tensors, else `_varlen_by_padding`.
    """
    api = _torch_varlen() if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None
    if api is None:
        return _varlen_by_padding(q, k, v, cu, longest, scale)
    fn, kwargs, takes_gqa, takes_scale = api
    kwargs = dict(kwargs)
    if q.shape[1] != k.shape[1]:
        if takes_gqa:
            kwargs["enable_gqa"] = True
        else:  # an API without enable_gqa documents equal head counts: give it them
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if takes_scale:
        kwargs["scale"] = scale
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest, **kwargs)


def _cu_seqlens_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[1, N] position ids restarting at 0 per sequence -> (cu_seqlens [S + 1] int32, longest). Syncs."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().reshape(-1)
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).int()
    return cu, int(cu.diff().max())


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (AttentionInterface) behind VARLEN.

    query [B, Hq, T, D], key/value [B, Hkv, T, D]. A padding-free call (B = 1, no mask, no cache) with
    `cu_seq_lens_q` / `max_length_q` (data.model_inputs), or with position ids restarting per sequence, runs
    `causal_varlen_attention`; anything else (a padding mask, a dense packed mask, decoding) is transformers'
    sdpa unchanged. Returns (attn_output [B, T, Hq, D], None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    positions = kwargs.get("position_ids")
    plain = attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
    if plain and cu is None and positions is not None and query.shape[2] > 1:
        cu, longest = _cu_seqlens_from_positions(positions)  # a caller that passed packed positions only
    if not plain or cu is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout or kwargs.get("sliding_window"):
        raise NotImplementedError("flatrl_varlen attention has no dropout or sliding window")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    out = causal_varlen_attention(q, k, v, cu.to(torch.int32), int(longest), scaling)  # [N, Hq, D]
    return out[None], None


def _varlen_mask(
    *args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any
) -> torch.Tensor | None:
    """Mask function of VARLEN: none without a padding mask (the kernel masks by cu_seqlens), else sdpa's."""
    from transformers.masking_utils import sdpa_mask

    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_varlen_attention() -> str:
    """Registers VARLEN with transformers (attention and mask functions); idempotent. Returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, _varlen_mask)
    return VARLEN
