"""dpo.py without training: each preference loss against the paper's formula written out by hand, the metrics of
a micro-batch, the row layouts (TRL's strings and messages, UltraFeedback's full conversations, KTO), and one clear
error per bad row."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import dpo
import losses

# Four pairs of fixed sequence logprobs: policy chosen / rejected, reference chosen / rejected.
PC = [-10.0, -3.5, -7.25, -20.0]
PR = [-12.0, -3.0, -9.5, -18.0]
RC = [-11.0, -4.0, -7.0, -19.5]
RR = [-11.5, -2.75, -8.0, -19.0]


def t(x: list[float]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, t(expected), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.2), (2.0, 0.0)])
def test_dpo_sigmoid_loss_is_the_papers(beta, eps):
    # DPO eq. 7 with cDPO's smoothing: -(1 - eps) log sig(beta h) - eps log sig(-beta h)
    want = []
    for pc, pr, rc, rr in zip(PC, PR, RC, RR, strict=True):
        h = (pc - rc) - (pr - rr)
        want.append(-(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h))
    close(losses.dpo_sigmoid_loss(t(PC), t(PR), t(RC), t(RR), beta, eps), want)
    # pair 0: h = (-10 + 11) - (-12 + 11.5) = 1.5; at beta 0.1, eps 0: -log sig(0.15) = log(1 + e^-0.15) = 0.620957
    if (beta, eps) == (0.1, 0.0):
        assert abs(want[0] - 0.6209570) < 1e-6


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_ipo_loss_is_the_papers(beta):
    want = [
        ((pc - rc) - (pr - rr) - 1 / (2 * beta)) ** 2 for pc, pr, rc, rr in zip(PC, PR, RC, RR, strict=True)
    ]
    close(losses.ipo_loss(t(PC), t(PR), t(RC), t(RR), beta), want)
    assert beta != 0.1 or abs(want[0] - (1.5 - 5) ** 2) < 1e-12  # pair 0: (h - 1 / 0.2)^2 = 12.25


@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 0.5, 0.0), (2.5, 1.0, 0.1)])
def test_simpo_loss_is_the_papers(beta, gamma, eps):
    want = []
    for pc, pr in zip(PC, PR, strict=True):
        h = beta * (pc - pr) - gamma
        want.append(-(1 - eps) * log_sigmoid(h) - eps * log_sigmoid(-h))
    close(losses.simpo_loss(t(PC), t(PR), beta, gamma, eps), want)


@pytest.mark.parametrize("kl", [0.3, -0.2])
def test_kto_loss_is_the_papers(kl):
    logps, ref = t(PC + PR), t(RC + RR)
    desirable = torch.tensor([True, True, False, True, False, False, True, False])
    beta, wd, wu = 0.1, 1.0, 1.33
    z0 = max(0.0, kl)  # a negative estimate is clamped
    want = []
    for lp, rf, good in zip(logps.tolist(), ref.tolist(), desirable.tolist(), strict=True):
        r = lp - rf
        want.append(wd * (1 - sigmoid(beta * (r - z0))) if good else wu * (1 - sigmoid(beta * (z0 - r))))
    got = losses.kto_loss(logps.requires_grad_(), ref, desirable, torch.tensor(kl), beta, wd, wu)
    close(got.detach(), want)
    got.sum().backward()  # the KL term is a constant: the gradient is the paper's, through r only
    r = logps.detach() - ref
    s = torch.sigmoid(beta * (r - z0))
    s_u = torch.sigmoid(beta * (z0 - r))
    grad = torch.where(desirable, -wd * beta * s * (1 - s), wu * beta * s_u * (1 - s_u))
    torch.testing.assert_close(logps.grad, grad, atol=1e-9, rtol=1e-9)


def test_loss_terms_metrics_are_trls():
    """rewards = beta * (policy - reference), accuracy counts strict wins; chosen and rejected interleave."""
    alg = dpo.DPOAlgorithmConfig(beta=0.1)
    logps = t([x for pair in zip(PC, PR, strict=True) for x in pair])
    ref = t([x for pair in zip(RC, RR, strict=True) for x in pair])
    loss_sum, sums = dpo.loss_terms(logps, ref, [None] * 4, 0.0, alg)
    close(loss_sum[None], [float(losses.dpo_sigmoid_loss(t(PC), t(PR), t(RC), t(RR), 0.1).sum())])
    rc = [0.1 * (a - b) for a, b in zip(PC, RC, strict=True)]  # 0.1, 0.05, -0.025, -0.05
    rr = [0.1 * (a - b) for a, b in zip(PR, RR, strict=True)]  # -0.05, -0.025, -0.15, 0.1
    close(sums["rewards/chosen"][None], [sum(rc)])
    close(sums["rewards/margins"][None], [sum(rc) - sum(rr)])
    assert float(sums["rewards/accuracies"]) == 3.0  # pairs 0, 1, 2 win; pair 3 loses
    assert float(sums["logps/rejected"]) == sum(PR)


# ------------------------------------------------------------------------------------------------ data


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset(toy_dir: Path, path: Path, kto: bool = False, **over) -> dpo.PreferenceDataset:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_dir / "model")
    return dpo.PreferenceDataset(str(path), tok, dpo.DPODataConfig(**over), kto)


def test_layouts_give_the_same_tokens(toy_dir, tmp_path):
    """TRL's strings, TRL's conversational format and UltraFeedback's full conversations are one example."""
    q, good, bad = "What is 47 + 38?", "#### 85", "#### 84"
    user = [{"role": "user", "content": q}]
    rows = [
        {"prompt": q, "chosen": good, "rejected": bad},
        {"prompt": user, "chosen": [{"role": "assistant", "content": good}], "rejected": bad},
        {
            "prompt": q,
            "chosen": user + [{"role": "assistant", "content": good}],
            "rejected": user + [{"role": "assistant", "content": bad}],
        },
        {
            "chosen": user + [{"role": "assistant", "content": good}],
            "rejected": user + [{"role": "assistant", "content": bad}],
        },
    ]
    ds = dataset(toy_dir, write_jsonl(tmp_path / "p.jsonl", rows))
    first = ds.examples[0]
    for e in ds.examples[1:]:
        assert (e["prompt"], e["completions"]) == (first["prompt"], first["completions"])
    eos = ds.tok.eos_token_id
    assert all(c[-1] == eos for c in first["completions"])
    assert ds.tok.decode(first["prompt"]).endswith("<|im_start|>assistant\n")
    assert ds.tok.decode(first["completions"][1]) == "#### 84<|im_end|>"
    assert ds.seqs(0) == [
        (first["prompt"], first["completions"][0]),
        (first["prompt"], first["completions"][1]),
    ]


def test_kto_rows_and_their_kl_partner(toy_dir, tmp_path):
    rows = [
        {"prompt": f"What is {a} + 1?", "completion": f"#### {a + 1}", "label": a % 2 == 0} for a in range(4)
    ]
    ds = dataset(toy_dir, write_jsonl(tmp_path / "k.jsonl", rows), kto=True)
    assert [e["label"] for e in ds.examples] == [True, False, True, False]
    # row i's KL sequence: its own prompt with row (i + 2) % 4's completion
    assert ds.seqs(0)[1] == (ds.examples[0]["prompt"], ds.examples[2]["completions"][0])


@pytest.mark.parametrize(
    "row,key,words",
    [
        ({"prompt": "q", "chosen": "a"}, "rejected", "missing_key"),
        ({"prompt": "q", "chosen": "a", "rejected": 3}, "rejected", "want a string or a non-empty list"),
        (
            {"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant"}]},
            "rejected",
            "not {role, content}",
        ),
        (
            {
                "prompt": "other",
                "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
            },
            "prompt",
            "prompt_mismatch",
        ),
        (
            {
                "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "b"}],
            },
            "rejected",
            "prompt_mismatch",
        ),
    ],
)
def test_bad_row_names_file_row_and_key(toy_dir, tmp_path, row, key, words):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(ValueError) as e:
        dataset(toy_dir, path)
    assert f"{path} row 1 (line 2): key '{key}'" in str(e.value) and words in str(e.value)
    assert len(dataset(toy_dir, path, skip_bad_rows=True)) == 1


def test_kto_label_and_length_errors(toy_dir, tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [{"prompt": "q", "completion": "a", "label": "yes"}])
    with pytest.raises(ValueError, match=r"row 0 \(line 1\): key 'label': bad_label: want true or false"):
        dataset(toy_dir, path, kto=True)
    long = write_jsonl(
        tmp_path / "l.jsonl", [{"prompt": "What is 1 + 2?", "chosen": "#### 3", "rejected": "#### 4"}]
    )
    with pytest.raises(ValueError, match="too_long: .* > max_prompt_length 4, max_length 1024"):
        dataset(toy_dir, long, max_prompt_length=4)
    cut = dataset(toy_dir, long, max_prompt_length=4, max_length=6, truncation="keep_end")
    e = cut.examples[0]
    assert cut.truncated == 1 and len(e["prompt"]) == 4 and [len(c) for c in e["completions"]] == [2, 2]


def load_script(name: str):
    """A module from scripts/ (not a package), by path."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / f"{name}.py")
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_prepare_arith_pairs(toy_dir, tmp_path):
    """The word-arithmetic pairs: same prompt messages as the RL rows, the right sentence against a wrong number; and
    on-policy pairs from a val_generations file. Both load into PreferenceDataset."""
    import pyarrow.parquet as pq

    words, pairs = load_script("prepare_arith_words"), load_script("prepare_arith_pairs")
    words.main(words.Args(out=str(tmp_path / "w"), n_train=40, n_test=10))
    pairs.main(pairs.Args(src=str(tmp_path / "w"), out=str(tmp_path / "p")))
    rl = pq.read_table(tmp_path / "w/test.parquet").to_pylist()
    got = pq.read_table(tmp_path / "p/test.parquet").to_pylist()
    assert len(got) == 10 and [g["prompt"] for g in got] == [r["prompt"] for r in rl]
    for g, r in zip(got, rl, strict=True):
        truth, wrong = r["reward_model"]["ground_truth"], g["rejected"].rsplit("#### ", 1)[1]
        assert g["chosen"].endswith(f"is {truth}.\n#### {truth}") and wrong != truth and int(wrong) >= 0
        assert g["chosen"].split(" is ")[0] == g["rejected"].split(" is ")[0]  # written the same way
    assert len(dataset(toy_dir, tmp_path / "p/train.parquet")) == 40

    gens = [
        {"prompt": "<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n", "response": r, "score": s}
        for r, s in (("wrong\n#### 4", 0.0), ("right\n#### 3", 1.0), ("", 0.0))
    ]
    write_jsonl(tmp_path / "gen.jsonl", gens + [dict(gens[1], prompt="all right")])
    pairs.main(pairs.Args(out=str(tmp_path / "g"), generations=str(tmp_path / "gen.jsonl"), split="train"))
    rows = pq.read_table(tmp_path / "g/train.parquet").to_pylist()
    assert rows == [{"prompt": gens[0]["prompt"], "chosen": "right\n#### 3", "rejected": "wrong\n#### 4"}]
    ds = dataset(toy_dir, tmp_path / "g/train.parquet", apply_chat_template=False)
    assert ds.tok.decode(ds.examples[0]["completions"][0]) == "right\n#### 3<|im_end|>"
