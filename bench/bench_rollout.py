"""Rollout throughput: flatrl's `rollout.VLLMEngine.generate` against a bare `vllm.LLM.generate`, one engine.

Both run on the same vLLM engine, started by flatrl with its defaults (so the engine settings are identical by
construction; they are printed under `engine`): "bare" calls `engine.llm.generate` directly with plain
`SamplingParams(n, temperature=1, max_tokens, ignore_eos=True, detokenize=False)`, as a user of vLLM would;
"flatrl" calls `engine.generate`, which adds what training needs (each sampled token's logprob, a seed, Sample
objects). Fixed lengths (`ignore_eos`), random token prompts, the prefix cache reset before every run.

Runs (generated tokens / wall seconds of the generate call):
    bare_n1           P prompts, n=1          the issue's reference: flatrl n=8 should reach 0.9 of it
    bare_n8           P prompts, n=8          flatrl n=8 should reach 0.95 of it
    flatrl_n8_call    flatrl's default (rollout.per_request_seeds=False): the call's seed seeds vLLM's generator
    flatrl_n8_request rollout.per_request_seeds=True: one seeded generator per request

    python bench/bench_rollout.py --model 0.5b --out $OUT/rollout_0.5b.json      # H200: ~4 min
    python bench/bench_rollout.py --toy --out /tmp/rollout_toy.json               # CPU: ~30 s
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import common
from common import Clock
from transformers import AutoConfig

import rollout


def run_bare(engine: rollout.VLLMEngine, prompts: list[list[int]], n: int, max_tokens: int) -> dict:
    """One bare vllm.LLM.generate call; its generated tokens, seconds, tokens/s."""
    from vllm import SamplingParams

    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    engine.llm.reset_prefix_cache()
    with Clock() as c:
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
    return dict(sequences=len(prompts) * n, tokens=tokens, seconds=round(c.s, 3), tok_per_s=tokens / c.s)


def run_flatrl(
    engine: rollout.VLLMEngine, prompts: list[list[int]], n: int, max_tokens: int, per_request: bool
) -> dict:
    """One flatrl engine.generate call (seeded, as rl.generate calls it)."""
    engine.cfg = dataclasses.replace(engine.cfg, per_request_seeds=per_request)
    engine.llm.reset_prefix_cache()
    with Clock() as c:
        samples = engine.generate(prompts, rollout.SamplingConfig(n=n), max_tokens, seed=1234)
    tokens = sum(len(s.response_ids) for s in samples)
    return dict(sequences=len(samples), tokens=tokens, seconds=round(c.s, 3), tok_per_s=tokens / c.s)


def main(args: argparse.Namespace) -> dict:
    """Builds the model, starts one engine, runs the selected runs; returns the result dict."""
    work = args.workdir or tempfile.mkdtemp(prefix="flatrl-bench-")
    path = common.build_model(args.model, f"{work}/{args.model}")
    cfg = rollout.RolloutConfig(
        ignore_eos=True, gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        enforce_eager=args.toy, cpu_kvcache_space_gb=1,
    )  # fmt: skip
    with Clock() as start:
        engine = rollout.make_engine(cfg, str(path), max_model_len=args.prompt_len + args.response_len)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = common.random_prompts(args.num_prompts, args.prompt_len, vocab)
    run_flatrl(engine, prompts[:4], 2, 8, True)  # warm-up: first-call costs stay out of the figures
    runs = {}
    for name in args.runs.split(","):
        if name.startswith("bare"):
            runs[name] = run_bare(engine, prompts, 1 if name == "bare_n1" else args.n, args.response_len)
        else:
            per_request = name == "flatrl_n8_request"
            runs[name] = run_flatrl(engine, prompts, args.n, args.response_len, per_request)
        print(name, runs[name], flush=True)
    engine.shutdown()

    def ratio(a: str, b: str) -> float | None:
        return runs[a]["tok_per_s"] / runs[b]["tok_per_s"] if a in runs and b in runs else None

    result = {
        "bench": "rollout",
        "model": args.model,
        "settings": dict(
            num_prompts=args.num_prompts, prompt_len=args.prompt_len, response_len=args.response_len, n=args.n
        ),
        "engine": {k: v for k, v in engine.llm_kwargs.items() if k != "model"},
        "engine_start_s": round(start.s, 1),
        "runs": runs,
        "ratios": {
            "flatrl_n8_call_vs_bare_n8": ratio("flatrl_n8_call", "bare_n8"),
            "flatrl_n8_call_vs_bare_n1": ratio("flatrl_n8_call", "bare_n1"),
            "flatrl_n8_request_vs_bare_n8": ratio("flatrl_n8_request", "bare_n8"),
            "flatrl_n8_request_vs_bare_n1": ratio("flatrl_n8_request", "bare_n1"),
            "bare_n8_vs_bare_n1": ratio("bare_n8", "bare_n1"),
        },
        "default": "flatrl_n8_call" if not rollout.RolloutConfig.per_request_seeds else "flatrl_n8_request",
        "targets": {"default_vs_bare_n8": 0.95, "default_vs_bare_n1": 0.9},
        "hardware": common.hardware(),
    }
    return common.emit(result, args.out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b", choices=["toy", "0.5b", "1.5b"])
    p.add_argument("--toy", action="store_true", help="CPU smoke run: toy model, 4 prompts x 16 + 16 tokens")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=256, help="tokens")
    p.add_argument("--response-len", type=int, default=512, help="tokens, every response (ignore_eos)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt of the n=8 runs")
    p.add_argument("--max-num-seqs", type=int, default=rollout.RolloutConfig.max_num_seqs)
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=rollout.RolloutConfig.gpu_memory_utilization
    )
    p.add_argument("--runs", default="bare_n1,bare_n8,flatrl_n8_call,flatrl_n8_request")
    p.add_argument("--workdir", default=None, help="where the model is built (reused); default a temp dir")
    p.add_argument("--out", default=None, help="also write the JSON line to this file")
    args = p.parse_args(argv)
    if args.toy:
        args.model, args.num_prompts, args.prompt_len, args.response_len, args.n = "toy", 4, 16, 16, 2
        args.max_num_seqs = 16
    return args


if __name__ == "__main__":
    main(parse())
