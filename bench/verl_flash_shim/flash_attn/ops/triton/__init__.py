"""flash_attn.ops.triton: cross_entropy only (verl's logprobs_from_logits)."""
