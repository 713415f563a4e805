"""model.compile_layers: each decoder layer's forward through torch.compile (fsdp.compile_layers). On CPU the
graphs are captured with aot_eager: these tests check what compiling must not change (logprobs, gradients,
parameter names, the activation recomputation) and that the layers really ran compiled, not the speed."""

from __future__ import annotations

import pytest
import torch

import actor
import data
import losses


def _packed(lens: list[int], vocab: int, seed: int) -> tuple[dict, torch.Tensor]:
    """A padding-free micro-batch of sequences of `lens` tokens (no N x N mask: the varlen layout) and its
    next-token labels."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    batch = data.pack_batch(seqs, [[1] * n for n in lens], mask_dtype=None)
    labels, _ = data.shift_labels(batch)
    return batch, labels


def _run(
    path: str, device: torch.device, compiled: bool, lora_rank: int = 0
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Three packed micro-batches of different lengths through a checkpointed policy: their logprobs and
    the summed gradients."""
    torch.manual_seed(3)  # the same fresh LoRA adapters in both runs
    cfg = actor.ModelConfig(path=path, compile_layers=compiled, lora_rank=lora_rank)
    model, _ = actor.load(cfg, device)
    model.train()
    with torch.no_grad():  # LoRA's B starts at zero, which would leave A without a gradient to compare
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    out = []
    for seed, lens in enumerate(([5, 9, 3], [7, 11], [4, 4, 4, 6])):
        batch, labels = _packed(lens, 64, seed)
        lp, _, _ = losses.forward_logprobs(model, batch, labels, with_raw=False)
        (-lp.sum()).backward()
        out.append(lp.detach())
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_compiled_layers_give_the_eager_logprobs_and_gradients(tmp_path, one_rank, lora_rank):
    """Two layers, gradient checkpointing on (the default), three micro-batch lengths, full weights or LoRA
    (whose linear is one autograd Function): logprobs and gradients as eager to float rounding, the same
    parameter names, and the layers' forwards captured by dynamo in a few graphs (dynamic shapes), not one per
    layer and length."""
    from torch._dynamo.utils import counters
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    torch._dynamo.reset()
    counters.clear()
    lp0, g0 = _run(str(tmp_path / "m"), one_rank.device, False, lora_rank)
    assert counters["stats"]["calls_captured"] == 0
    lp1, g1 = _run(str(tmp_path / "m"), one_rank.device, True, lora_rank)
    captured, graphs = counters["stats"]["calls_captured"], counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert captured > 0 and 0 < graphs < 2 * 3, (captured, graphs)  # 2 layers x 3 lengths would be 6
    for a, b in zip(lp0, lp1, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    trained = len(list(Qwen2ForCausalLM(cfg).parameters())) if lora_rank == 0 else 2 * 7 * 2  # A, B x 7 x 2
    assert g0.keys() == g1.keys() and len(g0) == trained, sorted(g0)
    for name in g0:
        assert g0[name].abs().sum() > 0, name
        assert torch.allclose(g0[name], g1[name], atol=1e-5, rtol=1e-4), (
            name,
            (g0[name] - g1[name]).abs().max(),
        )


def test_compile_layers_refuses_ulysses():
    """The all-to-alls inside Ulysses' layers are not compiled: the pair is refused by name."""
    import fsdp

    with pytest.raises(
        ValueError, match="model.compile_layers does not go with .*ulysses_sequence_parallel_size"
    ):
        actor.ModelConfig(compile_layers=True, fsdp_config=fsdp.FSDPConfig(ulysses_sequence_parallel_size=2))


def test_a_failing_compiler_leaves_every_layer_eager_with_one_line(tiny_qwen2, one_rank, capsys):
    """A backend that fails (no working Triton, say): the first layer's call says so once, and every layer then
    runs eager, with eager's logprobs; the backend is not tried again."""
    import fsdp

    tries = []

    def broken(gm, example_inputs):
        tries.append(1)
        raise RuntimeError("no triton here")

    batch, labels = _packed([6, 3], 64, 0)
    model, _ = actor.load(actor.ModelConfig(path=str(tiny_qwen2)), one_rank.device)
    with torch.no_grad():
        eager, _, _ = losses.forward_logprobs(model, batch, labels, with_raw=False)
    torch._dynamo.reset()
    fsdp.compile_layers(model, backend=broken)
    with torch.no_grad():
        for _ in range(2):
            lp, _, _ = losses.forward_logprobs(model, batch, labels, with_raw=False)
            assert torch.equal(lp, eager)
    torch._dynamo.reset()
    assert len(tries) == 1
    lines = [x for x in capsys.readouterr().out.splitlines() if "model.compile_layers" in x]
    assert len(lines) == 1 and "no triton here" in lines[0] and "run eager from here on" in lines[0], lines


def test_compile_layers_auto_is_on_with_a_cuda_device_only(monkeypatch):
    """The default, auto: compiled with a CUDA device, eager on CPU and with Ulysses SP (where true is refused);
    true and false as they are; the three spellings parse from a command line."""
    import config
    import fsdp
    import grpo

    cfg = actor.ModelConfig()
    assert cfg.compile_layers == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not actor.compiles(cfg) and actor.compiles(actor.ModelConfig(compile_layers=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert actor.compiles(cfg) and not actor.compiles(actor.ModelConfig(compile_layers=False))
    sp = actor.ModelConfig(fsdp_config=fsdp.FSDPConfig(ulysses_sequence_parallel_size=2))
    assert not actor.compiles(sp)
    for text, want in (("auto", "auto"), ("true", True), ("false", False)):
        assert config.parse(grpo.GRPOConfig, [f"model.compile_layers={text}"]).model.compile_layers == want


def _saved_bytes_per_token(layer: torch.nn.Module, forward, hidden: int, tokens: int) -> float:
    """Bytes a token that one decoder layer's forward keeps for its backward (its input and weights not counted),
    each storage once, as the saved-tensor hooks see them."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(tokens)[None]
    rope = Qwen2RotaryEmbedding(layer.self_attn.config)(x, positions)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x, position_embeddings=rope, attention_mask=None, position_ids=positions)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    skip = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in layer.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in skip) / tokens


def test_a_compiled_layer_keeps_the_share_of_activations_the_plan_counts():
    """perf.plan's activation count for a Qwen2 layer at the 0.5B shape, eager, and compiled with inductor (the
    CUDA path's compiler and partitioner, here on CPU): what the saved-tensor hooks see is within 5% of the hand
    count, and of COMPILED_LAYER_SHARE of it (0.66: the partitioner recomputes norms, SiLU and products).
    Inductor compiles the layer in about 15 s."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    import perf

    cfg = Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, vocab_size=64
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = Qwen2DecoderLayer(cfg, 0).to(torch.bfloat16)
    shape = perf.ModelShape(
        layers=1, hidden=896, intermediate=4864, heads=14, kv_heads=2, head_dim=64, vocab=64, tied=True
    )
    planned = perf.activation_bytes_per_token(shape, 0)
    eager = _saved_bytes_per_token(layer, layer, 896, 64)
    compiled_forward = torch.compile(layer.forward)
    _saved_bytes_per_token(layer, compiled_forward, 896, 64)  # the first call compiles
    compiled = _saved_bytes_per_token(layer, compiled_forward, 896, 64)
    assert eager == pytest.approx(planned, rel=0.05), (eager, planned)
    assert compiled == pytest.approx(perf.activation_bytes_per_token(shape, 0, compiled=True), rel=0.05), (
        compiled
    )
    assert compiled < 0.75 * eager
