"""Rollout/trainer logprob mismatch on a real model, and what the trainer-side remedies buy and cost (issue 17).

vLLM (bf16, as flatrl's rollout runs it) samples `--samples` responses at temperature 1 to the prompts of a
verl-schema parquet and reports each sampled token's logprob. The trainer side then scores the same tokens three
ways, all through losses.token_logprobs_and_entropy (fp32 log-softmax, as the trainer does):
    bf16        every matmul in bf16, logits bf16: flatrl's trainer today (FSDP2 MixedPrecisionPolicy bf16)
    fp32_head   the body in bf16, the last hidden state upcast and multiplied by the fp32 lm_head: fp32 logits
    fp32        every matmul in fp32
For each: mean |d logprob| against vLLM's over all response tokens, mean d (bias), the 99th percentile, the max;
the fraction of tokens where exp(d) leaves [0.5, 2] (what TIS at threshold 2 would truncate); and the seconds of
one forward + backward over the batch (median of 3, the update's cost), with the ratio to bf16's.

    python bench/bench_mismatch.py --model runs/real/model --data runs/real/data/arith_words/test.parquet --out $OUT/mismatch.json
    python bench/bench_mismatch.py --model models/smollm2-135m-instruct --data /tmp/words/test.parquet --prompts 4 --samples 2 --max-tokens 16   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import common
import torch

import losses


def sample(args: argparse.Namespace, tokenizer) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """(prompt ids, response ids, vLLM's logprob of each response token) of the sampled responses."""
    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams

    rows = pq.read_table(args.data).to_pylist()[: args.prompts]
    prompts = [
        tokenizer.apply_chat_template(
            r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for r in rows
    ]
    llm = LLM(
        model=args.model,
        dtype=args.vllm_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=0,
        enable_prefix_caching=False,
    )
    params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    prompt_ids, response_ids, engine_lp = [], [], []
    for p, out in zip(prompts, outs, strict=True):
        for c in out.outputs:
            ids = list(c.token_ids)
            prompt_ids.append(list(p))
            response_ids.append(ids)
            engine_lp.append([c.logprobs[i][t].logprob for i, t in enumerate(ids)])
    del llm
    return prompt_ids, response_ids, engine_lp


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def batches(prompt_ids, response_ids, size: int, device: str):
    """Right-padded [B, T] inputs, attention masks, labels and response masks, `size` rows at a time."""
    for s in range(0, len(prompt_ids), size):
        seqs = [p + r for p, r in zip(prompt_ids[s : s + size], response_ids[s : s + size], strict=True)]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attn = torch.zeros(len(seqs), width, dtype=torch.long)
        resp = torch.zeros(
            len(seqs), width, dtype=torch.bool
        )  # positions whose next token is a response token
        for i, (p, seq) in enumerate(zip(prompt_ids[s : s + size], seqs, strict=True)):
            ids[i, : len(seq)], attn[i, : len(seq)] = torch.tensor(seq), 1
            resp[i, len(p) - 1 : len(seq) - 1] = True
        labels = torch.roll(ids, -1, dims=1)
        yield ids.to(device), attn.to(device), labels.to(device), resp.to(device)


def score(variant: str, m16, m32, ids, attn, labels) -> torch.Tensor:
    """[B, T] fp32 logprobs of labels under `variant` (see the module docstring)."""
    if variant == "fp32":
        return losses.token_logprobs_and_entropy(
            m32(input_ids=ids, attention_mask=attn).logits, labels, 1024, False
        )[0]
    if variant == "bf16":
        return losses.token_logprobs_and_entropy(
            m16(input_ids=ids, attention_mask=attn).logits, labels, 1024, False
        )[0]
    hidden = m16.model(
        input_ids=ids, attention_mask=attn
    ).last_hidden_state  # [B, T, H] bf16, after the final norm
    logits = hidden.float() @ m32.lm_head.weight.T  # [B, T, V] fp32
    return losses.token_logprobs_and_entropy(logits, labels, 1024, False)[0]


def main(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_ids, response_ids, engine_lp = sample(args, tokenizer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    m16 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device)
    engine = torch.tensor([x for lp in engine_lp for x in lp])  # [N] response tokens in order
    result = {"bench": "mismatch", "model": args.model, "response_tokens": len(engine), "variants": {}}
    for variant in ("bf16", "fp32_head", "fp32"):
        with torch.no_grad():
            trainer = torch.cat(
                [lp[resp].cpu() for ids, attn, labels, resp in batches(prompt_ids, response_ids, args.batch, device)
                 for lp in [score(variant, m16, m32, ids, attn, labels)]]
            )  # fmt: skip
        d = trainer - engine  # [N]
        times = []
        for _ in range(3):  # forward + backward of the whole batch, the update's cost
            sync()
            t0 = time.perf_counter()
            for ids, attn, labels, resp in batches(prompt_ids, response_ids, args.batch, device):
                score(variant, m16, m32, ids, attn, labels)[resp].sum().backward()
            sync()
            times.append(time.perf_counter() - t0)
            m16.zero_grad(set_to_none=True)
            m32.zero_grad(set_to_none=True)
        result["variants"][variant] = {
            "mean_abs_diff": d.abs().mean().item(),
            "mean_diff": d.mean().item(),
            "p99_abs_diff": d.abs().quantile(0.99).item(),
            "max_abs_diff": d.abs().max().item(),
            "frac_ratio_outside_0.5_2": ((d.exp() > 2) | (d.exp() < 0.5)).float().mean().item(),
            "fwd_bwd_s": statistics.median(times),
        }
    base = result["variants"]["bf16"]["fwd_bwd_s"]
    for v in result["variants"].values():
        v["cost_vs_bf16"] = v["fwd_bwd_s"] / base
    result["settings"] = vars(args) | {"hardware": common.hardware()}
    return common.emit(result, args.out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a HF model folder (scripts/get_smollm2.py's)")
    p.add_argument("--data", required=True, help="verl-schema parquet whose prompt column is chat messages")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=32, help="rows per trainer forward")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(parse())
