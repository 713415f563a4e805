"""flash_attn.ops: what verl imports of it (triton.cross_entropy), on torch kernels."""
