"""TinyZero's countdown task, generated offline from a seed, as verl-schema parquet (and optionally a model).

    python scripts/prepare_countdown.py --out ~/data/countdown          # for configs/grpo_countdown_qwen2.5-3b.yaml
    python scripts/prepare_countdown.py --out runs/repro/data --style plain --n-sft 100000 \
        --model-out runs/repro/model --hidden-size 512 --num-layers 8  # scripts/repro.sh: a model from scratch

A problem is 3 or 4 numbers in [1, 99] and a target in [1, 99]; the answer is an equation that uses every number
exactly once with + - * / and parentheses and equals the target (TinyZero's rule, checked by
reward.countdown_score). Each problem is built from such an equation, so every one is solvable; the equation is
kept in extra_info.solution. The same seed gives byte-identical files; test problems never occur in a train split
(a problem is its sorted numbers and its target).

Files written:
    OUT/train.parquet, OUT/test.parquet   RL prompts in verl's schema (what TinyZero's countdown.py writes):
        data_source    "countdown" (reward.default_compute_score sends it to countdown_score)
        prompt         chat messages. style nano-aha: nano-aha-moment's system and user messages; plain: one user
                       turn "Using the numbers [44, 19, 35], create an equation that equals 98."
        prompt_chatml  (style nano-aha) those messages in Qwen2.5's ChatML plus nano-aha-moment's assistant prefill
                       "Let me solve this step by step.\\n<think>", the exact text it feeds to vLLM; read it with
                       data.prompt_key=prompt_chatml and data.apply_chat_template=false
        ability        "math"
        reward_model   {"style": "rule", "ground_truth": {"target": int, "numbers": [int, ...]}}
        extra_info     {"split", "index", "solution"}
    OUT/sft/train.parquet, OUT/sft/test.parquet   (with --n-sft > 0) columns prompt (the user message) and
        response, a worked solution: one step per operation, then the equation, e.g.
        "<think>44+19=63, 63+35=98</think>\\n<answer>(44+19)+35</answer>"
    MODEL_OUT/   (with --model-out) a randomly initialised Qwen2 model and a byte-level BPE tokenizer trained on
        this task's text, built with toy.build_tokenizer and toy.build_model (digits single tokens, the
        Qwen-style chat template), for training from scratch.

Where it deviates from TinyZero and nano-aha-moment:
1. Nothing is downloaded: the problems of Jiayi-Pan/Countdown-Tasks-3to4 are replaced by generated ones. Its
   generator was not found, so only the format is matched, not the distribution of numbers and targets.
2. Intermediate results of the construction are positive integers (a division only when exact, a product at most
   MAX_INTERMEDIATE); a solver may still use fractions, which countdown_score accepts when the value is exact.
3. The prompts (verbatim, sources below) are data, not code: nano-aha-moment's SYSTEM_MESSAGE, PROMPT_TEMPLATE and
   assistant prefill (McGill-NLP/nano-aha-moment, nano_r1.ipynb / nano_r1_script.py).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
import tyro

DATA_SOURCE = "countdown"
# nano-aha-moment's prompt (McGill-NLP/nano-aha-moment, nano_r1.ipynb), verbatim.
SYSTEM_MESSAGE = (
    "You are a helpful assistant. You first think about the reasoning process in the mind "
    "and then provide the user with the answer."
)
PROMPT_TEMPLATE = (
    "Using the numbers {numbers}, create an equation that equals {target}. "
    "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. "
    "Show your work in <think> </think> tags. And return the final equation and answer in "
    "<answer> </answer> tags, for example <answer>(1 + 2) / (3 * 5)</answer>."
)
ASSISTANT_PREFILL = "Let me solve this step by step.\n<think>"
PLAIN_TEMPLATE = "Using the numbers {numbers}, create an equation that equals {target}."
MAX_INTERMEDIATE = (
    9999  # keeps worked steps short; a 4-number product of 2-digit numbers would reach 8 digits
)


@dataclass(frozen=True)
class Args:
    """What to generate and where."""

    out: str = "~/data/countdown"
    """Output folder for train.parquet, test.parquet (and sft/)."""
    seed: int = 0
    """Seeds the problem draw (and the model's weights with --model-out)."""
    n_train: int = 100_000
    """RL training prompts."""
    n_test: int = 500
    """Held-out prompts (nano-aha-moment holds out 500); the same problems make sft/test.parquet."""
    n_sft: int = 0
    """SFT examples with worked solutions in sft/train.parquet (0: no sft/ folder); disjoint from the RL ones."""
    style: Literal["nano-aha", "plain"] = "nano-aha"
    """Prompt: nano-aha-moment's (for a pretrained Qwen2.5) or a one-line question (for a model from scratch)."""
    min_numbers: int = 3
    """Fewest numbers in a problem."""
    max_numbers: int = 4
    """Most numbers in a problem."""
    max_number: int = 99
    """Numbers are drawn from [1, max_number]."""
    max_target: int = 99
    """Targets lie in [1, max_target]."""
    model_out: str | None = None
    """Also write a from-scratch Qwen2 model and tokenizer for this task here."""
    hidden_size: int = 512
    """--model-out: hidden size (heads of 64 dimensions)."""
    num_layers: int = 8
    """--model-out: transformer layers."""
    vocab_size: int = 400
    """--model-out: BPE vocabulary bound (256 bytes, 3 special tokens, merges)."""


Problem = tuple[list[int], int, str, list[str]]  # numbers, target, equation, worked steps


def make_problem(rng: random.Random, args: Args) -> Problem:
    """Draw how many numbers, then the numbers, then combine random pairs with random valid operations until one
    value is left; retry (same count) until that value is a target in [1, max_target].

    Returns:
        (numbers, target, equation, steps): the equation uses every number once and evaluates to target; steps
        are "a+b=c" strings in the order of construction.
    """
    count = rng.randint(args.min_numbers, args.max_numbers)  # drawn once: retries must not favour 3 numbers
    while True:
        numbers = [rng.randint(1, args.max_number) for _ in range(count)]
        pool = [(n, str(n), True) for n in numbers]  # (value, expression, is a bare number)
        steps = []
        while len(pool) > 1:
            (a, ea, leaf_a), (b, eb, leaf_b) = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
            if a < b:
                (a, ea, leaf_a), (b, eb, leaf_b) = (b, eb, leaf_b), (a, ea, leaf_a)
            ops = (
                ["+"]
                + ["-"] * (a != b)
                + ["*"] * (a * b <= MAX_INTERMEDIATE)
                + ["/"] * (b > 1 and a % b == 0)
            )
            op = rng.choice(ops)
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]  # b >= 1: every value is positive
            left, right = (e if leaf else f"({e})" for e, leaf in ((ea, leaf_a), (eb, leaf_b)))
            steps.append(f"{a}{op}{b}={value}")
            pool.append((value, f"{left}{op}{right}", False))
        target, equation, _ = pool[0]
        if 1 <= target <= args.max_target:
            return numbers, target, equation, steps


def draw(args: Args, n: int) -> list[Problem]:
    """`n` distinct problems (by sorted numbers and target) from args.seed."""
    rng = random.Random(args.seed)
    seen, out = set(), []
    while len(out) < n:
        p = make_problem(rng, args)
        key = (tuple(sorted(p[0])), p[1])
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def user_message(numbers: list[int], target: int, style: str) -> str:
    """The user turn of a problem in the given prompt style (numbers print as a Python list, as in TinyZero)."""
    return (PROMPT_TEMPLATE if style == "nano-aha" else PLAIN_TEMPLATE).format(numbers=numbers, target=target)


def chatml(messages: list[dict[str, str]], prefill: str) -> str:
    """Qwen2.5's chat template applied to `messages`, then an assistant turn continued from `prefill` (what
    `apply_chat_template(..., continue_final_message=True)` renders for a Qwen2.5 tokenizer)."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return f"{turns}<|im_start|>assistant\n{prefill}"


def worked_solution(equation: str, steps: list[str]) -> str:
    """The SFT response: `<think>` the steps `</think>` then the equation in `<answer>` tags."""
    return f"<think>{', '.join(steps)}</think>\n<answer>{equation}</answer>"


def rl_row(problem: Problem, split: str, index: int, style: str) -> dict:
    """One RL row in verl's schema (module docstring)."""
    numbers, target, equation, _ = problem
    messages = [{"role": "user", "content": user_message(numbers, target, style)}]
    if style == "nano-aha":
        messages.insert(0, {"role": "system", "content": SYSTEM_MESSAGE})
    row = {
        "data_source": DATA_SOURCE,
        "prompt": messages,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": target, "numbers": numbers}},
        "extra_info": {"split": split, "index": index, "solution": equation},
    }
    if style == "nano-aha":
        row["prompt_chatml"] = chatml(messages, ASSISTANT_PREFILL)
    return row


def build_model(texts: list[str], args: Args) -> Path:
    """A from-scratch Qwen2 model and tokenizer for this task in args.model_out (toy.py's builders)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import toy  # the repo's offline model builder (digit-per-token BPE, Qwen-style chat template)

    out = Path(args.model_out).expanduser()
    tokenizer = toy.build_tokenizer(["system\nuser\nassistant\n", *texts], vocab_size=args.vocab_size)
    model = toy.build_model(tokenizer, args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{out}: Qwen2 {args.num_layers} layers x {args.hidden_size}, {n_params / 1e6:.1f}M parameters, "
          f"vocabulary {len(tokenizer)}")  # fmt: skip
    return out


def main(args: Args) -> Path:
    """Writes the parquet files (and the model); returns the output folder."""
    if not 1 <= args.min_numbers <= args.max_numbers:
        raise ValueError(f"need 1 <= min_numbers <= max_numbers, got {args.min_numbers}, {args.max_numbers}")
    out = Path(args.out).expanduser()
    problems = draw(args, args.n_test + args.n_train + args.n_sft)
    test, train, sft = (
        problems[: args.n_test],
        problems[args.n_test : args.n_test + args.n_train],
        problems[args.n_test + args.n_train :],
    )
    out.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", train), ("test", test)):
        rows = [rl_row(p, split, i, args.style) for i, p in enumerate(part)]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
        print(f"{out / f'{split}.parquet'}: {len(rows)} prompts")
    texts = []
    if args.n_sft:
        (out / "sft").mkdir(exist_ok=True)
        for split, part in (("train", sft), ("test", test)):
            rows = [
                {"prompt": user_message(p[0], p[1], args.style), "response": worked_solution(p[2], p[3])}
                for p in part
            ]
            pq.write_table(pa.Table.from_pylist(rows), out / "sft" / f"{split}.parquet")
            texts += [text for r in rows for text in (r["prompt"], r["response"])]
            print(f"{out / 'sft' / f'{split}.parquet'}: {len(rows)} worked solutions")
    if args.model_out:
        texts = texts or [user_message(p[0], p[1], args.style) for p in problems] + [
            worked_solution(p[2], p[3]) for p in problems
        ]
        build_model(texts, args)
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
