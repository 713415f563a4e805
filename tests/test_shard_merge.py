"""shard_merge.py: checkpoints written the way checkpoint.py (DCP) and verl (per-rank .pt) write them, merged, then
loaded back with from_pretrained / peft / vLLM and compared with the model that was saved (logits within 1e-5,
identical greedy tokens). Every broken-checkpoint error must name the broken file."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import tyro
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
)

import actor
import checkpoint
import shard_merge
from lora import apply_lora, start_lora

torch.set_num_threads(
    1
)  # 2 cores shared with other jobs: a 2nd OpenMP thread makes small matmuls ~50x slower
VOCAB = 301  # odd, so FSDP2 shards embed_tokens unevenly (151 + 150 rows)
LORA = {"rank": 4, "alpha": 8.0, "target_modules": "all-linear", "base_model_name_or_path": "tiny-qwen2"}
PROMPTS = torch.tensor([[5, 17, 42, 99, 7, 3], [250, 11, 12, 13, 200, 1]])  # [B, T]


def tiny_model(tied: bool, seed: int = 0, lora: bool = False) -> Qwen2ForCausalLM:
    """The tiny Qwen2 (hidden 128, 2 heads of 64, 1 kv head, 2 layers); with lora, LoRA on with lora_B perturbed."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        initializer_range=0.05,  # wider than 0.02 so the greedy argmax is not a near-tie (vLLM vs transformers)
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    if lora:
        apply_lora(model, LORA["rank"], LORA["alpha"], LORA["target_modules"])
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if ".lora_B." in name:  # B starts at 0 (a no-op adapter); make the adapter matter
                p.data.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def tokenizer() -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer over the vocabulary ("t0".."t299"); vLLM wants a tokenizer in the folder."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t2")


def write_hf_files(hf_dir: Path, model: Qwen2ForCausalLM, lora: dict | None = None) -> None:
    """huggingface/ as checkpoint.py writes it: config, generation config, tokenizer, lora.json with LoRA."""
    model.config.save_pretrained(hf_dir)
    GenerationConfig(do_sample=False, eos_token_id=1, pad_token_id=2).save_pretrained(hf_dir)
    tokenizer().save_pretrained(hf_dir)
    if lora:
        (hf_dir / "lora.json").write_text(json.dumps(lora))


def write_dcp_ckpt(ckpt: Path, model: Qwen2ForCausalLM, lora: dict | None = None) -> Path:
    """RUN/global_step_1 of a world-size-1 run: DCP saved in this process, no process group."""
    dcp.save(get_model_state_dict(model), checkpoint_id=str(ckpt / "model"), no_dist=True)
    write_hf_files(ckpt / "huggingface", model, lora)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1, "world_size": 1}))
    return ckpt


def write_verl_plain_ckpt(ckpt: Path, model: Qwen2ForCausalLM, world: int = 2) -> Path:
    """A verl folder whose rank files hold plain tensors: rank r has torch.chunk(t, world)[r] of every tensor."""
    actor = ckpt / "actor"
    actor.mkdir(parents=True)
    for r in range(world):
        sd = {k: v.chunk(world, dim=0)[r].clone() for k, v in model.state_dict().items()}
        torch.save(sd, actor / f"model_world_size_{world}_rank_{r}.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    write_hf_files(actor / "huggingface", model)
    return ckpt


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor = PROMPTS) -> torch.Tensor:
    return model(input_ids=ids).logits  # [B, T, V]


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: torch.Tensor = PROMPTS) -> list[list[int]]:
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8, min_new_tokens=8
    )
    return out[:, ids.shape[1] :].tolist()  # [B, 8]


def assert_same_model(out: Path, model: torch.nn.Module) -> torch.nn.Module:
    """The merged folder loads and matches `model`: logits within 1e-5, identical greedy tokens."""
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert (logits(loaded) - logits(model)).abs().max().item() < 1e-5
    assert greedy(loaded) == greedy(model)
    return loaded


def shard_keys(out: Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a merged folder."""
    return {k: f.name for f in sorted(out.glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Pristine checkpoints shared by the tests (tests copy one before breaking it)."""
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "tied": write_dcp_ckpt(root / "tied" / "global_step_1", tiny_model(True)),
        "untied": write_dcp_ckpt(root / "untied" / "global_step_1", tiny_model(False)),
        "lora": write_dcp_ckpt(root / "lora" / "global_step_1", tiny_model(True, lora=True), LORA),
        "verl": write_verl_plain_ckpt(root / "verl" / "global_step_1", tiny_model(False)),
    }


def copy_ckpt(ckpts: dict[str, Path], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ckpts[name], tmp_path / name / "global_step_1"))


@pytest.mark.parametrize("tied", [True, False])
def test_dcp_world1_roundtrip_and_ties(ckpts, tmp_path, tied):
    ckpt = ckpts["tied" if tied else "untied"]
    out = shard_merge.merge(ckpt, tmp_path / "hf")
    model = tiny_model(tied)
    loaded = assert_same_model(out, model)
    keys = shard_keys(out)
    assert set(keys.values()) == {"model.safetensors"} and not (out / "model.safetensors.index.json").exists()
    assert len(keys) == len(model.state_dict()) - tied  # the alias lm_head.weight is dropped when tied
    assert ("lm_head.weight" in keys) is not tied
    head, embed = loaded.lm_head.weight, loaded.model.embed_tokens.weight
    assert (head.data_ptr() == embed.data_ptr()) is tied
    assert torch.equal(head, embed) is tied
    for f in ("tokenizer.json", "generation_config.json", "config.json"):
        assert (out / f).is_file()
    assert not (out / "lora.json").exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert shard_merge.verify(ckpt, out) < 1e-5


def test_multi_shard_output_respects_limit(ckpts, tmp_path):
    limit = 100_000  # embed_tokens (300x128 fp32 = 153.6 kB) is over it and gets a shard of its own
    out = shard_merge.merge(ckpts["tied"], tmp_path / "hf", max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(files) >= 5 and set(index["weight_map"].values()) == {f.name for f in files}
    total = 0
    for f in files:
        sd = load_file(f)
        nbytes = sum(v.numel() * v.element_size() for v in sd.values())
        assert nbytes <= limit or len(sd) == 1, (f.name, nbytes)
        total += nbytes
    assert (
        index["metadata"]["total_size"] == total == 4 * sum(p.numel() for p in tiny_model(True).parameters())
    )
    assert_same_model(out, tiny_model(True))


def test_dtype_auto_follows_config_and_override(ckpts, tmp_path):
    ckpt = copy_ckpt(ckpts, "untied", tmp_path)
    cfg_file = ckpt / "huggingface" / "config.json"
    cfg_file.write_text(json.dumps(dict(json.loads(cfg_file.read_text()), dtype="bfloat16")))
    out = shard_merge.merge(ckpt, tmp_path / "bf16")  # auto -> the config's bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    ref = {k: v.to(torch.bfloat16) for k, v in tiny_model(False).state_dict().items()}
    written = load_file(out / "model.safetensors")
    assert written.keys() == ref.keys() and all(torch.equal(written[k], ref[k]) for k in ref)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    diff, floor = shard_merge.measure(ckpt, out)
    assert (
        1e-4 < diff < shard_merge.VERIFY_MARGIN * floor
    )  # bf16 round-off: far above fp32's, within its floor
    out32 = shard_merge.merge(ckpt, tmp_path / "fp32", dtype="float32")
    assert load_file(out32 / "model.safetensors")["lm_head.weight"].dtype == torch.float32
    assert shard_merge.verify(ckpt, out32) < 1e-5


def test_lora_merge_adapter_only_and_verify(ckpts, tmp_path):
    from peft import PeftModel

    lora_model, base = tiny_model(True, lora=True), tiny_model(True)
    assert (logits(lora_model) - logits(base)).abs().max().item() > 1e-2  # the adapter changes the model
    out = shard_merge.merge(ckpts["lora"], tmp_path / "merged")
    assert not any("lora_" in k or "base_layer" in k for k in shard_keys(out))
    assert_same_model(out, lora_model)
    assert shard_merge.verify(ckpts["lora"], out) < 1e-5  # verify's reference runs LoRA unmerged

    adapter = shard_merge.merge(ckpts["lora"], tmp_path / "adapter", adapter_only=True)
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    assert (logits(peft_model) - logits(lora_model)).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="lora.json"):
        shard_merge.merge(ckpts["tied"], tmp_path / "no_adapter", adapter_only=True)


def test_lora_with_exclusions_round_trips_through_lora_adapter_path(tmp_path):
    """lora.json's exclude_modules reaches --adapter-only's adapter_config.json and --verify's rebuilt model, and the
    adapter loads back (model.lora_adapter_path) into the same LoRA tensors, bit for bit."""
    lora_cfg = dict(
        LORA, target_modules=["down_proj", "q_proj", "v_proj"], exclude_modules=r".*layers\.0\.mlp\..*"
    )
    model = tiny_model(True)
    apply_lora(
        model,
        lora_cfg["rank"],
        lora_cfg["alpha"],
        lora_cfg["target_modules"],
        exclude_modules=lora_cfg["exclude_modules"],
    )
    g = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            p.data.copy_(0.05 * torch.randn(p.shape, generator=g))
    ckpt = write_dcp_ckpt(tmp_path / "run" / "global_step_1", model, lora_cfg)
    assert shard_merge.verify(ckpt, shard_merge.merge(ckpt, tmp_path / "merged")) < 1e-5

    adapter = shard_merge.merge(ckpt, tmp_path / "adapter", adapter_only=True)
    assert (
        json.loads((adapter / "adapter_config.json").read_text())["exclude_modules"]
        == lora_cfg["exclude_modules"]
    )
    fresh = tiny_model(True)
    settings, _ = start_lora(fresh, actor.ModelConfig(lora_adapter_path=str(adapter)))
    assert (settings["rank"], settings["exclude_modules"]) == (4, lora_cfg["exclude_modules"])
    saved = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    loaded = {n: p for n, p in fresh.named_parameters() if ".lora_" in n}
    assert set(loaded) == set(saved) and len(saved) == 2 * 5  # q, v of both layers; down_proj of layer 1 only
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)
    assert torch.equal(logits(fresh), logits(model))


def test_verl_plain_shards_and_cli(ckpts, tmp_path):
    out = shard_merge.merge(ckpts["verl"], tmp_path / "hf")  # finds actor/ under global_step_1
    assert_same_model(out, tiny_model(False))
    # The CLI path: tyro flags -> main() with --verify; a tolerance below bf16 round-off must fail the check.

    args = ["--ckpt-dir", str(ckpts["verl"] / "actor"), "--out", str(tmp_path / "cli"), "--dtype", "bfloat16"]
    result = shard_merge.main(
        tyro.cli(shard_merge.MergeConfig, args=[*args, "--verify", "--verify-tolerance", "1e-6"])
    )
    assert not result["ok"] and result["verify/max_abs_logprob_diff"] > 1e-6
    with pytest.raises(FileExistsError, match="cli"):  # a non-empty --out is kept unless --force
        shard_merge.main(tyro.cli(shard_merge.MergeConfig, args=args))
    result = shard_merge.main(
        tyro.cli(shard_merge.MergeConfig, args=[*args[:-1], "float32", "--force", "--verify"])
    )
    assert result["ok"] and result["verify/max_abs_logprob_diff"] < 1e-5
    assert load_file(tmp_path / "cli" / "model.safetensors")["lm_head.weight"].dtype == torch.float32


def test_critic_component(ckpts, tmp_path):
    ckpt = copy_ckpt(ckpts, "tied", tmp_path)  # the actor at the top level, a different model under critic/
    critic = tiny_model(False, seed=1)
    dcp.save(get_model_state_dict(critic), checkpoint_id=str(ckpt / "critic" / "model"), no_dist=True)
    write_hf_files(ckpt / "critic" / "huggingface", critic)
    out = shard_merge.merge(ckpt, tmp_path / "critic_hf", component="critic")
    assert_same_model(out, critic)
    assert shard_merge.verify(ckpt, out, component="critic") < 1e-5
    assert shard_merge.verify(ckpt, out, component="actor") > 1e-2  # the actor is another model


def test_verify_tolerance_follows_depth(tmp_path):
    """Issue 17: a correct fp32 LoRA merge of a 30-layer model differed by 1.7e-4 in logits and failed the old
    fixed 1e-4. A 30-layer model with larger weights (hence logits) does the same here; the measured floor passes
    it, and one weight of the merged folder changed by 10% of the model's weight scale fails it."""
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.2,
        dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    apply_lora(model, LORA["rank"], LORA["alpha"], LORA["target_modules"])
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            p.data.copy_(0.05 * torch.randn(p.shape, generator=g))
    ckpt = write_dcp_ckpt(tmp_path / "deep" / "global_step_1", model, LORA)
    args = ["--ckpt-dir", str(ckpt), "--out", str(tmp_path / "hf"), "--verify"]
    result = shard_merge.main(tyro.cli(shard_merge.MergeConfig, args=args))
    probe = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))  # verify's batch
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (logits(model, probe) - logits(merged, probe)).abs().max() > 1e-4  # the old fixed bar fails it
    assert result["ok"] and 1e-5 < result["verify/max_abs_logprob_diff"] <= result["verify/tolerance"]
    assert result["verify/tolerance"] == shard_merge.VERIFY_MARGIN * result["verify/floor"]

    sd = load_file(tmp_path / "hf" / "model.safetensors")
    sd["model.layers.15.mlp.down_proj.weight"][3, 7] += 0.02  # one weight; initializer_range is 0.2
    save_file(sd, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    diff, floor = shard_merge.measure(ckpt, tmp_path / "hf")
    assert diff > shard_merge.VERIFY_MARGIN * floor, (diff, floor)


def test_verify_value_head_critic(tmp_path):
    """PPO's critic has one output per token (a value): verify compares the values, not a log_softmax of one."""
    config = tiny_model(False).config
    config.num_labels, config.architectures = 1, ["Qwen2ForTokenClassification"]
    torch.manual_seed(3)
    critic = Qwen2ForTokenClassification(config).eval()
    ckpt = write_dcp_ckpt(tmp_path / "run" / "global_step_1", critic)
    out = shard_merge.merge(ckpt, tmp_path / "critic_hf")
    assert shard_merge.verify(ckpt, out) == 0.0
    sd = load_file(out / "model.safetensors")
    sd["score.weight"][0, 5] += 0.5
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    diff, floor = shard_merge.measure(ckpt, out)
    assert diff > 1e-3 and diff > shard_merge.VERIFY_MARGIN * floor, (diff, floor)


def test_verify_catches_misordered_shards(ckpts, tmp_path):
    out = shard_merge.merge(ckpts["untied"], tmp_path / "hf")
    sd = load_file(out / "model.safetensors")
    w = sd["model.layers.0.mlp.up_proj.weight"]  # [256, 128]: rank 1's half first, as a wrong concat would do
    sd["model.layers.0.mlp.up_proj.weight"] = torch.cat([w[128:], w[:128]])
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    assert shard_merge.verify(ckpts["untied"], out) > 1e-2


def test_out_over_the_checkpoint_is_refused_even_with_force(ckpts, tmp_path):
    """Issue 22: `--out RUN --force` deleted the run; `--out CKPT --force --verify` replaced the checkpoint."""
    ckpt = copy_ckpt(ckpts, "tied", tmp_path)
    run = ckpt.parent
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "config.yaml").write_text("a: 1\n")
    other = Path(shutil.copytree(ckpt, run / "global_step_0"))
    verl = copy_ckpt(ckpts, "verl", tmp_path)
    (tmp_path / "link").symlink_to(run)
    before = sorted((str(p.relative_to(tmp_path)), p.stat().st_size) for p in tmp_path.rglob("*"))
    refused = [
        (ckpt, run, "holds the checkpoint"),
        (ckpt, tmp_path, "holds the checkpoint"),
        (ckpt, tmp_path / "link", "holds the checkpoint"),  # a symlink to the run folder
        (ckpt, ckpt, "inside the checkpoint"),
        (ckpt, tmp_path / "link" / "global_step_1", "inside the checkpoint"),
        (ckpt, ckpt / "model", "inside the checkpoint"),
        (ckpt, ckpt / "huggingface" / "new", "inside the checkpoint"),
        (ckpt, other, "is a checkpoint of the run folder"),
        (ckpt, run / "global_step_2.tmp" / "x", "is a checkpoint of the run folder"),
        (verl / "actor", verl, "inside the checkpoint"),  # verl's actor/ lies inside global_step_1
        (verl / "actor", verl.parent, "holds the checkpoint"),
    ]
    for ckpt_dir, out, why in refused:
        args = ["--ckpt-dir", str(ckpt_dir), "--out", str(out), "--force", "--verify"]
        with pytest.raises(ValueError, match=why):
            shard_merge.main(tyro.cli(shard_merge.MergeConfig, args=args))
    assert sorted((str(p.relative_to(tmp_path)), p.stat().st_size) for p in tmp_path.rglob("*")) == before

    # Beside the checkpoints is fine, and --force replaces an earlier merge; no OUT.tmp / OUT.old stays.
    out = shard_merge.merge(ckpt, run / "hf")
    (out / "stale.txt").write_text("from an earlier merge")
    result = shard_merge.main(
        tyro.cli(
            shard_merge.MergeConfig, args=["--ckpt-dir", str(ckpt), "--out", str(out), "--force", "--verify"]
        )
    )
    assert result["ok"] and not (out / "stale.txt").exists()
    names = ["config.yaml", "global_step_0", "global_step_1", "hf", "metrics.jsonl"]
    assert sorted(p.name for p in run.iterdir()) == names


def test_output_is_written_as_out_tmp_then_renamed(ckpts, tmp_path, monkeypatch):
    out = shard_merge.merge(ckpts["tied"], tmp_path / "hf")
    kept = sorted(p.name for p in out.iterdir())
    seen = []

    def fail(ckpt, folder, max_bytes, dtype):  # a crash in the middle of writing the shards
        seen.append(folder)
        (folder / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk went away")

    monkeypatch.setattr(shard_merge, "_write_model", fail)
    (tmp_path / "hf.tmp").mkdir()  # left by an earlier crash: replaced
    with pytest.raises(RuntimeError, match="disk went away"):
        shard_merge.merge(ckpts["tied"], out, force=True)
    assert seen == [tmp_path / "hf.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # the earlier output, untouched
    assert sorted(p.name for p in out.iterdir()) == kept
    assert_same_model(out, tiny_model(True))


def _break(ckpt: Path, what: str) -> str:
    """Damage a checkpoint copy; returns the file name the error must mention."""
    if what == "dcp_missing":
        (ckpt / "model" / "__0_0.distcp").unlink()
        return "__0_0.distcp"
    if what == "dcp_truncated":
        f = ckpt / "model" / "__0_0.distcp"
        os.truncate(f, f.stat().st_size // 2)
        return "__0_0.distcp"
    if what == "no_model":
        shutil.rmtree(ckpt / "model")
        return "global_step_1/model does not exist"
    if what == "no_hf":
        shutil.rmtree(ckpt / "huggingface")
        return "huggingface/config.json"
    actor = ckpt / "actor"
    if what == "verl_missing":
        (actor / "model_world_size_2_rank_1.pt").unlink()
        return "model_world_size_2_rank_1.pt"
    if what == "verl_world":
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
        return "fsdp_config.json"
    f = actor / "model_world_size_2_rank_1.pt"  # verl_truncated
    os.truncate(f, f.stat().st_size // 2)
    return "model_world_size_2_rank_1.pt"


@pytest.mark.parametrize(
    "what, err",
    [
        ("dcp_missing", FileNotFoundError),
        ("dcp_truncated", ValueError),
        ("no_model", FileNotFoundError),
        ("no_hf", FileNotFoundError),
        ("verl_missing", FileNotFoundError),
        ("verl_world", ValueError),
        ("verl_truncated", ValueError),
    ],
)
def test_broken_checkpoint_errors_name_the_file(ckpts, tmp_path, what, err):
    ckpt = copy_ckpt(ckpts, "verl" if what.startswith("verl") else "tied", tmp_path)
    name = _break(ckpt, what)
    with pytest.raises(err, match=name.replace(".", r"\.")):
        shard_merge.merge(ckpt, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.parent.name]  # no output, no temp folder left


# ------------------------------------------------------------------------ 2 ranks (slow: spawns processes)


def _rank_main(rank: int, port: int, root: str) -> None:
    """One of 2 gloo ranks: FSDP2-shard the tiny models, save DCP (flatrl) and per-rank .pt (verl) checkpoints."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for name, model, lora in [
        ("tied", tiny_model(True), None),
        ("untied", tiny_model(False), None),
        ("lora", tiny_model(True, lora=True), LORA),
    ]:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ckpt = Path(root) / name / "global_step_1"
        dcp.save(get_model_state_dict(model), checkpoint_id=str(ckpt / "model"))
        verl = Path(root) / f"verl_{name}" / "global_step_1" / "actor"
        verl.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), verl / f"model_world_size_2_rank_{rank}.pt")  # DTensors, Shard(0)
        if rank == 0:
            write_hf_files(ckpt / "huggingface", model, lora)
            (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1, "world_size": 2}))
            write_hf_files(verl / "huggingface", model, lora)
            (verl / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2}))
        dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ckpts_world2(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("world2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank_main, args=(port, str(root)), nprocs=2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tied", "untied", "lora"])
def test_dcp_world2(ckpts_world2, tmp_path, name):
    ckpt = ckpts_world2 / name / "global_step_1"
    meta = checkpoint.read_dcp_metadata(ckpt / "model" / ".metadata")
    assert len(meta.state_dict_metadata["model.embed_tokens.weight"].chunks) == 2  # really written by 2 ranks
    out = shard_merge.merge(ckpt, tmp_path / "hf")
    assert_same_model(out, tiny_model(name != "untied", lora=name == "lora"))
    assert ("lm_head.weight" in shard_keys(out)) is (name == "untied")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tied", "untied"])
def test_verl_dtensor_world2(ckpts_world2, tmp_path, name):
    ckpt = ckpts_world2 / f"verl_{name}" / "global_step_1"
    rank1 = torch.load(ckpt / "actor" / "model_world_size_2_rank_1.pt", weights_only=True)
    embed = rank1["model.embed_tokens.weight"]
    assert embed.placements[0].is_shard() and embed.to_local().shape == (VOCAB // 2, 128)
    out = shard_merge.merge(ckpt, tmp_path / "hf")
    assert_same_model(out, tiny_model(name == "tied"))


VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])], params)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.mark.slow
def test_vllm_loads_merged_folder(ckpts, tmp_path):
    """vLLM's greedy tokens on the merged (LoRA) folder equal transformers'; in a subprocess because vllm
    sets torch's thread count to 1 for its whole process."""
    out = shard_merge.merge(ckpts["lora"], tmp_path / "hf", max_shard_size="200KB")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(out), json.dumps(PROMPTS.tolist())],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert json.loads(lines[-1].removeprefix("TOKENS ")) == greedy(tiny_model(True, lora=True))
