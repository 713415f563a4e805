"""Shared fixtures: the toy model and data (built once per test session), a one-rank process group in the test
process, and a torchrun launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory) -> Path:
    """runs/toy-like folder: model/, sft/, rl/ from toy.build (deterministic, offline)."""
    import toy

    out = tmp_path_factory.mktemp("toy")
    toy.build(out)
    return out


@pytest.fixture
def tiny_qwen2(tmp_path) -> Path:
    """A one-layer Qwen2 of random weights saved as a Hugging Face folder: loaded through fsdp.load_model it
    arrives in eval mode, as a real checkpoint does (a model built from its config starts in train mode)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "tiny_qwen2")
    return tmp_path / "tiny_qwen2"


@pytest.fixture
def one_rank(monkeypatch):
    """A one-process gloo group in this process (as `python sft.py` makes one), destroyed after the test."""

    import fsdp

    env = dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield fsdp.init_distributed(timeout_s=120)
    fsdp.close_distributed(finished=True)  # its gloo threads end now, not at the pytest process's exit


# Environment of the CPU RL runs: vLLM in-process (collective_rpc reaches the trainer's tensors), a 1 GiB KV cache.
VLLM_CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def flags(d: dict) -> list[str]:
    """{"trainer.val_only": "", "data.seed": 1} -> ["--trainer.val_only", "--data.seed", "1"] ("" = a bare flag)."""
    out = []
    for k, v in d.items():
        out += [f"--{k}"] if v == "" else [f"--{k}", str(v)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, args: list[str], nproc: int = 2, timeout_s: float = 600, env: dict | None = None):
    """Runs `torchrun --nproc_per_node nproc script args` from the repo root; fails the test on error."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(ROOT / script), *args,
    ]  # fmt: skip
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    p = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return p


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl as a list of dicts."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def toy_grpo_config(
    toy_dir: Path,
    run_dir: Path,
    reward_py: Path,
    *,
    steps: int,
    lr: float,
    batch: int = 4,
    n: int = 2,
    model: Path | None = None,
    rollout_kw: dict | None = None,
    reward_kw: dict | None = None,
    algorithm=None,
    **trainer_kw,
):
    """grpo.py on the toy with the hf engine, in this process: `batch` prompts a step x `n` responses of up to 8
    tokens, AdamW at `lr` without weight decay, the function in reward_py scored in process, metrics to jsonl
    only, no checkpoints unless trainer_kw says so."""
    import grpo
    import rl
    import rollout
    import scoring

    return grpo.GRPOConfig(
        data=rl.RLDataConfig(
            train_files=str(toy_dir / "rl/train.parquet"),
            val_files=None,
            train_batch_size=batch,
            max_prompt_length=32,
            max_response_length=8,
        ),
        model=grpo.actor.ModelConfig(path=str(model or toy_dir / "model")),
        actor=grpo.actor.ActorConfig(
            ppo_mini_batch_size=batch, optim=grpo.optim.OptimConfig(lr=lr, weight_decay=0.0)
        ),
        rollout=rollout.RolloutConfig(name="hf", n=n, **(rollout_kw or {})),
        algorithm=algorithm or grpo.AlgorithmConfig(),
        custom_reward_function=scoring.RewardConfig(path=str(reward_py), num_workers=0, **(reward_kw or {})),
        trainer=rl.RLTrainerConfig(
            default_local_dir=str(run_dir),
            total_training_steps=steps,
            logger=["jsonl"],
            **({"save_freq": -1} | trainer_kw),
        ),
    )
