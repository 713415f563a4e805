"""A stand-in for the flash-attn package, for bench_e2e.py's verl peer only (bench/e2e_verl.py puts this folder on
verl's PYTHONPATH): PyPI has no flash-attn wheel for the device's torch 2.11 + CUDA 13, and without one verl falls
back to sdpa over padded micro-batches, which is not the configuration verl's users run.

What transformers' `flash_attention_2` and verl call is here, on torch's own kernels:
  - `flash_attn_varlen_func`: flatrl's `attention.causal_varlen_attention` (torch's variable-length flash kernel,
    `torch.nn.attention.varlen.varlen_attn`, for bf16/fp16 CUDA tensors; an exact padded sdpa elsewhere), the call
    verl's padding-free ("remove padding") micro-batches make through transformers;
  - `flash_attn_func`: sdpa on [B, L, H, D] batches;
  - `flash_attn.bert_padding`: unpad_input, pad_input, index_first_axis, rearrange;
  - `flash_attn.ops.triton.cross_entropy.cross_entropy_loss`: verl's logprobs_from_logits kernel, in blocks of rows
    (without it verl loops in Python over every token of a padding-free micro-batch: ops/triton/cross_entropy.py).
Anything flash-attn does that these do not (dropout, sliding windows, softcap, ALiBi, non-causal varlen, decoding from
a KV cache) raises NotImplementedError rather than compute something else. The dist-info beside this folder says
version 2.8.3+flatrl, so transformers (which wants >= 2.3.3) takes it, and the local label says what it is.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

__version__ = "2.8.3+flatrl"


def _flatrl_attention():
    """flatrl's attention.py, loaded by path under a name of its own: the repo root never goes on verl's sys.path
    (flatrl's top-level modules, data, log, rollout, ..., would shadow verl's imports)."""
    name = "_flatrl_attention"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[3] / "attention.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _refuse(what: str, dropout_p: float, window_size, softcap: float, alibi_slopes) -> None:
    if dropout_p:
        raise NotImplementedError(f"flatrl's flash_attn stand-in: {what} has no dropout (got {dropout_p})")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(
            f"flatrl's flash_attn stand-in: {what} has no sliding window (got {window_size})"
        )
    if softcap:
        raise NotImplementedError(f"flatrl's flash_attn stand-in: {what} has no softcap (got {softcap})")
    if alibi_slopes is not None:
        raise NotImplementedError(f"flatrl's flash_attn stand-in: {what} has no ALiBi")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal self-attention within each packed sequence: q [N, Hq, D], k and v [N, Hkv, D], cu_seqlens [S + 1]
    (int32 starts, then N) -> [N, Hq, D]. `deterministic` is accepted and changes nothing (torch's kernel has one
    backward)."""
    _refuse("flash_attn_varlen_func", dropout_p, window_size, softcap, alibi_slopes)
    if not causal:
        raise NotImplementedError("flatrl's flash_attn stand-in: flash_attn_varlen_func is causal only")
    if return_attn_probs or block_table is not None:
        raise NotImplementedError(
            "flatrl's flash_attn stand-in: no attention probabilities, no paged KV cache"
        )
    if cu_seqlens_k is not cu_seqlens_q and not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError(
            "flatrl's flash_attn stand-in: self-attention only (cu_seqlens_q == cu_seqlens_k)"
        )
    longest = int(max_seqlen_q)
    cu = cu_seqlens_q.to(torch.int32)
    return _flatrl_attention().causal_varlen_attention(q, k, v, cu, longest, softmax_scale)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    """Attention over a batch of equal-length rows: q [B, L, Hq, D], k and v [B, L, Hkv, D] -> [B, L, Hq, D]."""
    _refuse("flash_attn_func", dropout_p, window_size, softcap, alibi_slopes)
    if return_attn_probs:
        raise NotImplementedError("flatrl's flash_attn stand-in: no attention probabilities")
    if causal and q.shape[1] != k.shape[1]:  # flash-attn aligns the causal mask bottom-right, sdpa top-left
        raise NotImplementedError(
            "flatrl's flash_attn stand-in: causal attention needs as many queries as keys"
        )
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=softmax_scale,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)


def flash_attn_with_kvcache(*args, **kwargs):
    """Decoding from a KV cache: verl's trainer never decodes (vLLM does)."""
    raise NotImplementedError("flatrl's flash_attn stand-in: flash_attn_with_kvcache is not provided")
