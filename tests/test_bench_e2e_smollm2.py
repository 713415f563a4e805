"""bench_e2e.py's real-model shape (`--model smollm2`) without a GPU: its prompts are exactly `--prompt-len` tokens
of SmolLM2's own tokenizer, and each framework's settings carry LoRA (rank 32, alpha 32, all-linear) and gradient
checkpointing: flatrl's generated YAML parsed by grpo.py's config, TRL's GRPOConfig arguments and LoraConfig (and
the worker's argv, which must bring the shape back), verl's Hydra overrides (composed with verl's config where
FLATRL_VERL_SITE names the unpacked payload, as tests/test_bench_e2e_verl.py does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_e2e  # noqa: E402
import e2e_verl  # noqa: E402


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """models/smollm2-135m-instruct, as tests/test_real_model.py gets it (scripts/get_smollm2.py: ~20 s once)."""
    out = ROOT / "models" / "smollm2-135m-instruct"
    src = os.environ.get("FLATRL_SMOLLM2_SRC")
    cmd = [sys.executable, "scripts/get_smollm2.py", "--out", str(out), *(["--src", src] if src else [])]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return out


def real_args(model: Path, *argv: str):
    return bench_e2e.parse(["--model", "smollm2", "--model-path", str(model), *argv])


def test_word_prompts_are_prompt_len_tokens_of_the_real_tokenizer(smollm2, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    for word in bench_e2e.WORDS:  # one token alone (a prompt's first word) and after a space (every other)
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word
        assert len(tok(" " + word, add_special_tokens=False)["input_ids"]) == 1, word
    assert len(set(bench_e2e.WORDS)) == 64
    for length in (7, 256):
        data = bench_e2e.write_prompts(tmp_path / f"w{length}.parquet", rows=24, length=length, words=True)
        bench_e2e.check_prompts(str(smollm2), str(data), length)  # raises SystemExit on any other length
        prompts = pq.read_table(data)["prompt"].to_pylist()
        assert {len(tok(p)["input_ids"]) for p in prompts} == {length} and len(set(prompts)) == 24
    # The random-letter prompts of the Qwen shapes merge into fewer tokens here: the check must stop the run.
    letters = bench_e2e.write_prompts(tmp_path / "letters.parquet", rows=4, length=64)
    with pytest.raises(SystemExit, match=r"encodes the bench prompts of 64 .*--model smollm2"):
        bench_e2e.check_prompts(str(smollm2), str(letters), 64)
    # verl renders each prompt through RAW_TEMPLATE: the same tokens (its own check runs in verl's environment).
    verl_rows = pq.read_table(e2e_verl.write_prompts(str(data), tmp_path / "v.parquet"))["prompt"].to_pylist()
    tok.chat_template = e2e_verl.RAW_TEMPLATE
    ids = tok.apply_chat_template(verl_rows[0], tokenize=True, add_generation_prompt=True)
    assert len(ids["input_ids"] if hasattr(ids, "keys") else ids) == 256


def test_shape_flags(smollm2, tmp_path, capsys):
    args = real_args(smollm2)
    assert args.lora == {"rank": 32, "alpha": 32, "target_modules": "all-linear"}
    assert args.gradient_checkpointing and args.prompt_len == 256 and args.response_len == 512
    assert bench_e2e.parse(["--model", "0.5b"]).lora is None
    with pytest.raises(SystemExit):
        real_args(smollm2, "--no-gradient-checkpointing")
    assert "smollm2 shape runs LoRA with gradient checkpointing everywhere" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the real model needs its folder
        bench_e2e.parse(["--model", "smollm2"])
    with pytest.raises(SystemExit):  # a folder without config.json / tokenizer.json
        bench_e2e.parse(["--model", "smollm2", "--model-path", str(tmp_path)])
    with pytest.raises(SystemExit):  # a built shape takes no folder: not dropped silently
        bench_e2e.parse(["--model", "0.5b", "--model-path", str(smollm2)])


def test_flatrl_yaml_has_lora_and_checkpointing(smollm2, tmp_path):
    import config
    import grpo

    args = real_args(smollm2)
    path = bench_e2e.flatrl_config(args, str(smollm2), str(tmp_path / "p.parquet"), str(tmp_path / "run"))
    cfg = config.parse(grpo.GRPOConfig, ["--config", path])  # strict: an unknown key fails here
    m = cfg.model
    assert (m.lora_rank, m.lora_alpha, m.target_modules) == (32, 32.0, "all-linear")
    assert m.enable_gradient_checkpointing and m.path == str(smollm2)
    assert cfg.rollout.n == 8 and cfg.data.max_prompt_length == 256 and cfg.data.max_response_length == 512
    assert cfg.data.train_batch_size == 64 and cfg.actor.optim.lr == 1e-6 and not cfg.data.apply_chat_template
    for flags, ckpt in (([], True), (["--no-gradient-checkpointing"], False)):  # flatrl's default, and off
        args = bench_e2e.parse(["--model", "0.5b", *flags])
        base = config.parse(
            grpo.GRPOConfig, ["--config", bench_e2e.flatrl_config(args, "/m", "/d", str(tmp_path))]
        )
        assert base.model.lora_rank == 0 and base.model.enable_gradient_checkpointing is ckpt


def test_trl_gets_lora_and_checkpointing_through_the_worker(smollm2):
    args = real_args(smollm2, "--trl-steps", "2")
    # The worker is another process: its argv must bring the shape (and so LoRA) back.
    worker = bench_e2e.parse(bench_e2e.worker_argv(args, str(smollm2), "/d.parquet", "/w", "/w/trl.json"))
    assert worker.worker == "trl" and worker.model_path == str(smollm2) and worker.steps == 2
    assert worker.lora == bench_e2e.REAL_LORA and worker.gradient_checkpointing
    kw = bench_e2e.trl_kwargs(worker)
    assert kw["gradient_checkpointing"] is True and kw["max_steps"] == 2 and kw["learning_rate"] == 1e-6
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == 64 * 8
    pytest.importorskip("peft")
    lora = bench_e2e.trl_peft_config(worker)
    assert (lora.r, lora.lora_alpha, lora.target_modules, lora.lora_dropout) == (32, 32, "all-linear", 0.0)
    assert bench_e2e.trl_peft_config(bench_e2e.parse(["--model", "0.5b"])) is None


def verl_kv(args) -> dict[str, str]:
    return dict(o.lstrip("+").split("=", 1) for o in e2e_verl.overrides(args, "/m", "/d.parquet", "/run"))


def test_verl_overrides_carry_lora_and_checkpointing(smollm2):
    kv = verl_kv(real_args(smollm2))
    assert (
        kv["actor_rollout_ref.model.lora_rank"] == "32" and kv["actor_rollout_ref.model.lora_alpha"] == "32"
    )
    assert kv["actor_rollout_ref.model.target_modules"] == "all-linear"
    assert kv["actor_rollout_ref.model.enable_gradient_checkpointing"] == "True"
    assert kv["actor_rollout_ref.rollout.load_format"] == "safetensors"
    assert kv["actor_rollout_ref.actor.optim.lr"] == "1e-6" and kv["data.max_response_length"] == "512"
    base = verl_kv(bench_e2e.parse(["--model", "0.5b"]))
    assert (
        "actor_rollout_ref.model.lora_rank" not in base
        and "actor_rollout_ref.rollout.load_format" not in base
    )


@pytest.mark.skipif(
    not os.environ.get("FLATRL_VERL_SITE"), reason="FLATRL_VERL_SITE (the verl payload) not set"
)
def test_verl_lora_overrides_compose_with_verls_config(smollm2, monkeypatch):
    site = os.environ["FLATRL_VERL_SITE"]
    monkeypatch.syspath_prepend(site)
    from hydra import compose, initialize_config_dir

    ov = [o for o in e2e_verl.overrides(real_args(smollm2), "/m", "/d", "/run") if not o.startswith("hydra.")]
    with initialize_config_dir(config_dir=f"{site}/verl/trainer/config", version_base=None):
        cfg = compose("ppo_trainer", overrides=ov)  # an unknown key raises here
    m = cfg.actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, m.target_modules) == (32, 32, "all-linear")
    assert m.enable_gradient_checkpointing and cfg.actor_rollout_ref.rollout.load_format == "safetensors"


def test_a_framework_that_times_out_is_an_error_not_a_lost_run(tmp_path):
    # One device call holds all three frameworks: a timed-out one must leave the others' figures in the JSON.
    args = bench_e2e.parse(["--model", "0.5b", "--timeout-s", "0.5"])
    r = bench_e2e.run_flatrl(args, str(tmp_path / "m"), str(tmp_path / "d.parquet"), str(tmp_path))
    assert r["error"] == "grpo.py timed out after 0.5 s" and isinstance(r["tail"], str)
