"""DAPO's overlong penalty (custom_reward_function.overlong_buffer; verl's dapo reward manager with
reward_kwargs.overlong_buffer_cfg): the formula, its place in scoring.score, verl's three spellings of it, and a
GRPO run on the toy whose only reward is the penalty, which shortens the responses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import toy_grpo_config

import actor
import config
import grpo
import reward
import rl
import scoring

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (18, -1.5)],  # max 16, buffer 4, factor 1
)
def test_penalty_is_zero_before_the_buffer_then_linear(length, expected):
    assert reward.overlong_penalty(length, 16, 4, 1.0) == pytest.approx(expected)
    assert reward.overlong_penalty(length, 16, 4, 0.5) == pytest.approx(expected / 2)


def test_score_adds_the_penalty_and_logs_verl_keys():
    """scoring.score with the buffer on: each sample's score is the function's plus the penalty of its token
    count; with log, reward/overlong_reward is the mean penalty and reward/overlong the share penalised (verl's
    extra-info names); off, the scores are the function's."""

    class Pool:  # the RewardPool interface scoring.score uses
        def score(self, items):
            self.last_extras = [{}] * len(items)
            return [1.0] * len(items), {}

    class Tok:
        def batch_decode(self, ids, skip_special_tokens=True):
            return ["x" * len(one) for one in ids]

    prompts = [dict(data_source="d", raw_prompt="p", ground_truth="g", extra_info={})]
    samples = [actor.Sample([1], [2] * n, None, "stop", 0) for n in (2, 4, 6, 8)]
    ob = scoring.OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0, max_resp_len=8, log=True)
    metrics = scoring.score(Pool(), samples, prompts, Tok(), ob)
    assert [s.score for s in samples] == pytest.approx([1.0, 1.0, 0.5, 0.0])
    assert metrics["reward/overlong_reward"] == pytest.approx(-1.5 / 4)
    assert metrics["reward/overlong"] == pytest.approx(0.5)
    metrics = scoring.score(Pool(), samples, prompts, Tok())
    assert [s.score for s in samples] == [1.0] * 4 and metrics == {}


def test_max_resp_len_defaults_to_the_response_cap_and_must_hold_the_buffer():
    cfg = grpo.GRPOConfig(
        data=rl.RLDataConfig(max_response_length=64),
        custom_reward_function=scoring.RewardConfig(
            overlong_buffer=scoring.OverlongBufferConfig(enable=True, len=16)
        ),
    )
    assert scoring.overlong_buffer(cfg).max_resp_len == 64
    off = grpo.GRPOConfig()
    assert scoring.overlong_buffer(off) is None
    long = grpo.GRPOConfig(
        data=rl.RLDataConfig(max_response_length=64),
        custom_reward_function=scoring.RewardConfig(
            overlong_buffer=scoring.OverlongBufferConfig(enable=True, len=65)
        ),
    )
    with pytest.raises(ValueError, match="overlong_buffer.len=65 must be at most its max_resp_len=64"):
        scoring.overlong_buffer(long)


@pytest.mark.parametrize(
    "args",
    [
        [  # verl's examples with main_ppo (before 0.9.1 these keys lived under reward_model)
            "reward_model.reward_manager=dapo",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=128",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=True",
            "+reward_model.reward_kwargs.max_resp_len=512",
        ],
        [  # verl 0.9.1's reward section
            "reward.reward_manager.name=dapo",
            "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward.reward_kwargs.overlong_buffer_cfg.len=128",
            "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            "+reward.reward_kwargs.overlong_buffer_cfg.log=True",
            "+reward.reward_kwargs.max_resp_len=512",
        ],
        [  # verl's DAPO recipe: the buffer ends at data.max_response_length
            "reward_model.reward_manager=dapo",
            "reward_model.overlong_buffer.enable=True",
            "reward_model.overlong_buffer.len=128",
            "reward_model.overlong_buffer.penalty_factor=0.5",
            "reward_model.overlong_buffer.log=True",
            "data.max_response_length=512",
        ],
    ],
)
def test_verl_spellings_map_to_the_buffer(args, capsys):
    cfg = config.parse(grpo.GRPOConfig, args)
    assert scoring.overlong_buffer(cfg) == scoring.OverlongBufferConfig(
        enable=True, len=128, penalty_factor=0.5, max_resp_len=512, log=True
    )
    assert "-> custom_reward_function.overlong_buffer.len" in capsys.readouterr().err


def test_grpo_with_only_the_penalty_shortens_the_responses(one_rank, toy_dir, tmp_path):
    """GRPO on the untrained toy (hf engine, one rank), a constant reward from the function (reward_kwargs' offset:
    the kwargs reach it in a run), so the penalty of every token
    past the first is all there is to learn: the mean response length falls (measured: 3.8 tokens over the first
    two steps, 1.0 over the last two) and the logged penalty rises towards 0.
    The untrained toy almost never stops within 8 tokens, so its copy here stops at any of 64 byte tokens too
    (generation_config.json's eos_token_id list, as Llama 3 has several): its first responses vary in length."""
    model = tmp_path / "model"
    shutil.copytree(toy_dir / "model", model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], *range(64)]
    (model / "generation_config.json").write_text(json.dumps(gen))
    fn = tmp_path / "zero.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, offset=None):\n"
        "    return offset\n"
    )
    run_dir = tmp_path / "run"
    cfg = toy_grpo_config(
        toy_dir,
        run_dir,
        fn,
        steps=12,
        lr=2e-2,
        batch=8,
        n=8,
        model=model,
        reward_kw={  # offset: the same for every response, so no advantage and no learning from it
            "reward_kwargs": {"offset": 0.25},
            "overlong_buffer": scoring.OverlongBufferConfig(enable=True, len=7, log=True),
        },
    )
    grpo.main(cfg)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if "timing_s/step" in r]
    lengths = [r["response_length/mean"] for r in rows]
    penalties = [r["reward/overlong_reward"] for r in rows]
    assert len(lengths) == 12
    first, last = sum(lengths[:2]) / 2, sum(lengths[-2:]) / 2
    assert last < first - 1.5 and last < 1.6, lengths
    assert sum(penalties[-2:]) / 2 > sum(penalties[:2]) / 2 + 0.2, penalties
    for r in rows:  # the logged reward: the function's (its keyword argument) plus the penalty
        assert r["reward/mean"] == pytest.approx(0.25 + r["reward/overlong_reward"], abs=1e-6)


def test_verl_reward_kwargs_reach_the_config(tmp_path, capsys):
    """`+custom_reward_function.reward_kwargs.K=V` (and verl 0.9.1's `reward.custom_reward_function.*`) fill the
    dict field, nested keys as mappings, values read as Hydra reads them; the resolved config loads back equal;
    `~` removes one; without a function path they are refused by name."""
    args = [
        "custom_reward_function.path=/f.py",
        "+custom_reward_function.reward_kwargs.alpha=0.8",
        "+reward.custom_reward_function.reward_kwargs.judge.max_tokens=512",
        "+custom_reward_function.reward_kwargs.mode=strict",
    ]
    cfg = config.parse(grpo.GRPOConfig, args)
    want = {"alpha": 0.8, "judge": {"max_tokens": 512}, "mode": "strict"}
    assert cfg.custom_reward_function.reward_kwargs == want
    saved = tmp_path / "c.yaml"
    saved.write_text(config.to_yaml(cfg))
    assert config.parse(grpo.GRPOConfig, ["--config", str(saved)]) == cfg
    less = config.parse(
        grpo.GRPOConfig, ["--config", str(saved), "~custom_reward_function.reward_kwargs.alpha"]
    )
    assert less.custom_reward_function.reward_kwargs == {"judge": {"max_tokens": 512}, "mode": "strict"}
    with pytest.raises(SystemExit, match=r"reward_kwargs=\{'alpha': 1\} needs custom_reward_function.path"):
        config.parse(grpo.GRPOConfig, ["+custom_reward_function.reward_kwargs.alpha=1"])
