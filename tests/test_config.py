"""config.py: defaults, strict YAML, CLI precedence, Hydra-style overrides, --print-config round trip."""

import dataclasses
import re
import sys
from pathlib import Path
from typing import Literal

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import config  # noqa: E402


@dataclasses.dataclass(frozen=True)
class OptimCfg:
    lr: float = 1e-3
    """peak learning rate"""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas"""
    warmup_steps: int = 10
    """linear warmup (steps)"""


@dataclasses.dataclass(frozen=True)
class ModelCfg:
    path: str = "~/models/tiny"
    """model folder (~ expanded by the script)"""
    revision: str | None = None
    """optional revision"""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """parameter dtype"""


@dataclasses.dataclass(frozen=True)
class TinyCfg:
    """A tiny config tree for the tests."""

    model: ModelCfg = ModelCfg()
    """the model"""
    optim: OptimCfg = OptimCfg(warmup_steps=5)  # a parent default that differs from the class default
    """the optimizer"""
    logger: list[str] = dataclasses.field(default_factory=lambda: ["console"])
    """logging backends"""
    total_steps: int = 100
    """training steps"""
    packing: bool = False
    """pack sequences"""
    max_grad_norm: float | None = 1.0
    """clip norm; None disables"""


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return str(path)


def test_defaults():
    cfg = config.parse(TinyCfg, [])
    assert cfg == TinyCfg()
    assert cfg.optim.warmup_steps == 5 and cfg.optim.lr == 1e-3 and cfg.logger == ["console"]


def test_yaml_override_and_coercions(tmp_path):
    path = _write(
        tmp_path,
        "optim:\n  lr: 2e-5\n  betas: [0.8, 1]\nmodel:\n  revision: main\n  dtype: fp32\n"
        "logger: [console, jsonl]\npacking: true\nmax_grad_norm: ~\n",
    )
    assert yaml.safe_load(open(path))["optim"]["lr"] == "2e-5"  # the PyYAML quirk being handled
    cfg = config.parse(TinyCfg, ["--config", path])
    assert cfg.optim.lr == 2e-5 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.8, 1.0) and isinstance(cfg.optim.betas, tuple)
    assert cfg.optim.warmup_steps == 5  # keys absent from YAML keep the parent's default, not the class's
    assert cfg.model == ModelCfg(revision="main", dtype="fp32")
    assert cfg.model.path == "~/models/tiny"  # ~ is not expanded
    assert cfg.logger == ["console", "jsonl"] and cfg.packing is True and cfg.max_grad_norm is None
    assert cfg.total_steps == 100


def test_cli_beats_yaml(tmp_path):
    path = _write(tmp_path, "optim:\n  lr: 2e-5\ntotal_steps: 7\n")
    cfg = config.parse(TinyCfg, ["--optim.lr", "3e-4", f"--config={path}", "--logger", "jsonl"])
    assert cfg.optim.lr == 3e-4  # CLI
    assert cfg.total_steps == 7  # YAML
    assert cfg.optim.warmup_steps == 5  # default
    assert cfg.logger == ["jsonl"]
    cfg = config.parse(TinyCfg, ["--config", path, "--total-steps", "9"])  # tyro's hyphen spelling too
    assert cfg.total_steps == 9 and cfg.optim.lr == 2e-5


@dataclasses.dataclass(frozen=True)
class RolloutCfg:
    engine_process: bool = False
    """the engine core in its own process"""


@dataclasses.dataclass(frozen=True)
class NestedBoolCfg:
    rollout: RolloutCfg = RolloutCfg()
    """the rollout"""
    packing: bool = True
    """pack sequences"""


@pytest.mark.parametrize(
    "argv, engine_process, packing",
    [
        (["--rollout.engine_process", "true"], True, True),
        (["--rollout.engine_process"], True, True),  # tyro's own spelling still works
        (["--rollout.engine-process=False", "--packing", "no"], False, False),
        (["--rollout.engine_process", "TRUE", "--packing=off"], True, False),
        (
            ["--rollout.engine_process", "false", "rollout.engine_process=true"],
            False,
            True,
        ),  # flags beat overrides
    ],
)
def test_bool_flags_take_a_value_as_argparse_and_hydra_users_write_them(argv, engine_process, packing):
    """`--rollout.engine_process true` was "Unrecognized options: true" (tyro's bool flags take no value)."""
    cfg = config.parse(NestedBoolCfg, argv)
    assert (cfg.rollout.engine_process, cfg.packing) == (engine_process, packing)


def test_a_bool_flag_with_another_word_is_still_an_error():
    assert config.bool_flags(NestedBoolCfg, ["--packing", "maybe"]) == ["--packing", "maybe"]
    with pytest.raises(SystemExit):
        config.parse(NestedBoolCfg, ["--packing", "maybe"])
    # a non-bool field keeps its value, whatever the word
    assert config.bool_flags(TinyCfg, ["--total_steps", "true"]) == ["--total_steps", "true"]


@pytest.mark.parametrize(
    "text, needles",
    [
        ("optim:\n  lrr: 1.0\n", ["unknown key 'optim.lrr'", "known: lr, betas, warmup_steps"]),
        ("totl_steps: 3\n", ["unknown key 'totl_steps'"]),
        ("total_steps: ten\n", ["'total_steps'", "int"]),
        ("total_steps: 1.5\n", ["'total_steps'", "int"]),
        ("packing: 'yes'\n", ["'packing'", "bool"]),
        ("packing: 1\n", ["'packing'", "bool"]),
        ("model:\n  dtype: fp16\n", ["'model.dtype'", "bf16", "fp32", "fp16"]),
        ("optim:\n  lr: fast\n", ["'optim.lr'", "float"]),
        ("optim:\n  lr: ~\n", ["'optim.lr'", "null"]),
        ("optim:\n  betas: [0.9]\n", ["'optim.betas'", "2 items"]),
        ("optim: 3\n", ["'optim'"]),
        ("logger: console\n", ["'logger'"]),
        ("logger: [console, 3]\n", ["'logger[1]'"]),
    ],
)
def test_strict_errors_name_the_key(tmp_path, text, needles):
    path = _write(tmp_path, text)
    with pytest.raises(SystemExit) as exc:
        config.parse(TinyCfg, ["--config", path])
    msg = str(exc.value.code)
    assert msg.startswith(f"error: {path}: ")
    for needle in needles:
        assert needle in msg, msg


def test_from_dict_raises_config_error_as_value_error():
    with pytest.raises(ValueError, match=r"ckpt/config.yaml: unknown key 'model.pth'"):
        config.from_dict(TinyCfg, {"model": {"pth": "x"}}, source="ckpt/config.yaml")


def test_print_config_round_trips(tmp_path, capsys):
    path = _write(tmp_path, "optim:\n  lr: 2e-5\nmodel:\n  revision: main\n")
    argv = ["--config", path, "--packing", "--optim.betas", "0.5", "0.6", "--max_grad_norm", "None"]
    expected = config.parse(TinyCfg, argv)
    with pytest.raises(SystemExit) as exc:
        config.parse(TinyCfg, argv + ["--print-config"])
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["optim"]["lr"] == 2e-5
    back = config.parse(TinyCfg, ["--config", _write(tmp_path, printed)])
    assert back == expected
    assert back.optim.betas == (0.5, 0.6) and back.packing is True and back.max_grad_norm is None
    assert config.from_dict(TinyCfg, config.to_dict(expected)) == expected  # the resume path
    assert config.to_dict(expected)["optim"] == {"lr": 2e-5, "betas": [0.5, 0.6], "warmup_steps": 5}


def test_help_shows_yaml_defaults(tmp_path, capsys):
    path = _write(tmp_path, "total_steps: 4321\n")
    with pytest.raises(SystemExit) as exc:
        config.parse(TinyCfg, ["--config", path, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "4321" in out and "training steps" in out and "--print-config" in out


def test_overrides_on_any_config(tmp_path, capsys):
    """Hydra-style overrides work for a tree without a verl table: flatrl's own names, strictly."""
    path = _write(tmp_path, "optim:\n  lr: 2e-5\ntotal_steps: 7\n")
    argv = [
        "--config",
        path,
        "optim.lr=3e-4",
        "model.revision=null",
        "+logger=[console, jsonl]",
        "~total_steps",
    ]
    cfg = config.parse(TinyCfg, argv)
    assert cfg.optim.lr == 3e-4 and cfg.model.revision is None and cfg.logger == ["console", "jsonl"]
    assert cfg.total_steps == 100  # ~ put the default back over the YAML's 7
    assert config.parse(TinyCfg, ["model.path=0.10"]).model.path == "0.10"  # text for a str field
    with pytest.raises(SystemExit, match="unknown key 'optim.lrr' \\(known: lr, betas, warmup_steps\\)"):
        config.parse(TinyCfg, ["optim.lrr=1"])
    with pytest.raises(SystemExit, match="command line 'total_steps=ten': key 'total_steps' expects int"):
        config.parse(TinyCfg, ["total_steps=ten"])
    with pytest.raises(SystemExit) as exc:
        config.parse(TinyCfg, argv + ["--print-config"])
    assert exc.value.code == 0
    assert config.parse(TinyCfg, ["--config", _write(tmp_path, capsys.readouterr().out)]) == cfg


@pytest.mark.parametrize(
    "script, flag, value, allowed",
    [
        ("sft", "optim.lr", "inf", "> 0"),
        ("sft", "optim.lr", "nan", "> 0"),
        ("sft", "optim.lr", "-1", "> 0"),
        ("sft", "optim.clip_grad", "-1", "> 0"),
        ("sft", "trainer.total_training_steps", "0", ">= 1"),
        ("sft", "data.train_batch_size", "0", ">= 1"),
        ("sft", "data.micro_batch_size_per_gpu", "0", ">= 1"),
        ("grpo", "data.train_batch_size", "-4", ">= 1"),
        ("grpo", "data.max_response_length", "0", ">= 1"),
        ("grpo", "actor.ppo_micro_batch_size_per_gpu", "0", ">= 1"),
        ("grpo", "actor.ppo_epochs", "0", ">= 1"),
        ("grpo", "actor.optim.lr", "nan", "> 0"),
        ("grpo", "actor.optim.betas", "[0.9,1.5]", "in [0, 1]"),
        ("grpo", "custom_reward_function.max_error_frac", "2", "in [0, 1]"),
        ("ppo", "critic.ppo_epochs", "0", ">= 1"),
        ("ppo", "algorithm.lam", "1.5", "in [0, 1]"),
    ],
)
def test_numeric_fields_are_checked_at_parse(script, flag, value, allowed):
    """A number outside its field's range (config.Range, written next to the field) is one error line naming the
    key, the value and the allowed range, at parse time: before, lr inf trained to NaN weights and exited 0,
    clip_grad -1 ascended the loss, total_training_steps 0 ran a whole epoch, and zeros ended in tracebacks."""
    module = __import__(script)
    cls = {"sft": "SFTConfig", "grpo": "GRPOConfig", "ppo": "PPOConfig"}[script]
    with pytest.raises(SystemExit) as e:
        config.parse(getattr(module, cls), [f"{flag}={value}"])
    assert str(e.value).startswith(f"error: {flag}=") and f"must be {allowed}" in str(e.value), e.value


def test_in_range_edges_pass():
    import grpo

    cfg = config.parse(grpo.GRPOConfig, ["actor.entropy_coeff=0", "trainer.timeout_s=inf", "algorithm.lam=1"])
    assert cfg.actor.entropy_coeff == 0 and cfg.trainer.timeout_s == float("inf")


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("rollout.n", "0", ">= 1"),
        ("rollout.top_p", "0", "in (0, 1]"),
        ("rollout.gpu_memory_utilization", "1.5", "in (0, 1]"),
    ],
)
def test_rollout_numbers_are_checked_at_parse(flag, value, allowed):
    import grpo

    with pytest.raises(SystemExit, match=rf"error: {flag}={value}\S* must be {re.escape(allowed)}"):
        config.parse(grpo.GRPOConfig, [f"{flag}={value}"])


def test_checkpointed_layers_take_all_auto_or_a_count():
    """model.gradient_checkpointing_layers (`Literal['all', 'auto'] | int`): each arm parses from an override, a
    tyro flag or YAML; anything else is one line that names the key and both arms; a negative count is refused."""
    import grpo

    parse = lambda *argv: config.parse(grpo.GRPOConfig, list(argv)).model.gradient_checkpointing_layers  # noqa: E731
    assert parse("model.gradient_checkpointing_layers=auto") == "auto"
    assert parse("actor_rollout_ref.model.gradient_checkpointing_layers=12") == 12
    assert parse("--model.gradient-checkpointing-layers", "7") == 7
    assert parse() == "all"
    with pytest.raises(SystemExit, match=r"expects one of \['all', 'auto'\] \| int, got str 'some'"):
        parse("model.gradient_checkpointing_layers=some")
    with pytest.raises(SystemExit, match="a layer count >= 0, got -1"):
        parse("model.gradient_checkpointing_layers=-1")
