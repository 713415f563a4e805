"""Tests for data.py: loading, masks, truncation, bad rows, sampler resume, batching, packed == padded logprobs.

The tokenizer (byte-level BPE trained here, Qwen-style chat template, eos <|im_end|>) and the model (a random
2-layer Qwen2) are built inside this file so the tests need no hub and no other flatrl module.
"""

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import data

torch.set_num_threads(1)

CHAT_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
EOS = "<|im_end|>"


def make_tok(chat_template=CHAT_TEMPLATE):
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["What is 12 + 34? The answer is 46.", "Hello world, you are a helpful assistant."] * 4
    bpe.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS, pad_token="<|endoftext|>", chat_template=chat_template
    )


@pytest.fixture(scope="module")
def tok():
    return make_tok()


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def masked_runs(ids, mask):
    """Consecutive runs of masked token ids."""
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


# ---------------------------------------------------------------- loading


def test_load_parquet_and_jsonl_concatenated(tmp_path, monkeypatch):
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "x.parquet")
    (tmp_path / "y.jsonl").write_text(
        '{"prompt": "e", "response": "f"}\n\n{"prompt": "g", "response": "h"}\n'
    )
    monkeypatch.setenv("HOME", str(tmp_path))
    rows = data.load_rows([str(tmp_path / "x.parquet"), "~/y.jsonl"])
    assert [r["prompt"] for r in rows] == ["a", "c", "e", "g"]
    assert rows[1].origin == f"{tmp_path / 'x.parquet'} row 1"
    assert rows[3].origin == f"{tmp_path / 'y.jsonl'} row 1 (line 3)"  # the blank line 2 is skipped


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("garbage.parquet", b"\x00\x01not parquet at all" * 10, "garbage.parquet: not a readable parquet"),
        ("empty.jsonl", b"", "empty.jsonl: no rows"),
        ("bad.jsonl", b'{"a": 1}\n{"a": \n', "bad.jsonl: bad JSON on line 2"),
        ("list.jsonl", b'{"a": 1}\n[1, 2]\n', r"list.jsonl row 1 \(line 2\): expected a JSON object"),
        ("rows.csv", b"a,b\n1,2\n", "rows.csv: unknown data file extension"),
    ],
)
def test_load_errors_name_the_file(tmp_path, name, content, match):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=match):
        data.load_rows(tmp_path / name)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="nope.parquet does not exist"):
        data.load_rows(str(tmp_path / "nope.parquet"))


# ---------------------------------------------------------------- SFT masks


def test_prompt_response_mask_with_and_without_template(tok, tmp_path):
    p, r = "What is 12 + 34?", "The answer is 46."
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "response": r}])
    ex = data.SFTDataset(str(path), tok)[0]
    head = f"<|im_start|>user\n{p}{EOS}\n<|im_start|>assistant\n"
    assert tok.decode(ex["input_ids"]) == head + r + EOS
    assert ex["input_ids"] == enc(tok, head) + enc(tok, r) + [tok.eos_token_id]
    assert masked_runs(ex["input_ids"], ex["loss_mask"]) == [enc(tok, r) + [tok.eos_token_id]]
    assert tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"], strict=True) if m]) == r + EOS

    raw = data.SFTDataset(str(path), tok, apply_chat_template=False)[0]
    assert tok.decode(raw["input_ids"]) == p + r + EOS
    assert raw["loss_mask"] == [0] * len(enc(tok, p)) + [1] * (len(enc(tok, r)) + 1)


def test_multiturn_masks_only_assistant_turns(tok, tmp_path):
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 + 34?"},
        {"role": "assistant", "content": "46"},
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hello world."},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    ex = data.SFTDataset(str(path), tok)[0]
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(ex["input_ids"]) == full.removesuffix("\n")  # context after the last eos is dropped
    runs = masked_runs(ex["input_ids"], ex["loss_mask"])
    assert [tok.decode(run) for run in runs] == ["46" + EOS, "Hello world." + EOS]
    n_context = len(ex["input_ids"]) - sum(ex["loss_mask"])
    assert n_context == len(enc(tok, full)) - 1 - len(enc(tok, "46")) - len(enc(tok, "Hello world.")) - 2


def test_template_that_rewrites_earlier_turns_is_an_error(tmp_path):
    # Like Qwen3's template dropping earlier reasoning: an assistant turn renders differently once it is
    # not the last message, so token boundaries found from prefixes would be wrong.
    rewriting = CHAT_TEMPLATE.replace("m['content']", "(m['content'] if loop.last else m['content'][:1])")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs + msgs}])
    with pytest.raises(
        ValueError, match="chat.jsonl row 0 \\(line 1\\): key 'messages': template_not_prefix"
    ):
        data.SFTDataset(str(path), make_tok(rewriting))
    with pytest.raises(ValueError, match="need apply_chat_template"):
        data.SFTDataset(str(path), make_tok(), apply_chat_template=False)


BAD_ROWS = [
    ({"prompt": "What is 12?"}, "response", "missing_key"),
    ({"prompt": "What is 12?", "response": ""}, "response", "empty_response"),
    ({"prompt": "", "response": "12"}, "prompt", "empty_prompt"),
    ({"prompt": " \n", "response": "12"}, "prompt", "empty_prompt"),
    ({"prompt": "What is 12?", "response": ["12"]}, "response", "not_a_string"),
    ({"prompt": "What is 12?", "response": 12}, "response", "not_a_string"),
    ({"prompt": None, "response": "12"}, "prompt", "missing_key"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", "bad_messages"),
]


@pytest.mark.parametrize("bad,key,reason", BAD_ROWS)
def test_bad_row_error_names_file_row_key(tok, tmp_path, bad, key, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "What is 1?", "response": "1"}, bad])
    with pytest.raises(ValueError, match=f"bad.jsonl row 1 \\(line 2\\): key '{key}': {reason}"):
        data.SFTDataset(str(path), tok)


def test_skip_bad_rows_counts_reasons(tok, tmp_path):
    good = {"prompt": "What is 1?", "response": "1"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good] + [b for b, _, _ in BAD_ROWS] + [good])
    ds = data.SFTDataset(str(path), tok, skip_bad_rows=True)
    assert len(ds) == 2
    expected = {
        "missing_key": 2,
        "empty_response": 1,
        "empty_prompt": 2,
        "not_a_string": 2,
        "no_assistant_turn": 1,
    }
    assert ds.skipped == expected | {"bad_messages": 1}


def test_truncation_left_right_error(tok, tmp_path):
    row = {"prompt": "Hello world, you are a helpful assistant. What is 12 + 34?", "response": "46"}
    path = write_jsonl(tmp_path / "long.jsonl", [row])
    full = data.SFTDataset(str(path), tok, max_length=10_000)[0]
    n, L = len(full["input_ids"]), 8
    assert n > L + 4
    right = data.SFTDataset(str(path), tok, max_length=n - 1, truncation="right")
    assert right[0]["input_ids"] == full["input_ids"][: n - 1] and right.truncated == 1
    assert right[0]["loss_mask"] == full["loss_mask"][: n - 1]  # the eos target was cut, "46" remains
    left = data.SFTDataset(str(path), tok, max_length=L, truncation="left")
    assert left[0]["input_ids"] == full["input_ids"][-L:] and left[0]["loss_mask"] == full["loss_mask"][-L:]
    with pytest.raises(
        ValueError, match=f"long.jsonl row 0 \\(line 1\\): key 'response': too_long: {n} tokens"
    ):
        data.SFTDataset(str(path), tok, max_length=L)
    with pytest.raises(ValueError, match="row 0.*truncated_away"):
        data.SFTDataset(str(path), tok, max_length=L, truncation="right")  # only prompt tokens left
    short = write_jsonl(tmp_path / "short.jsonl", [{"prompt": "1", "response": "2"}])
    n_short = len(data.SFTDataset(str(short), tok)[0]["input_ids"])
    assert n_short < len(enc(tok, f"<|im_start|>user\n{row['prompt']}{EOS}\n<|im_start|>assistant\n"))
    both = write_jsonl(tmp_path / "two.jsonl", [row, {"prompt": "1", "response": "2"}])
    ds = data.SFTDataset(str(both), tok, max_length=n_short, truncation="right", skip_bad_rows=True)
    assert len(ds) == 1 and ds.skipped == {"truncated_away": 1}


def test_verl_nested_prompt_and_response_keys(tok, tmp_path):
    """verl's GSM8K SFT layout: prompt_key=response_key=extra_info, prompt/response_dict_keys pick the fields."""
    info = {"question": "What is 12 + 34?", "answer": "46", "index": 7}
    rows = [
        {"question": "ignored", "extra_info": info},
        {"extra_info": {"question": "What is 1?", "answer": "1"}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sft.parquet")  # a struct column, as verl writes it
    nested = data.SFTDataset(
        str(tmp_path / "sft.parquet"), tok, prompt_key="extra_info", response_key="extra_info",
        prompt_dict_keys=["question"], response_dict_keys=["answer"],
    )  # fmt: skip
    flat_path = write_jsonl(tmp_path / "flat.jsonl", [{"prompt": "What is 12 + 34?", "response": "46"}])
    assert nested[0]["input_ids"] == data.SFTDataset(str(flat_path), tok)[0]["input_ids"]
    assert len(nested) == 2
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"extra_info": {"question": "What is 1?"}}])
    with pytest.raises(ValueError, match=r"bad.jsonl row 0 \(line 1\): key 'extra_info.answer': missing_key: "
                       r"extra_info has \['question'\]"):  # fmt: skip
        data.SFTDataset(
            str(bad), tok, prompt_key="extra_info", response_key="extra_info",
            prompt_dict_keys=["question"], response_dict_keys=["answer"],
        )  # fmt: skip


# ---------------------------------------------------------------- RL prompts


def test_rl_dataset_verl_schema(tok, tmp_path):
    rm = {"style": "rule", "ground_truth": "46"}
    chat = [{"role": "user", "content": "What is 12 + 34?"}]
    rows = [
        {"data_source": "toy", "prompt": chat, "reward_model": rm, "extra_info": {"index": 0}},
        {
            "data_source": "toy",
            "prompt": [{"role": "user", "content": "Hello world! " * 20}],
            "reward_model": rm,
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rl.parquet")
    ds = data.RLDataset(str(tmp_path / "rl.parquet"), tok, max_prompt_length=40)
    assert len(ds) == 1 and ds.dropped_overlong == 1
    ex = ds[0]
    assert ex["raw_prompt"] == f"<|im_start|>user\nWhat is 12 + 34?{EOS}\n<|im_start|>assistant\n"
    assert ex["prompt_ids"] == enc(tok, ex["raw_prompt"])
    assert (ex["data_source"], ex["ground_truth"], ex["extra_info"]) == ("toy", "46", {"index": 0})
    with pytest.raises(
        ValueError, match=r"rl.parquet row 1: key 'prompt': too_long: \d+ tokens > max_prompt_length 40"
    ):
        data.RLDataset(str(tmp_path / "rl.parquet"), tok, max_prompt_length=40, filter_overlong_prompts=False)

    # verl's data.truncation with the filter off: the long row's ids cut to 40 from the end, the start, or both
    whole = enc(
        tok, data.RLDataset(str(tmp_path / "rl.parquet"), tok, max_prompt_length=999)[1]["raw_prompt"]
    )
    assert len(whole) > 40
    kept = {"left": whole[-40:], "right": whole[:40], "middle": whole[:20] + whole[-20:]}
    for mode, want in kept.items():
        cut = data.RLDataset(
            str(tmp_path / "rl.parquet"),
            tok,
            max_prompt_length=40,
            filter_overlong_prompts=False,
            truncation=mode,
        )
        assert cut.truncated == 1 and cut[1]["prompt_ids"] == want, mode
        assert cut[0]["prompt_ids"] == ex["prompt_ids"]  # a prompt that fits is not touched
        assert cut[1]["raw_prompt"].count("Hello world!") == 20  # the reward function still sees it whole

    q = write_jsonl(
        tmp_path / "q.jsonl", [{"data_source": "gsm8k", "question": "What is 1?", "reward_model": rm}]
    )
    plain = data.RLDataset(str(q), tok, prompt_key="question", apply_chat_template=False)[0]
    with pytest.raises(ValueError, match="rl.parquet row 0: key 'prompt': bad_prompt: want a string"):
        data.RLDataset(str(tmp_path / "rl.parquet"), tok, apply_chat_template=False)
    assert plain["raw_prompt"] == "What is 1?" and plain["prompt_ids"] == enc(tok, "What is 1?")
    bad = write_jsonl(
        tmp_path / "nogt.jsonl", [rows[0] | {"prompt": "x"}, {"data_source": "t", "prompt": "x"}]
    )
    with pytest.raises(
        ValueError, match="nogt.jsonl row 1 \\(line 2\\): key 'reward_model.ground_truth': missing_key"
    ):
        data.RLDataset(str(bad), tok)


RM = {"style": "rule", "ground_truth": "46"}

GOOD_RL = {"data_source": "toy", "prompt": [{"role": "user", "content": "What is 1?"}], "reward_model": RM}
BAD_RL_ROWS = [
    ({"data_source": "toy", "reward_model": RM}, "prompt", "missing_key"),
    (GOOD_RL | {"prompt": ""}, "prompt", "empty_prompt"),
    (GOOD_RL | {"prompt": [{"role": "user", "content": " "}]}, "prompt", "empty_prompt"),
    (GOOD_RL | {"prompt": 5}, "prompt", "bad_prompt"),
    (GOOD_RL | {"prompt": []}, "prompt", "bad_prompt"),
    (GOOD_RL | {"prompt": [{"role": "user"}]}, "prompt", "bad_prompt"),
    ({"prompt": "What is 1?", "reward_model": RM}, "data_source", "missing_key"),
    ({"data_source": "toy", "prompt": "What is 1?"}, "reward_model.ground_truth", "missing_key"),
    (GOOD_RL | {"prompt": "Hello world! " * 20}, "prompt", "too_long"),
]


@pytest.mark.parametrize("bad,key,reason", BAD_RL_ROWS)
def test_rl_bad_row_error_names_file_row_key(tok, tmp_path, bad, key, reason):
    path = write_jsonl(tmp_path / "rl.jsonl", [GOOD_RL, bad])
    with pytest.raises(data.BadRow, match=f"rl.jsonl row 1 \\(line 2\\): key '{key}': {reason}"):
        data.RLDataset(str(path), tok, max_prompt_length=40, filter_overlong_prompts=False)


def test_rl_skip_bad_rows_counts_reasons(tok, tmp_path):
    path = write_jsonl(tmp_path / "rl.jsonl", [GOOD_RL] + [b for b, _, _ in BAD_RL_ROWS] + [GOOD_RL])
    ds = data.RLDataset(
        str(path), tok, max_prompt_length=40, filter_overlong_prompts=False, skip_bad_rows=True
    )
    assert len(ds) == 2 and [e["origin"].split()[-1] for e in ds] == ["1)", "11)"]  # lines 1 and 11
    assert ds.skipped == {"missing_key": 3, "empty_prompt": 2, "bad_prompt": 3, "too_long": 1}
    filtered = data.RLDataset(str(path), tok, max_prompt_length=40, skip_bad_rows=True)
    assert len(filtered) == 2 and filtered.dropped_overlong == 1 and sum(filtered.skipped.values()) == 8


def test_rl_rows_without_reward_fields_need_a_custom_reward(tok, tmp_path):
    """With custom_reward_function.path set, rows may lack data_source and reward_model: None is passed on."""
    rows = [
        {"prompt": "What is 1?", "extra_info": {"answer": "1"}},
        {"data_source": "toy", "prompt": "What is 2?", "reward_model": {"style": "rule"}},
        {"data_source": "toy", "prompt": "What is 3?", "reward_model": RM},
    ]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    with pytest.raises(ValueError, match="custom.jsonl row 0 \\(line 1\\): key 'reward_model.ground_truth'"):
        data.RLDataset(str(path), tok)
    ds = data.RLDataset(str(path), tok, custom_reward=True)
    got = [(e["data_source"], e["ground_truth"], e["extra_info"]) for e in ds]
    assert got == [(None, None, {"answer": "1"}), ("toy", None, {}), ("toy", "46", {})]


@pytest.mark.parametrize("kind", ["sft", "rl"])
def test_not_parquet_empty_file_and_no_usable_rows(tok, tmp_path, kind):
    make = (
        (lambda p, **kw: data.SFTDataset(str(p), tok, **kw))
        if kind == "sft"
        else (lambda p, **kw: data.RLDataset(str(p), tok, **kw))
    )
    (tmp_path / "text.parquet").write_text("prompt,response\n1,2\n")  # a CSV named .parquet
    with pytest.raises(ValueError, match="text.parquet: not a readable parquet file"):
        make(tmp_path / "text.parquet")
    columns = {"prompt": pa.array([], pa.string()), "response": pa.array([], pa.string())}
    pq.write_table(pa.table(columns), tmp_path / "empty.parquet")  # a schema and no rows
    with pytest.raises(ValueError, match="empty.parquet: no rows"):
        make(tmp_path / "empty.parquet")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "", "response": ""}] * 3)
    with pytest.raises(ValueError, match="bad.jsonl: no (usable rows|prompts left).*'empty_prompt': 3"):
        make(bad, skip_bad_rows=True)


# ---------------------------------------------------------------- sampler and batching


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """data.apply_chat_template_kwargs (verl's; Qwen3's enable_thinking) reach the template in RL prompts and in
    SFT conversations, whose target mask still covers the assistant turn only."""
    thinking = "{%- if enable_thinking is false %}{{ '<nothink>' }}{%- endif %}" + CHAT_TEMPLATE
    t = make_tok(thinking)
    rows = [
        {
            "data_source": "toy",
            "prompt": [{"role": "user", "content": "Hi"}],
            "reward_model": {"ground_truth": "1"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rl.parquet")
    off = data.RLDataset(str(tmp_path / "rl.parquet"), t, chat_template_kwargs={"enable_thinking": False})[0]
    on = data.RLDataset(str(tmp_path / "rl.parquet"), t)[0]
    assert off["raw_prompt"] == "<nothink>" + on["raw_prompt"]
    assert off["prompt_ids"] == enc(t, off["raw_prompt"])
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Hi", "response": "Hello"}])
    sft_off = data.SFTDataset(str(path), t, chat_template_kwargs={"enable_thinking": False})[0]
    sft_on = data.SFTDataset(str(path), t)[0]
    n_think = len(enc(t, "<nothink>"))
    assert len(sft_off["input_ids"]) == len(sft_on["input_ids"]) + n_think
    assert sum(sft_off["loss_mask"]) == sum(sft_on["loss_mask"]) > 0
    # a key the template never reads changes nothing: the scripts print one note naming it (none for a read one)
    notes = data.unread_template_kwargs(t, {"enable_thinking": False, "reasoning_effort": "low"})
    assert len(notes) == 1 and "apply_chat_template_kwargs.reasoning_effort is ignored" in notes[0]
    assert data.unread_template_kwargs(make_tok(CHAT_TEMPLATE), {"enable_thinking": False})[0].endswith(
        "never reads enable_thinking"
    )


def test_sampler_epochs_resume_and_rng_independence():
    s = data.EpochSampler(n=10, batch_size=3, seed=7)
    assert s.steps_per_epoch == 3 and data.EpochSampler(10, 3, 7, drop_last=False).steps_per_epoch == 4
    straight = [b for _ in range(3) for b in s]  # three epochs
    assert len(straight) == 9 and s.state_dict() == {"epoch": 3, "batch": 0}
    for e in range(3):
        flat = sum(straight[3 * e : 3 * e + 3], [])
        assert len(set(flat)) == 9 and set(flat) <= set(range(10))  # a permutation minus the dropped one
    assert straight[:3] != straight[3:6]  # reshuffled each epoch

    for k in (1, 3, 4, 8):
        first, got = data.EpochSampler(10, 3, 7), []
        while len(got) < k:  # the trainer's loop: stop mid-epoch (or at an epoch end), save the state
            for b in first:
                got.append(b)
                if len(got) == k:
                    break
        resumed = data.EpochSampler(10, 3, 7)
        torch.manual_seed(123)  # the global RNG must not matter
        resumed.load_state_dict(first.state_dict())
        while len(got) < 9:
            got += list(resumed)
        assert got == straight, k


def test_sampler_without_shuffle_keeps_the_row_order_and_resumes():
    """data.shuffle=False (verl's LoRA examples): rows 0..n-1 in order every epoch, the seed unused."""
    s = data.EpochSampler(n=10, batch_size=3, seed=7, shuffle=False)
    two = [b for _ in range(2) for b in s]
    assert two == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] * 2
    assert data.EpochSampler(10, 3, 99, shuffle=False).epoch_batches(5) == two[:3]
    assert data.EpochSampler(10, 3, 7).epoch_batches(0) != two[:3]  # the default still shuffles
    resumed = data.EpochSampler(10, 3, 7, shuffle=False)
    resumed.load_state_dict({"epoch": 1, "batch": 2})
    assert next(iter(resumed)) == [6, 7, 8] and resumed.state_dict() == {"epoch": 2, "batch": 0}


def test_split_for_rank_is_a_partition_and_balanced():
    batch = data.EpochSampler(64, 16, seed=0).epoch_batches(0)[0]
    for ws in (1, 2, 4, 8):
        shares = [data.split_for_rank(batch, r, ws) for r in range(ws)]
        assert sum(shares, []) == batch  # contiguous without lengths
    lengths = [10, 9, 8, 1, 1, 1, 1, 1]
    idx = [50, 51, 52, 53, 54, 55, 56, 57]
    # longest-first into the lighter rank with room: 10->r0, 9->r1, 8->r1, 1,1,1->r0 (full at 4), 1,1->r1
    assert data.split_for_rank(idx, 0, 2, lengths) == [50, 53, 54, 55]
    assert data.split_for_rank(idx, 1, 2, lengths) == [51, 52, 56, 57]
    with pytest.raises(ValueError, match="3 ranks"):
        data.split_for_rank([1, 2], 0, 3)


def test_micro_batches_fixed_and_token_budget():
    assert data.micro_batches([5] * 5, micro_batch_size=2) == [[0, 1], [2, 3], [4]]
    assert data.micro_batches([5] * 5, micro_batch_size=2, min_num=4) == [[0], [1], [2], [3, 4]]
    assert data.micro_batches([5] * 2, micro_batch_size=2, min_num=3) == [[0], [1], []]
    # total 16, budget 8 -> 2 bins: 5->b0, 4->b1, 3->b1 (7), 3->b0 (8), 1->b1 (8)
    assert data.micro_batches([5, 4, 3, 3, 1], max_token_len=8) == [[0, 3], [1, 2, 4]]
    assert data.micro_batches([20, 4, 3], max_token_len=8) == [[0], [1, 2]]  # oversize sits alone
    assert data.micro_batches([20, 4, 3], max_token_len=8, min_num=5) == [[0], [1], [2], [], []]
    # balancing fails at 2 bins (6+3+2 > 10), first-fit decreasing finds 6+4 | 5+3+2
    assert data.micro_batches([6, 5, 4, 3, 2], max_token_len=10) == [[0, 2], [1, 3, 4]]
    rng = random.Random(0)
    for trial in range(30):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
        budget, min_num = rng.choice([64, 256, 1000]), rng.randint(1, 8)
        mbs = data.micro_batches(lengths, max_token_len=budget, min_num=min_num)
        assert sorted(sum(mbs, [])) == list(range(len(lengths))), trial
        assert len(mbs) >= min_num
        assert all(len(b) == 1 or sum(lengths[i] for i in b) <= budget for b in mbs)
        assert all(b for b in mbs) or len(lengths) < min_num  # empty ones only as padding past n
        assert mbs == data.micro_batches(list(lengths), max_token_len=budget, min_num=min_num)


# ---------------------------------------------------------------- collation


def test_pack_and_shift_layout_by_hand():
    b = data.pack_batch([[5, 6], [7, 8, 9]], [[0, 1], [0, 1, 1]])
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9]] and b["position_ids"].tolist() == [[0, 1, 0, 1, 2]]
    assert b["cu_seqlens"].tolist() == [0, 2, 5] and b["cu_seqlens"].dtype == torch.int32
    m = b["attention_mask"][0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    labels, lmask = data.shift_labels(b)
    assert labels.tolist() == [[6, 7, 8, 9, 0]] and lmask.tolist() == [[1, 0, 1, 1, 0]]  # no 6 -> 7 target
    p = data.pad_batch([[5, 6], [7, 8, 9]], [[0, 1], [0, 1, 1]], pad_id=0)
    assert p["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    labels, lmask = data.shift_labels(p)
    assert labels.tolist() == [[6, 0, 0], [8, 9, 0]] and lmask.tolist() == [[1, 0, 0], [1, 1, 0]]
    f = data.pack_batch([[5, 6]], [[0, 1]], mask_dtype=torch.float32)["attention_mask"][0, 0]
    assert f[0, 0] == 0 and f[0, 1] == torch.finfo(torch.float32).min


def _token_logprobs(model, batch, **kwargs):
    """Per-token logprobs of each sequence's targets, as a list of 1-D tensors, and the summed NLL."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")} | kwargs
    logits = model(**inputs, use_cache=False).logits.float()  # [B, T, V]
    labels, label_mask = data.shift_labels(batch)
    logprobs = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)  # [B, T]
    per_seq = data.split_sequences(logprobs, batch)
    per_seq = [lp[m.bool()] for lp, m in zip(per_seq, data.split_sequences(label_mask, batch), strict=True)]
    return per_seq, -(logprobs.double() * label_mask).sum().item()


@pytest.mark.parametrize("attn,mask_dtype", [("sdpa", torch.bool), ("eager", torch.float32)])
def test_packed_logprobs_match_padded(tok, tmp_path, attn, mask_dtype):
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    cfg._attn_implementation = attn
    model = Qwen2ForCausalLM(cfg).eval()
    rows = [{"prompt": "What is 12 + 34?" * k, "response": "The answer is 46." * k} for k in (1, 2, 3)]
    rows.append({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})
    ds = data.SFTDataset(str(write_jsonl(tmp_path / "mix.jsonl", rows)), tok)
    seqs, masks = [e["input_ids"] for e in ds], [e["loss_mask"] for e in ds]
    assert len(set(map(len, seqs))) == 4  # different lengths, so padding and packing differ

    with torch.no_grad():
        padded = data.pad_batch(seqs, masks, pad_id=ds.pad_id)
        lp_pad, nll_pad = _token_logprobs(model, padded)
        packed = data.pack_batch(seqs, masks, mask_dtype=mask_dtype)
        lp_pack, nll_pack = _token_logprobs(model, packed)
        # transformers' own packed-sequence detection from position ids (needs use_cache=False, no mask)
        lp_pos, nll_pos = _token_logprobs(model, packed, attention_mask=None)
    assert ds.pad_id == tok.pad_token_id and [len(x) for x in lp_pad] == [sum(m[1:]) for m in masks]
    diff = max((a - b).abs().max().item() for a, b in zip(lp_pad, lp_pack, strict=True))
    assert diff < 1e-4, diff
    assert nll_pad > 1.0 and abs(nll_pad - nll_pack) < 1e-4, (nll_pad, nll_pack)
    diff_pos = max((a - b).abs().max().item() for a, b in zip(lp_pad, lp_pos, strict=True))
    assert diff_pos < 1e-4 and abs(nll_pad - nll_pos) < 1e-4, (diff_pos, nll_pos)


def test_a_lone_surrogate_names_its_file_row_and_key_and_can_be_skipped(tok, tmp_path):
    """JSON allows "\\ud800", which is no Unicode text: the tokenizer used to fail with a TypeError naming nothing.
    Now one error names the file, the row and the key; skip_bad_rows skips it (reason bad_text), SFT and RL."""
    good = {"prompt": "What is 1?", "response": "1"}
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(good) + "\n" + '{"prompt": "What is \\ud800?", "response": "1"}\n')
    with pytest.raises(
        data.BadRow, match=r"s.jsonl row 1 \(line 2\): key 'prompt': bad_text: a lone surrogate \\ud800"
    ):
        data.SFTDataset(str(path), tok)
    ds = data.SFTDataset(str(path), tok, skip_bad_rows=True)
    assert len(ds) == 1 and ds.skipped == {"bad_text": 1}
    rl = dict(GOOD_RL, prompt=[{"role": "user", "content": "What is \ud800?"}])
    rl_path = tmp_path / "r.jsonl"
    rl_path.write_text(json.dumps(GOOD_RL) + "\n" + json.dumps(rl) + "\n")  # json.dumps writes "\ud800"
    with pytest.raises(data.BadRow, match=r"r.jsonl row 1 \(line 2\): key 'prompt\[0\].content': bad_text"):
        data.RLDataset(str(rl_path), tok)
    assert data.RLDataset(str(rl_path), tok, skip_bad_rows=True).skipped == {"bad_text": 1}
