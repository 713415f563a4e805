"""The offline tiny model and task: flatrl's deterministic default for tests and `make demo`.

No model hub is reachable on the machines flatrl is tested on, so this script makes everything an
end-to-end run needs from a seed, byte-identical for the same seed:

    python toy.py --out runs/toy [--seed 0] [--n-train 8000] [--n-val 200] [--direct-frac 0.6]

writes

    DIR/model/            a tiny Qwen2ForCausalLM (random init, head_dim 64, tied embeddings), a byte-level
                          BPE tokenizer trained here (digits always single tokens), a Qwen-style chat
                          template and generation_config.json; loads with AutoTokenizer/AutoModelForCausalLM
                          exactly as Qwen/Qwen2.5-0.5B does.
    DIR/sft/{train,val}.parquet   string columns `prompt`, `response` (a worked solution ending in `#### N`, or
                                  for a `direct_frac` share of the rows the bare answer line `#### N`).
    DIR/rl/{train,val}.parquet    verl's RL schema: data_source "flatrl/toy", prompt (chat messages), ability,
                                  reward_model {style: "rule", ground_truth}, extra_info {split, index}.
    DIR/dpo/{train,val}.parquet   preference pairs for dpo.py (TRL's layout): string columns `prompt`, `chosen`
                                  (the worked solution) and `rejected` (the same text with a wrong `#### N`:
                                  `make_pair`), on the SFT problems.

The task is two-digit column addition and subtraction (12,195 problems, 200 held out for val), e.g.

    What is 47 + 38?        What is 52 - 17?
    7+8=15, carry 1         12-7=5, borrow 1
    4+3+1=8                 5-1-1=3
    #### 85                 #### 35

The `#### N` line is GSM8K's answer format, so reward.py's gsm8k strict scorer grades it. Digits are single
tokens (Qwen2's split regex) and the per-column worked step is what makes the task learnable at this size: a
4-layer, 256-wide model with multi-digit BPE tokens and no worked step stayed at 1% on two-digit addition after
3,000 SFT steps. Every response fits in 26 tokens with `<|im_end|>`, every chat-templated prompt in 18.

Why RL has something to do (`direct_frac`, default 0.6): 60% of the SFT responses are the bare answer line
`#### N`, the rest the worked solution, as SFT data mixing short answers and worked solutions often does. The
SFT model then answers most prompts directly, and a 2-layer model cannot add in one step: measured on 2 CPU cores
(sft.py, 1,000 steps of 32, lr 1e-3 cosine, 2m40s), greedy decoding picks the bare answer on 96% of the 200 val
prompts and gets 8% right, while at temperature 1 the worked solutions it samples 41% of the time are right 44%
of the time (bare answers: 7%). GRPO's reward tells the two styles apart on every prompt, so it learns to work
the problem out: 30 steps of 32 prompts x 8 took greedy val accuracy from 0.08 to 0.82 (3 minutes), and the
mean response length from 6 to 20 tokens. With `direct_frac=0` SFT alone reaches 58% after 500 steps and 95%
after 1,200, and GRPO (tested at lr 1e-5..3e-4, 20-100 steps) did not improve on it: per-step gradients of a
0.5M-parameter model were too noisy (cosine 0.03-0.3 between batches of 1,024 samples).

Deviations from a real Qwen2.5 checkpoint:
1. The chat template has no default system message (Qwen2.5 inserts "You are Qwen, ..."): it would be most
   of every sequence here.
2. No tool-call or multimodal special tokens; the vocabulary is 256 bytes + a few merges + 3 specials.
3. Weights are saved in float32 (Qwen ships bfloat16): a few MB, and CPU tests run in float32 anyway.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import tyro
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

DATA_SOURCE = "flatrl/toy"
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2's pre-tokenizer split pattern, verbatim from transformers/models/qwen2/tokenization_qwen2.py.
QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Qwen2.5's template minus the default system prompt and tool calls (deviation 1 in the docstring).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ToyConfig:
    """Where to write the toy model and data, and how much data."""

    out: str
    """Output folder; gets model/, sft/, rl/ and dpo/ subfolders."""
    seed: int = 0
    """Seeds the weight init and the problem draw; the same seed gives byte-identical files."""
    n_train: int = 8000
    """Problems in each of sft/train.parquet and rl/train.parquet."""
    n_val: int = 200
    """Problems in sft/val.parquet and rl/val.parquet (the same problems, disjoint from every train problem)."""
    direct_frac: float = 0.6
    """Share of SFT responses that are the bare answer `#### N`, without the worked columns (see above)."""
    digits: int = 2
    """Digits of each operand: 2 is the toy (12,195 problems); 3 is the H200 reproduction's task (1.2M)."""
    hidden_size: int = 128
    """Model width (heads of 64, MLP 4x); 128 with 2 layers is the 0.5M-parameter toy."""
    num_layers: int = 2
    """Model depth; 8 layers of 512 is the 30M-parameter model of scripts/repro.sh."""


Problem = tuple[int, str, int]  # (a, op, b) with op "+" or "-"


def all_problems(digits: int = 2) -> list[Problem]:
    """Every problem of the task in a fixed order: a + b and a - b for `digits`-digit a, b, with a >= b for "-".

    2 digits: 12,195 problems (8,100 sums, 4,095 differences), so 200 val problems leave plenty to train on
    without memorising (a 720-problem multiplication table plateaued at 73% by memorising its train split).
    3 digits: 1,215,450 problems.
    """
    lo, hi = 10 ** (digits - 1), 10**digits
    return [(a, op, b) for a in range(lo, hi) for b in range(lo, hi) for op in "+-" if op == "+" or a >= b]


def answer_of(problem: Problem) -> int:
    """The exact answer of `problem`."""
    a, op, b = problem
    return a + b if op == "+" else a - b


def solve(problem: Problem) -> tuple[str, str]:
    r"""Worked column solution of `problem` (one line per column, ones first) and its answer.

    (47, "+", 38) -> "7+8=15, carry 1\n4+3+1=8\n#### 85"; (52, "-", 17) -> "12-7=5, borrow 1\n5-1-1=3\n#### 35";
    (512, "-", 498) -> "12-8=4, borrow 1\n11-9-1=1, borrow 1\n5-4-1=0\n#### 14". The top column writes its
    whole result (a final carry included), so no line mentions a carry or borrow that goes nowhere.

    Returns:
        (solution, answer): the solution's last line is `#### <answer>`.
    """
    a, op, b = problem
    digits = len(str(a))
    lines, carry = [], 0  # carry: 1 carried (+) or borrowed (-) into this column from the one below
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        top = i == digits - 1
        if op == "+":
            value = x + y + carry
            out = 0 if top else int(value >= 10)
            line = f"{x}+{y}" + ("+1" if carry else "") + f"={value}"
            lines.append(line + (", carry 1" if out else ""))
        else:
            out = 0 if top else int(x - carry < y)
            line = f"{x + 10 * out}-{y}" + ("-1" if carry else "") + f"={x + 10 * out - y - carry}"
            lines.append(line + (", borrow 1" if out else ""))
        carry = out
    answer = str(answer_of(problem))
    return "\n".join(lines) + f"\n#### {answer}", answer


def make_pair(problem: Problem, rng: random.Random) -> tuple[str, str]:
    """(chosen, rejected) responses to `problem` for preference training, worked the same way: the right worked
    solution, and the same text with one digit of its `#### N` line off by one (85 -> 84, 86, 75 or 95; never a
    leading 0). The columns are right in both, so the pair teaches reading the answer off the work, which is what
    the toy SFT model gets wrong most (e.g. "3+8=11 ... #### 115" for 38 + 6, measured: tests/test_dpo_e2e.py)."""
    chosen, answer = solve(problem)
    column = rng.randrange(len(answer))
    for delta in rng.sample((-1, 1), 2):
        digit = (int(answer[column]) + delta) % 10
        if column == 0 and digit == 0 and len(answer) > 1:
            continue
        wrong = answer[:column] + str(digit) + answer[column + 1 :]
        return chosen, chosen.removesuffix(answer) + wrong
    raise AssertionError("unreachable: a leading digit moves to 0 in one direction only")


def format_prompt(problem: Problem) -> str:
    """The user message for `problem`; the SFT prompt and the RL chat message are both exactly this text."""
    a, op, b = problem
    return f"What is {a} {op} {b}?"


def parse_prompt(prompt: str) -> Problem:
    """Inverse of format_prompt, so tests can recompute the ground truth from the prompt text alone."""
    a, op, b = prompt.removeprefix("What is ").removesuffix("?").split(" ")
    return int(a), op, int(b)


def make_problem(rng: random.Random, digits: int = 2) -> tuple[str, str, str]:
    """Draw one problem uniformly from the task.

    Returns:
        (prompt, solution, answer): the user message, the worked solution ending in `#### answer`, the answer.
    """
    problem = rng.choice(all_problems(digits))
    return (format_prompt(problem), *solve(problem))


def split_problems(
    seed: int, n_train: int, n_val: int, digits: int = 2
) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """Shuffle all problems with `seed`; the first n_val are val, the rest the train pool.

    Returns:
        (sft_train, rl_train, val): lists of problems. The two train lists are independent draws (with
        replacement once n_train exceeds the pool) from the pool, so both are disjoint from val.
    """
    rng = random.Random(seed)
    problems = all_problems(digits)
    rng.shuffle(problems)
    val, pool = problems[:n_val], problems[n_val:]
    assert pool, f"n_val={n_val} leaves no train problems out of {len(problems)}"

    def draw() -> list[Problem]:
        out: list[Problem] = []
        while len(out) < n_train:
            out += rng.sample(pool, min(len(pool), n_train - len(out)))
        return out

    return draw(), draw(), val


def build_tokenizer(texts: list[str], vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts`, every digit its own token (Qwen2's split regex).

    Args:
        texts: training corpus: prompts, solutions and role names, without special tokens.
        vocab_size: upper bound on the vocabulary incl. the 256 byte tokens and the 3 special tokens (the
            toy corpus runs out of merges first: 288 tokens).
    Returns:
        A PreTrainedTokenizerFast with pad `<|endoftext|>`, eos `<|im_end|>`, no bos, and the chat template.
        Saved and reloaded with AutoTokenizer it comes back as Qwen2Tokenizer, encoding identically.
    """
    tok = Tokenizer(models.BPE())
    # Exactly Qwen2's pipeline (NFC, its split regex, byte-level), because transformers 5 loads any
    # model_type "qwen2" folder as Qwen2Tokenizer, which rebuilds this pipeline around our vocab and merges
    # whatever tokenizer.json says (transformers/models/qwen2/tokenization_qwen2.py). The regex's `\p{N}`
    # alternative isolates every digit, so no merge can make a multi-digit token.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast, seed: int, hidden_size: int = 128, num_layers: int = 2
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2ForCausalLM sized for `tokenizer`, weights fixed by `seed`.

    head_dim is hidden_size / 2 heads = 64: vLLM's CPU attention rejects head_dim 16 but takes 64.
    """
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    return model


def _write(rows: list[dict], schema: pa.Schema, path: Path) -> None:
    """Write rows as one parquet file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


SFT_SCHEMA = pa.schema([("prompt", pa.string()), ("response", pa.string())])
PAIR_SCHEMA = pa.schema([("prompt", pa.string()), ("chosen", pa.string()), ("rejected", pa.string())])
RL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
    ]
)


def build(
    out: str | Path,
    seed: int = ToyConfig.seed,
    n_train: int = ToyConfig.n_train,
    n_val: int = ToyConfig.n_val,
    direct_frac: float = ToyConfig.direct_frac,
    digits: int = ToyConfig.digits,
    hidden_size: int = ToyConfig.hidden_size,
    num_layers: int = ToyConfig.num_layers,
) -> Path:
    """Write DIR/model, DIR/{sft,rl,dpo}/{train,val}.parquet (see module docstring).

    direct_frac: share of SFT rows (train and val) whose response is the bare answer line `#### N`.

    Returns:
        The output folder as a Path.
    """
    out = Path(out)
    sft_train, rl_train, val = split_problems(seed, n_train, n_val, digits)
    splits = {"sft/train": sft_train, "sft/val": val, "rl/train": rl_train, "rl/val": val}

    # The whole task (or, past 20,000 problems, a fixed sample of it), so the vocabulary does not depend on the
    # split; special tokens stay out of the corpus or BPE would learn merges like "<|" from their spelling.
    problems = all_problems(digits)
    if len(problems) > 20_000:
        problems = random.Random(f"{seed}-vocab").sample(problems, 20_000)
    corpus = ["system\nuser\nassistant\n"]
    corpus += [text for p in problems for text in (format_prompt(p), solve(p)[0])]
    tokenizer = build_tokenizer(corpus)
    model = build_model(tokenizer, seed, hidden_size, num_layers)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")

    style = random.Random(f"{seed}-style")  # its own stream: the problem draw does not depend on direct_frac
    for name, problems in splits.items():
        split = name.split("/")[1]
        rows = []
        for index, problem in enumerate(problems):
            prompt, (solution, answer) = format_prompt(problem), solve(problem)
            if name.startswith("sft"):
                direct = style.random() < direct_frac
                rows.append({"prompt": prompt, "response": f"#### {answer}" if direct else solution})
            else:
                rows.append(
                    {
                        "data_source": DATA_SOURCE,
                        "prompt": [{"role": "user", "content": prompt}],
                        "ability": "math",
                        "reward_model": {"style": "rule", "ground_truth": answer},
                        "extra_info": {"split": split, "index": index},
                    }
                )
        _write(rows, SFT_SCHEMA if name.startswith("sft") else RL_SCHEMA, out / f"{name}.parquet")
    slips = random.Random(f"{seed}-slip")  # its own stream too: the other files do not depend on the pairs
    for split, problems in (("train", sft_train), ("val", val)):
        pairs = [(format_prompt(p), *make_pair(p, slips)) for p in problems]
        rows = [dict(zip(PAIR_SCHEMA.names, pair, strict=True)) for pair in pairs]
        _write(rows, PAIR_SCHEMA, out / f"dpo/{split}.parquet")
    return out


def generate(
    model_dir: str | Path, prompts: list[str], n: int = 1, temperature: float = 0.0, seed: int = 0
) -> list[list[str]]:
    """`n` responses to each prompt (one user turn through the chat template) from the model in `model_dir`,
    greedy at temperature 0, else sampled (seeded), at most 32 new tokens (every right answer fits in 26)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sampling = dict(temperature=temperature, top_k=0, top_p=1.0) if temperature else {}
    torch.manual_seed(seed)
    out: list[list[str]] = []
    for start in range(0, len(prompts), 128):
        chats = [[{"role": "user", "content": p}] for p in prompts[start : start + 128]]
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(
                **enc,
                max_new_tokens=32,
                num_return_sequences=n,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                do_sample=bool(temperature),
                **sampling,
            )
        text = tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        out += [text[i : i + n] for i in range(0, len(text), n)]
    return out


def is_right(response: str, problem: Problem) -> bool:
    """Whether the response's last line is `#### <the answer>` (the strict GSM8K format the val reward reads)."""
    return response.strip().rsplit("\n", 1)[-1] == f"#### {answer_of(problem)}"


def greedy_accuracy(model_dir: str | Path, problems: list[Problem]) -> float:
    """Share of `problems` the model answers right, greedy."""
    responses = generate(model_dir, [format_prompt(p) for p in problems])
    return sum(is_right(r[0], p) for r, p in zip(responses, problems, strict=True)) / len(problems)


def policy_pairs(
    model_dir: str | Path, problems: list[Problem], samples: int = 4, seed: int = 0
) -> list[dict[str, str]]:
    """Preference pairs written by the model itself: `samples` responses to each problem at temperature 1; the
    first right one is `chosen`, the first wrong one `rejected`. A problem whose samples are all right or all wrong
    gives no pair. From configs/sft_toy.yaml's SFT model, which mostly answers in one (usually wrong) line, the
    right samples are mostly worked solutions: the pairs prefer working the columns out, as GRPO's reward does."""
    responses = generate(model_dir, [format_prompt(p) for p in problems], samples, 1.0, seed)
    rows = []
    for problem, rs in zip(problems, responses, strict=True):
        right = [r for r in rs if is_right(r, problem)]
        wrong = [r for r in rs if not is_right(r, problem) and r.strip()]
        if right and wrong:
            rows.append({"prompt": format_prompt(problem), "chosen": right[0], "rejected": wrong[0]})
    return rows


def write_policy_pairs(
    model_dir: str | Path, out: str | Path, n_train: int = 1024, n_val: int = 200, seed: int = 0
) -> Path:
    """OUT/dpo_policy/{train,val}.parquet: policy_pairs on the first n_train SFT train problems and on the n_val
    val problems of `build(out, seed)` (held out from every train split). Returns the folder."""
    train, _, val = split_problems(seed, max(n_train, ToyConfig.n_train), n_val)
    folder = Path(out) / "dpo_policy"
    for split, problems in (("train", train[:n_train]), ("val", val)):
        _write(policy_pairs(model_dir, problems, seed=seed), PAIR_SCHEMA, folder / f"{split}.parquet")
    return folder


def main(cfg: ToyConfig) -> Path:
    """Build the toy model and data from `cfg`."""
    return build(
        cfg.out,
        cfg.seed,
        cfg.n_train,
        cfg.n_val,
        cfg.direct_frac,
        cfg.digits,
        cfg.hidden_size,
        cfg.num_layers,
    )


if __name__ == "__main__":
    print(main(tyro.cli(ToyConfig)))
