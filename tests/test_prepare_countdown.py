"""scripts/prepare_countdown.py: seeded and byte-identical, solvable problems in range, disjoint splits; the rows load
with data.RLDataset and their ground truth has the shape reward.countdown_score reads (a correct equation scores 1);
the ChatML prompt equals a chat template's rendering; scripts/countdown_accuracy.py scores 1/0 through the pool."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import reward
import reward_pool

ROOT = Path(__file__).resolve().parents[1]
ACCURACY = ROOT / "scripts" / "countdown_accuracy.py"
_spec = importlib.util.spec_from_file_location("prepare_countdown", ROOT / "scripts" / "prepare_countdown.py")
pc = sys.modules.setdefault(
    "prepare_countdown", importlib.util.module_from_spec(_spec)
)  # dataclasses look it up
_spec.loader.exec_module(pc)

FILES = ["train.parquet", "test.parquet", "sft/train.parquet", "sft/test.parquet"]


def build(out: Path, **kw) -> Path:
    return pc.main(pc.Args(out=str(out), **({"n_train": 300, "n_test": 60, "n_sft": 200} | kw)))


def rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def nano(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("countdown") / "nano")


def test_seeded_byte_identical_and_disjoint(nano, tmp_path):
    digest = {f: hashlib.sha256((nano / f).read_bytes()).hexdigest() for f in FILES}
    again = build(tmp_path / "again")
    assert {f: hashlib.sha256((again / f).read_bytes()).hexdigest() for f in FILES} == digest
    other = build(tmp_path / "other", seed=1)
    assert hashlib.sha256((other / "test.parquet").read_bytes()).hexdigest() != digest["test.parquet"]

    def key(r: dict) -> tuple:
        gt = r["reward_model"]["ground_truth"]
        return tuple(sorted(gt["numbers"])), gt["target"]

    train, test = rows(nano / "train.parquet"), rows(nano / "test.parquet")
    assert len(train) == 300 and len(test) == 60
    assert not {key(r) for r in test} & {key(r) for r in train}
    assert len({key(r) for r in train + test}) == 360  # no problem twice
    assert len(rows(nano / "sft" / "train.parquet")) == 200


def test_every_problem_is_solvable_and_in_range(nano):
    test = rows(nano / "test.parquet")
    for split in ("train", "test"):
        for i, r in enumerate(rows(nano / f"{split}.parquet")):
            gt = r["reward_model"]["ground_truth"]
            assert r["data_source"] == "countdown" and r["extra_info"]["split"] == split
            assert r["extra_info"]["index"] == i and r["reward_model"]["style"] == "rule"
            assert len(gt["numbers"]) in (3, 4) and all(1 <= n <= 99 for n in gt["numbers"])
            assert 1 <= gt["target"] <= 99
            user = r["prompt"][-1]["content"]
            assert user.startswith(
                f"Using the numbers {gt['numbers']}, create an equation that equals {gt['target']}."
            )
            answer = f"<answer>{r['extra_info']['solution']}</answer>"
            assert reward.default_compute_score("countdown", answer, gt) == 1.0, r
    counts = [len(r["reward_model"]["ground_truth"]["numbers"]) for r in test]
    assert 15 <= counts.count(4) <= 45  # the count is drawn 50/50, not skewed by the target range
    # The SFT test split holds the same problems, each with a worked solution that scores 1.
    for r, s in zip(test, rows(nano / "sft" / "test.parquet"), strict=True):
        assert s["prompt"] == r["prompt"][-1]["content"]
        assert reward.countdown_score(s["response"], r["reward_model"]["ground_truth"]) == 1.0
        steps = (
            re.fullmatch(r"<think>(.*)</think>\n<answer>(.*)</answer>", s["response"]).group(1).split(", ")
        )
        assert len(steps) == len(r["reward_model"]["ground_truth"]["numbers"]) - 1  # one step per operation
        a, op, b, c = re.fullmatch(r"(\d+)([-+*/])(\d+)=(\d+)", steps[-1]).groups()
        assert int(c) == r["reward_model"]["ground_truth"]["target"]


def test_chatml_matches_a_chat_template(toy_dir):
    msgs = [
        {"role": "system", "content": pc.SYSTEM_MESSAGE},
        {"role": "user", "content": "Using the numbers [1, 2]"},
    ]
    # toy.py's template is Qwen2.5's without the default system message: with one given they render the same.
    tok = AutoTokenizer.from_pretrained(toy_dir / "model")
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert pc.chatml(msgs, pc.ASSISTANT_PREFILL) == rendered + "Let me solve this step by step.\n<think>"
    assert (
        pc.chatml(msgs[1:], "")
        == "<|im_start|>user\nUsing the numbers [1, 2]<|im_end|>\n<|im_start|>assistant\n"
    )


def test_rows_load_with_rldataset_and_score(nano, toy_dir):
    tok = AutoTokenizer.from_pretrained(toy_dir / "model")
    raw = rows(nano / "test.parquet")
    # nano-aha-moment's setting: the pre-rendered ChatML string, no chat template applied on top.
    ds = data.RLDataset(
        str(nano / "test.parquet"),
        tok,
        prompt_key="prompt_chatml",
        max_prompt_length=1024,
        apply_chat_template=False,
    )
    assert len(ds) == 60 and ds.dropped_overlong == 0
    for ex, r in zip((ds[i] for i in range(len(ds))), raw, strict=True):
        assert ex["raw_prompt"] == r["prompt_chatml"] and ex["raw_prompt"].endswith(
            "assistant\nLet me solve this step by step.\n<think>"
        )
        gt = ex["ground_truth"]
        assert gt == {
            "target": r["reward_model"]["ground_truth"]["target"],
            "numbers": r["reward_model"]["ground_truth"]["numbers"],
        }
        response = f" I add them.</think>\n<answer>{r['extra_info']['solution']}</answer>"
        assert reward.default_compute_score(ex["data_source"], response, gt, ex["extra_info"]) == 1.0
        n = gt["numbers"]
        wrong = f"</think>\n<answer>{'+'.join(map(str, n))}+1</answer>"  # an extra number: well-formed, wrong
        assert reward.default_compute_score(ex["data_source"], wrong, gt) == pytest.approx(0.1)
    # The chat-message prompt column loads too (rendered by the tokenizer's template).
    chat = data.RLDataset(str(nano / "test.parquet"), tok, max_prompt_length=1024)
    assert chat[0]["raw_prompt"].startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert chat[0]["ground_truth"] == ds[0]["ground_truth"]


def test_plain_style_and_model(tmp_path):
    out = build(tmp_path / "plain", style="plain", n_train=50, n_test=20, n_sft=100, model_out=str(tmp_path / "model"),
                hidden_size=128, num_layers=2)  # fmt: skip
    r = rows(out / "train.parquet")[0]
    gt = r["reward_model"]["ground_truth"]
    assert r["prompt"] == [
        {
            "role": "user",
            "content": f"Using the numbers {gt['numbers']}, create an equation that equals {gt['target']}.",
        }
    ]
    assert "prompt_chatml" not in r
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tok) <= 400
    ids = tok("<answer>(44+19)+35</answer>", add_special_tokens=False)["input_ids"]
    assert [t for t in tok.convert_ids_to_tokens(ids) if t.isdigit()] == list(
        "441935"
    )  # digits single tokens
    ds = data.RLDataset(str(out / "test.parquet"), tok, max_prompt_length=48)
    assert len(ds) == 20 and max(len(ex["prompt_ids"]) for ex in ds.examples) <= 48


def test_accuracy_reward_is_one_or_zero():
    fn = reward.load_reward_fn(str(ACCURACY), "compute_score")
    gt = {"target": 24, "numbers": [2, 3, 4]}
    assert fn("countdown", "<answer>(2+4)*4</answer>", gt) == 0.0  # well-formed, wrong: 0.1 by default
    assert reward.default_compute_score("countdown", "<answer>(2+4)*4</answer>", gt) == pytest.approx(0.1)
    assert fn("countdown", "<answer>2*3*4</answer>", gt) == 1.0
    with pytest.raises(ValueError, match="countdown rows only"):
        fn("openai/gsm8k", "#### 1", "1")
    # Through the worker pool, as repro.sh's runs use it (the worker imports reward.py from the repo).
    pool = reward_pool.RewardPool((str(ACCURACY), "compute_score"), num_workers=1, timeout_s=30)
    try:
        items = [
            dict(data_source="countdown", prompt="p", response=resp, ground_truth=gt, extra_info={})
            for resp in ("<answer>2*3*4</answer>", "<answer>2+3+4</answer>", "no answer")
        ]
        scores, metrics = pool.score(items)
    finally:
        pool.close()
    assert scores == [1.0, 0.0, 0.0] and metrics["reward/errors"] == 0
