"""lora.py against the base model, against its own merge, and against peft 0.21 (the compatibility proof); the
exclusions and the saved adapter a run starts from (model.exclude_modules, model.lora_adapter_path)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

import actor
from lora import (
    LoRALinear,
    adapter_state_dict,
    apply_lora,
    disabled,
    merge_lora_state_dict,
    merged_params,
    save_adapter,
    start_lora,
)

torch.set_num_threads(2)
RANK, ALPHA = 4, 8.0
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_qwen(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg).float().eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(seed))  # [B, T]


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits  # [B, T, V]


def train_a_bit(model: torch.nn.Module, ids: torch.Tensor, steps: int = 5) -> list[float]:
    """A few AdamW steps on next-token CE over the LoRA params only; returns the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trained():
    """(base model, trained LoRA model, input ids, losses): all-linear LoRA after 5 AdamW steps."""
    base = tiny_qwen()
    model = copy.deepcopy(base)
    apply_lora(model, RANK, ALPHA, "all-linear")
    ids = tokens()
    losses = train_a_bit(model.train(), ids)
    return base, model.eval(), ids, losses


def test_starts_at_base_and_freezes_everything_else():
    base = tiny_qwen()
    model = copy.deepcopy(base)
    paths = apply_lora(model, RANK, ALPHA, ["q_proj", "v_proj"])
    assert paths == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    ids = tokens()
    assert torch.equal(logits_of(model, ids), logits_of(base, ids))  # B = 0: exactly the base
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{p}.lora_{x}.weight" for p in paths for x in "AB")
    layer = model.get_submodule(paths[0])
    assert isinstance(layer, LoRALinear) and layer.scaling == ALPHA / RANK
    assert layer.lora_A.weight.shape == (RANK, 64) and layer.lora_B.weight.shape == (64, RANK)
    assert layer.lora_A.weight.abs().sum() > 0 and layer.lora_B.weight.abs().sum() == 0
    # kaiming_uniform(a=sqrt(5)) on [r, in] is U(-1/sqrt(in), 1/sqrt(in)), nn.Linear's default.
    assert layer.lora_A.weight.abs().max() <= 1 / 64**0.5
    # q_proj keeps its bias, frozen, under base_layer (PEFT's name).
    assert "model.layers.0.self_attn.q_proj.base_layer.bias" in model.state_dict()


def test_training_moves_only_lora_and_lowers_loss(trained):
    base, model, ids, losses = trained
    assert losses[-1] < losses[0] - 0.05, losses
    diff = (logits_of(model, ids) - logits_of(base, ids)).abs().max().item()
    assert diff > 1e-3
    base_sd = base.state_dict()
    merged_keys_unchanged = merge_lora_state_dict(model.state_dict(), RANK, ALPHA)
    # Frozen tensors (embeddings = tied lm_head, norms) are bit-identical to the base.
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(merged_keys_unchanged[key], base_sd[key])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_merged_state_dict_loads_into_plain_model(trained):
    base, model, ids, _ = trained
    merged = merge_lora_state_dict(model.state_dict(), RANK, ALPHA)
    assert set(merged) == set(base.state_dict())
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    fresh = tiny_qwen(seed=123)
    fresh.load_state_dict(merged, strict=True)
    err = (logits_of(fresh, ids) - logits_of(model, ids)).abs().max().item()
    assert err < 1e-5, err
    # Hand check of one weight: base + (B @ A) * alpha / r.
    q = model.model.layers[1].self_attn.q_proj
    expect = q.base_layer.weight + q.lora_B.weight @ q.lora_A.weight * (ALPHA / RANK)
    assert torch.allclose(merged["model.layers.1.self_attn.q_proj.weight"], expect, atol=1e-6)
    assert torch.equal(merged["model.layers.1.self_attn.q_proj.bias"], q.base_layer.bias)


def test_streamed_merge_equals_the_state_dict_merge_and_disabled_is_the_base(trained):
    """The RL weight push streams named_parameters (a tied lm_head appears once) through merged_params."""
    base, model, ids, _ = trained
    streamed = dict(merged_params(((n, p.detach()) for n, p in model.named_parameters()), ALPHA / RANK))
    merged = merge_lora_state_dict(model.state_dict(), RANK, ALPHA)
    assert set(streamed) == {n for n, _ in base.named_parameters()}
    for name, t in streamed.items():
        assert torch.equal(t, merged[name]), name
    with disabled(model):
        assert torch.equal(logits_of(model, ids), logits_of(base, ids))
    assert (logits_of(model, ids) - logits_of(base, ids)).abs().max().item() > 1e-3  # adapters back on
    parts = [(n, p) for n, p in model.named_parameters() if "lora_B" not in n]
    with pytest.raises(ValueError, match="LoRA modules without"):
        list(merged_params(parts, ALPHA / RANK))


def test_merge_keeps_base_dtype_and_accepts_peft_names():
    a, b = torch.randn(2, 3), torch.randn(5, 2)
    w = torch.randn(5, 3).bfloat16()
    sd = {"m.base_layer.weight": w, "m.lora_A.default.weight": a, "m.lora_B.default.weight": b}
    out = merge_lora_state_dict(sd, rank=2, alpha=6.0)
    assert list(out) == ["m.weight"] and out["m.weight"].dtype == torch.bfloat16
    assert torch.allclose(out["m.weight"].float(), (w.float() + 3.0 * b @ a).bfloat16().float())
    with pytest.raises(ValueError, match="rank 2, expected 4"):
        merge_lora_state_dict(sd, rank=4, alpha=6.0)


def test_peft_loads_saved_adapter(trained, tmp_path):
    peft = pytest.importorskip("peft")
    _, model, ids, _ = trained
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    tiny_qwen().save_pretrained(base_dir)
    save_adapter(adapter_dir, model.state_dict(), RANK, ALPHA, "all-linear", str(base_dir))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == "all-linear" and config["r"] == RANK
    peft_model = peft.PeftModel.from_pretrained(
        Qwen2ForCausalLM.from_pretrained(base_dir), adapter_dir
    ).eval()
    err = (logits_of(peft_model, ids) - logits_of(model, ids)).abs().max().item()
    assert err < 1e-5, err
    # PEFT's own export of what it loaded has exactly our file's keys and values.
    ours = load_file(adapter_dir / "adapter_model.safetensors")
    theirs = peft.get_peft_model_state_dict(peft_model)
    assert set(ours) == set(theirs) and len(ours) == 2 * 7 * 2
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_peft_loads_list_targets(tmp_path):
    peft = pytest.importorskip("peft")
    model, ids = tiny_qwen(), tokens()
    apply_lora(model, RANK, ALPHA, "v_proj, down_proj, not_here")
    with torch.no_grad():  # give B a value so the adapter is not a no-op
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(std=0.1)
    tiny_qwen().save_pretrained(tmp_path / "base")
    save_adapter(tmp_path / "ad", model.state_dict(), RANK, ALPHA, "v_proj,down_proj,not_here", "x")
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "v_proj"]  # only suffixes that were wrapped
    base = Qwen2ForCausalLM.from_pretrained(tmp_path / "base")
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "ad").eval()
    assert (logits_of(model, ids) - logits_of(tiny_qwen(), ids)).abs().max() > 1e-3
    err = (logits_of(peft_model, ids) - logits_of(model, ids)).abs().max().item()
    assert err < 1e-5, err


def test_all_linear_matches_peft_and_skips_lm_head():
    peft = pytest.importorskip("peft")
    model = tiny_qwen()
    paths = apply_lora(model, RANK, ALPHA, "all-linear")
    assert sorted({p.rsplit(".", 1)[-1] for p in paths}) == sorted(ALL) and len(paths) == 14
    assert "lm_head" not in paths and isinstance(model.lm_head, torch.nn.Linear)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(tiny_qwen(), cfg)
    peft_paths = [
        n.removeprefix("base_model.model.")
        for n, m in peft_model.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer)
    ]
    assert sorted(peft_paths) == sorted(paths)
    # Same parameter names as PEFT once its ".default" adapter name and wrapper prefix are dropped.
    peft_names = {
        n.removeprefix("base_model.model.").replace(".default", "") for n, _ in peft_model.named_parameters()
    }
    assert peft_names == {n for n, _ in model.named_parameters()}
    assert set(adapter_state_dict(model.state_dict())) == set(peft.get_peft_model_state_dict(peft_model))


def test_bad_targets_error():
    with pytest.raises(ValueError, match=r"'qq_proj'.*available suffixes: \['down_proj'"):
        apply_lora(tiny_qwen(), RANK, ALPHA, ["qq_proj"])
    with pytest.raises(ValueError, match="empty"):
        apply_lora(tiny_qwen(), RANK, ALPHA, " , ")
    model = tiny_qwen()
    apply_lora(model, RANK, ALPHA, "q_proj")
    with pytest.raises(ValueError, match="once"):
        apply_lora(model, RANK, ALPHA, "q_proj")


# ------------------------------------------------------------- exclude_modules, lora_adapter_path


LAYER0 = r".*layers\.0\..*"  # a regex on the full name: every module of the first decoder layer


def lora_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}


def test_exclude_modules_regex_and_list_as_peft():
    """A string is a regex the whole name must match (PEFT's re.fullmatch), a list names or name suffixes."""
    model = tiny_qwen()
    paths = apply_lora(model, RANK, ALPHA, "all-linear", exclude_modules=LAYER0)
    assert len(paths) == 7 and all(p.startswith("model.layers.1.") for p in paths)  # 14 without the exclusion
    q0 = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert type(q0) is torch.nn.Linear and not any(".layers.0." in n for n in lora_params(model))
    assert len(lora_params(model)) == 2 * 7 and not q0.weight.requires_grad
    # fullmatch, not search: "layers\.0" alone matches no whole name, so nothing is left out.
    assert len(apply_lora(tiny_qwen(), RANK, ALPHA, "all-linear", exclude_modules=r"layers\.0")) == 14
    # A list: o_proj is a suffix (both layers), the second item one full name.
    listed = apply_lora(
        tiny_qwen(), RANK, ALPHA, "all-linear", exclude_modules=["o_proj", "model.layers.1.mlp.up_proj"]
    )
    assert len(listed) == 14 - 2 - 1 and "model.layers.0.mlp.up_proj" in listed
    assert not any(p.endswith("o_proj") or p == "model.layers.1.mlp.up_proj" for p in listed)
    peft = pytest.importorskip("peft")
    for exclude, ours in ((LAYER0, paths), (["o_proj", "model.layers.1.mlp.up_proj"], listed)):
        cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", exclude_modules=exclude)
        theirs = peft.get_peft_model(tiny_qwen(), cfg)
        wrapped = [n.removeprefix("base_model.model.") for n, m in theirs.named_modules()
                   if isinstance(m, peft.tuners.lora.LoraLayer)]  # fmt: skip
        assert sorted(wrapped) == sorted(ours)


def test_exclude_modules_errors_name_the_key():
    with pytest.raises(
        ValueError, match=r"exclude_modules '\.\*' excludes all 4 modules that target_modules"
    ):
        apply_lora(tiny_qwen(), RANK, ALPHA, "q_proj,v_proj", exclude_modules=".*")
    with pytest.raises(ValueError, match=r"exclude_modules '\(' is not a valid regex"):
        apply_lora(tiny_qwen(), RANK, ALPHA, "all-linear", exclude_modules="(")


def saved_adapter(tmp_path, exclude: str | None = LAYER0, targets: str = "q_proj,v_proj,down_proj"):
    """(trained-looking LoRA model, its adapter folder): random nonzero B, written as shard_merge.py writes it."""
    model = tiny_qwen()
    torch.manual_seed(7)
    apply_lora(model, RANK, ALPHA, targets, exclude_modules=exclude)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    out = save_adapter(
        tmp_path / "adapter", model.state_dict(), RANK, ALPHA, targets, "tiny", exclude_modules=exclude
    )
    return model, out


def test_lora_adapter_path_round_trip_is_bitwise(tmp_path):
    """Train/save -> model.lora_adapter_path: every LoRA tensor is the saved one, bit for bit, with the adapter's
    own r, alpha, targets and exclusions (as verl: PeftModel.from_pretrained), each change said in a note."""
    trained, folder = saved_adapter(tmp_path)
    assert json.loads((folder / "adapter_config.json").read_text())["exclude_modules"] == LAYER0
    fresh = tiny_qwen()
    cfg = actor.ModelConfig(
        lora_adapter_path=str(folder)
    )  # lora_rank 0: the adapter turns LoRA on, as in verl
    assert cfg.uses_lora and not actor.ModelConfig().uses_lora
    settings, notes = start_lora(fresh, cfg)
    assert settings == {"rank": RANK, "alpha": ALPHA, "target_modules": ["down_proj", "q_proj", "v_proj"],
                        "exclude_modules": LAYER0, "dropout": 0.0}  # fmt: skip
    ours, theirs = lora_params(fresh), lora_params(trained)
    assert set(ours) == set(theirs) and len(ours) == 2 * 3  # q, v, down of layer 1 only
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name
    assert sum(t.abs().sum().item() for n, t in ours.items() if ".lora_B." in n) > 0.5  # B was not left at 0
    ids = tokens()
    assert torch.equal(logits_of(fresh, ids), logits_of(trained, ids))
    assert all(p.requires_grad == (".lora_" in n) for n, p in fresh.named_parameters())
    assert len(notes) == 4 and "sets r=4, in place of model.lora_rank=0" in notes[0]
    assert "sets lora_alpha=8.0, in place of model.lora_alpha=16.0" in notes[1]
    assert "exclude_modules='.*layers\\\\.0\\\\..*', in place of model.exclude_modules=None" in notes[3]
    # The run's own values, when they agree with the file, give no note.
    same = actor.ModelConfig(lora_rank=RANK, lora_alpha=ALPHA, target_modules=["v_proj", "q_proj", "down_proj"],
                             exclude_modules=LAYER0, lora_adapter_path=str(folder))  # fmt: skip
    assert start_lora(tiny_qwen(), same)[1] == []


def test_lora_adapter_path_loads_what_peft_saved(tmp_path):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["k_proj", "up_proj"], exclude_modules=LAYER0
    )
    theirs = peft.get_peft_model(tiny_qwen(), cfg)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    theirs.save_pretrained(tmp_path / "peft")
    model = tiny_qwen()
    start_lora(model, actor.ModelConfig(lora_adapter_path=str(tmp_path / "peft")))
    assert len(lora_params(model)) == 2 * 2
    ids = tokens()
    assert (logits_of(model, ids) - logits_of(tiny_qwen(), ids)).abs().max() > 1e-3
    assert torch.equal(logits_of(model, ids), logits_of(theirs.eval(), ids))


def test_lora_adapter_path_errors_name_the_file_and_tensor(tmp_path):
    _, folder = saved_adapter(tmp_path)
    weights, conf = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    start = lambda: start_lora(tiny_qwen(), actor.ModelConfig(lora_adapter_path=str(folder)))  # noqa: E731
    good_weights, good_conf = load_file(weights), json.loads(conf.read_text())
    a = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    # A rank the tensors do not have: the first tensor (by name) is named with its shape and the model's.
    d = "model.layers.1.mlp.down_proj.lora_A.weight"
    conf.write_text(json.dumps(dict(good_conf, r=8)))
    with pytest.raises(
        ValueError,
        match=rf"adapter_model.safetensors: tensor base_model.model.{d} has shape \[4, 128\], the model's {d} \[8, 128\]",
    ):
        start()
    conf.write_text(json.dumps(good_conf))
    # A stray tensor: k_proj is not a target here, so no LoRA parameter takes it.
    k = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
    save_file(dict(good_weights, **{k: torch.zeros(RANK, 64)}), str(weights))
    with pytest.raises(ValueError, match=rf"adapter_model.safetensors: tensor {k} has no LoRA parameter"):
        start()
    save_file(dict(good_weights, **{"base_model.model.lm_head.weight": torch.zeros(97, 64)}), str(weights))
    with pytest.raises(ValueError, match="tensor base_model.model.lm_head.weight is not a LoRA weight"):
        start()
    # A missing tensor.
    save_file({n: t for n, t in good_weights.items() if n != a}, str(weights))
    with pytest.raises(
        ValueError,
        match=r"no tensor for LoRA parameter model.layers.1.self_attn.q_proj.lora_A.weight \(1 of 6",
    ):
        start()
    save_file(good_weights, str(weights))
    # What LoRALinear cannot compute is refused by name, before anything is built.
    conf.write_text(json.dumps(dict(good_conf, use_dora=True)))
    with pytest.raises(ValueError, match=r"adapter_config.json: use_dora=True: not supported"):
        start()
    conf.write_text(json.dumps(dict(good_conf, target_modules=r".*\.q_proj")))
    with pytest.raises(ValueError, match=r"adapter_config.json: target_modules=.*a regex"):
        start()
    conf.unlink()
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        start()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        start_lora(tiny_qwen(), actor.ModelConfig(lora_adapter_path=str(tmp_path / "nowhere")))


def test_actor_load_starts_from_the_adapter(tmp_path, tiny_qwen2, one_rank, capsys):
    """grpo.py / ppo.py / dpo.py build the policy with actor.load: the adapter's weights arrive (sharded), lora.json
    records the adapter's settings for shard_merge.py, and the reference is the policy with its adapters off."""
    base = Qwen2ForCausalLM.from_pretrained(tiny_qwen2)
    apply_lora(base, 2, 4.0, ["q_proj", "down_proj"], exclude_modules=["down_proj"])
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    save_adapter(tmp_path / "ad", base.state_dict(), 2, 4.0, ["q_proj", "down_proj"], str(tiny_qwen2),
                 exclude_modules=["down_proj"])  # fmt: skip
    cfg = actor.ModelConfig(path=str(tiny_qwen2), lora_rank=8, lora_adapter_path=str(tmp_path / "ad"))
    model, hf_files = actor.load(cfg, one_rank.device)
    assert hf_files["lora"] == {"rank": 2, "alpha": 4.0, "target_modules": ["q_proj"], "exclude_modules": ["down_proj"],
                                "dropout": 0.0, "base_model_name_or_path": str(tiny_qwen2)}  # fmt: skip
    loaded = {n: p.full_tensor() for n, p in model.named_parameters() if ".lora_" in n}
    assert set(loaded) == {f"model.layers.0.self_attn.q_proj.lora_{x}.weight" for x in "AB"}
    for name, t in loaded.items():
        assert torch.equal(t, base.get_parameter(name)), name
    assert actor.load_reference(cfg, model, one_rank.device) is model
    assert "sets r=2, in place of model.lora_rank=8" in capsys.readouterr().err
