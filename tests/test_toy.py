"""toy.py: deterministic build, Hugging Face round trip, data schema, disjoint splits, checkable answers."""

import hashlib
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import toy

FILES = ["model/model.safetensors", "model/tokenizer.json", "model/config.json"] + [
    f"{part}/{split}.parquet" for part in ("sft", "rl") for split in ("train", "val")
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return toy.build(tmp_path_factory.mktemp("toy") / "a", seed=0, n_train=300, n_val=50)


def test_build_is_byte_identical(built: Path, tmp_path: Path) -> None:
    again = toy.build(tmp_path / "b", seed=0, n_train=300, n_val=50)
    assert {f: _sha256(built / f) for f in FILES} == {f: _sha256(again / f) for f in FILES}
    other = toy.build(tmp_path / "c", seed=1, n_train=300, n_val=50)
    assert _sha256(other / "model/model.safetensors") != _sha256(built / "model/model.safetensors")
    assert _sha256(other / "sft/val.parquet") != _sha256(built / "sft/val.parquet")


def test_model_loads_tied_and_small(built: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(built / "model")
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert cfg.hidden_size // cfg.num_attention_heads == 64  # vLLM CPU needs head_dim 64
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    tok = AutoTokenizer.from_pretrained(built / "model")
    assert cfg.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    ids = torch.tensor([tok("What is 12 + 34?")["input_ids"]])  # [1, T]
    logits = model(ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_tokenizer_round_trip(built: Path) -> None:
    tok = AutoTokenizer.from_pretrained(built / "model")
    raw = Tokenizer.from_file(str(built / "model/tokenizer.json"))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert tok.pad_token_id != tok.eos_token_id
    texts = [
        "What is 47 + 38?",
        "12-7=5, borrow 1\n5-1-1=3\n#### 35",
        "héllo 😀  x\n\n",
        "<|im_start|>user\nhi",
    ]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == raw.encode(text).ids  # transformers' class rebuilds the pipeline; it must agree
        assert tok.decode(ids) == text
    # every digit its own token, also inside numbers
    ids = tok("What is 9876543210 - 10?")["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert "".join(p for p in pieces if p.isdigit()) == "987654321010"
    assert sum(p.isdigit() and len(p) == 1 for p in pieces) == 12
    assert {tok.decode([i]) for i in tok("0123456789")["input_ids"]} == set("0123456789")


def test_chat_template(built: Path) -> None:
    tok = AutoTokenizer.from_pretrained(built / "model")
    messages = [{"role": "user", "content": "What is 47 + 38?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 47 + 38?<|im_end|>\n<|im_start|>assistant\n"
    plain = tok.apply_chat_template(messages, tokenize=False)
    assert plain == "<|im_start|>user\nWhat is 47 + 38?<|im_end|>\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == tok(text)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2


def test_parquet_schema_and_splits(built: Path) -> None:
    tables = {f: pq.read_table(built / f) for f in FILES if f.endswith(".parquet")}
    for name in ("sft/train", "sft/val"):
        t = tables[f"{name}.parquet"]
        assert t.schema.names == ["prompt", "response"]
        assert all(field.type == pa.string() for field in t.schema)
    for name in ("rl/train", "rl/val"):
        t = tables[f"{name}.parquet"]
        assert t.schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        rows = t.to_pylist()
        split = name.split("/")[1]
        assert [r["extra_info"] for r in rows] == [{"split": split, "index": i} for i in range(len(rows))]
        assert {r["data_source"] for r in rows} == {"flatrl/toy"} and {r["ability"] for r in rows} == {"math"}
        assert all(r["reward_model"]["style"] == "rule" for r in rows)
        assert all(len(r["prompt"]) == 1 and r["prompt"][0]["role"] == "user" for r in rows)
    assert tables["sft/train.parquet"].num_rows == tables["rl/train.parquet"].num_rows == 300
    sft_val = tables["sft/val.parquet"].column("prompt").to_pylist()
    rl_val = [r["prompt"][0]["content"] for r in tables["rl/val.parquet"].to_pylist()]
    assert sft_val == rl_val and len(set(sft_val)) == 50  # same text for the same problem
    train = set(tables["sft/train.parquet"].column("prompt").to_pylist())
    train |= {r["prompt"][0]["content"] for r in tables["rl/train.parquet"].to_pylist()}
    assert not train & set(sft_val)


def test_answers_match_prompts(built: Path) -> None:
    sft = pq.read_table(built / "sft/train.parquet").to_pylist()
    rl = pq.read_table(built / "rl/train.parquet").to_pylist()
    ops, direct = set(), 0
    for row in sft:
        a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", row["prompt"]).groups()
        ops.add(op)
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        final = re.findall(r"#### (\-?[0-9\.\,]+)", row["response"])  # verl's gsm8k strict pattern
        assert row["response"].splitlines()[-1] == f"#### {expected}" and final == [str(expected)]
        lines = row["response"].count("\n")
        assert lines == 2 or row["response"] == f"#### {expected}"  # worked (3 lines) or the bare answer
        direct += lines == 0
    assert ops == {"+", "-"}
    assert abs(direct / len(sft) - toy.ToyConfig.direct_frac) < 0.08, direct / len(sft)  # 300 rows
    for row in rl:
        a, op, b = toy.parse_prompt(row["prompt"][0]["content"])
        assert row["reward_model"]["ground_truth"] == str(a + b if op == "+" else a - b)


def test_worked_steps_by_hand() -> None:
    assert toy.solve((47, "+", 38)) == ("7+8=15, carry 1\n4+3+1=8\n#### 85", "85")
    assert toy.solve((52, "-", 17)) == ("12-7=5, borrow 1\n5-1-1=3\n#### 35", "35")
    assert toy.solve((30, "-", 25)) == ("10-5=5, borrow 1\n3-2-1=0\n#### 5", "5")
    assert toy.solve((21, "+", 34)) == ("1+4=5\n2+3=5\n#### 55", "55")
    assert len(toy.all_problems()) == 90 * 90 + 90 * 91 // 2
    prompt, solution, answer = toy.make_problem(random.Random(0))
    assert toy.solve(toy.parse_prompt(prompt)) == (solution, answer)


def test_three_digit_worked_steps() -> None:
    """toy.py --digits 3 (scripts/repro.sh's task): every line is true arithmetic and the columns spell the answer."""
    assert toy.solve((512, "-", 498)) == ("12-8=4, borrow 1\n11-9-1=1, borrow 1\n5-4-1=0\n#### 14", "14")
    assert toy.solve((999, "+", 999)) == ("9+9=18, carry 1\n9+9+1=19, carry 1\n9+9+1=19\n#### 1998", "1998")
    assert toy.solve((305, "+", 104)) == ("5+4=9\n0+0=0\n3+1=4\n#### 409", "409")
    problems = toy.all_problems(3)
    assert len(problems) == 900 * 900 + 900 * 901 // 2
    for problem in random.Random(0).sample(problems, 3000):
        solution, answer = toy.solve(problem)
        *columns, last = solution.split("\n")
        assert last == f"#### {answer}" and len(columns) == 3
        values = []
        for line in columns:
            expr, value = line.split(",")[0].split("=")
            left, *rest = expr.replace("-", " -").replace("+", " +").split()
            assert int(left) + sum(int(t) for t in rest) == int(value), (problem, line)
            values.append(int(value))
        # ones and tens digits, then the top column's whole value: the answer read left to right
        assert int(f"{values[2]}{values[1] % 10}{values[0] % 10}") == int(answer), (problem, solution)


def test_three_digit_build_is_disjoint(tmp_path) -> None:
    out = toy.build(tmp_path / "t", seed=0, n_train=500, n_val=64, digits=3, hidden_size=128, num_layers=1)
    sft, val = (pq.read_table(out / "sft" / f"{s}.parquet").to_pylist() for s in ("train", "val"))
    assert len(val) == 64 and len(sft) == 500
    assert not {r["prompt"] for r in val} & {r["prompt"] for r in sft}
    assert all(99 < toy.parse_prompt(r["prompt"])[0] < 1000 for r in sft)
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 128
