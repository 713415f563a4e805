"""flash_attn.bert_padding's four helpers, in plain torch (flatrl's flash_attn stand-in; see the package docstring)."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x[indices] along the first axis (differentiable: indexing has its own backward)."""
    return x[indices]


def unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """The tokens of [B, L, ...] where the [B, L] mask (plus `unused_mask`, tokens kept but not attended) is set.

    Returns (tokens [N, ...], their flat indices [N], cu_seqlens [B + 1] int32, the longest row, each row's count
    of attention_mask tokens [B] int32), as flash-attn 2.7+.
    """
    kept = attention_mask if unused_mask is None else attention_mask + unused_mask
    lengths = kept.sum(-1, dtype=torch.int32)  # [B]
    indices = kept.flatten().nonzero().flatten()  # [N]
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(lengths.max()), attention_mask.sum(-1, dtype=torch.int32)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """unpad_input's inverse: tokens [N, ...] back into [batch, seqlen, ...], zeros where no token was kept."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def rearrange(*args, **kwargs):
    """einops.rearrange (flash-attn re-exports it here; verl imports it from this module)."""
    from einops import rearrange as einops_rearrange

    return einops_rearrange(*args, **kwargs)
