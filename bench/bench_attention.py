"""Padding-free attention: does the GPU path (attention.VARLEN) give the padded layout's logprobs and gradients, and
how fast is a training micro-batch in each layout.

One model (FSDP2 as the trainer holds it: bf16 compute on GPU), one micro-batch of S sequences of random
lengths in [--min-len, --max-len], three layouts through losses.forward_logprobs:

    varlen   pack_batch(mask_dtype=None): [1, N] + cu_seqlens -> torch's varlen flash kernel (CPU: the
             exact scatter-to-padded fallback)
    dense    pack_batch(): [1, N] + an N x N block-diagonal bool mask -> sdpa (the CPU path)
    padded   pad_batch(): [S, T] right-padded -> sdpa with a padding mask

Figures: max and mean |logprob - padded logprob| over the response tokens, the relative difference of the
gradient (||g - g_padded|| / ||g_padded||), and the median seconds of forward + backward per layout.

    python bench/bench_attention.py --model 0.5b --out $OUT/attention.json    # H200: ~40 s
    python bench/bench_attention.py --toy --out /tmp/attention_toy.json        # CPU: ~10 s
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile

import common
import torch
from common import Clock

import attention
import data
import fsdp
import losses


def layouts(seqs: list[list[int]], masks: list[list[int]], device: torch.device) -> dict[str, dict]:
    """The three collated batches, on `device`."""
    batches = {
        "varlen": data.pack_batch(seqs, masks, mask_dtype=None),
        "dense": data.pack_batch(seqs, masks),
        "padded": data.pad_batch(seqs, masks, pad_id=0),
    }
    return {k: {n: t.to(device) for n, t in b.items()} for k, b in batches.items()}


def forward_backward(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """One training pass: response-token logprobs [M] (sequence order), their sum backpropagated."""
    model.zero_grad(set_to_none=True)
    labels, label_mask = data.shift_labels(batch)
    lp, _, _ = losses.forward_logprobs(model, batch, labels)
    (lp * label_mask).sum().backward()
    return lp[label_mask.bool()].detach().float()


def logprobs_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Response-token logprobs in sequence order [M] and the flattened gradient of their sum."""
    lp = forward_backward(model, batch)
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return lp, torch.cat([g.float().flatten() for g in grads])


def run(args: argparse.Namespace) -> dict:
    d = fsdp.init_distributed()
    work = args.workdir or tempfile.mkdtemp(prefix="flatrl-bench-")
    path = str(common.build_model(args.model, f"{work}/{args.model}"))
    model = fsdp.shard_model(
        fsdp.load_model(path, attn_implementation=attention.VARLEN), d.device, fsdp.FSDPConfig()
    )
    vocab = model.config.vocab_size
    rng = random.Random(0)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_seqs)]
    seqs = [[rng.randrange(min(300, vocab // 2), vocab) for _ in range(n)] for n in lengths]
    masks = [[0] * (n // 3) + [1] * (n - n // 3) for n in lengths]  # a third prompt, the rest response
    batches = layouts(seqs, masks, d.device)
    results = {k: logprobs_and_grads(model, b) for k, b in batches.items()}
    lp_ref, g_ref = results["padded"]
    out: dict = {"tokens": sum(lengths), "sequences": len(lengths), "max_len": max(lengths)}
    api = attention._torch_varlen()
    out["kernel"] = "torch varlen_attn" if api is not None and d.device.type == "cuda" else "sdpa fallback"
    for name in ("varlen", "dense"):
        lp, g = results[name]
        out[name] = {
            "logprob_max_abs_diff": (lp - lp_ref).abs().max().item(),
            "logprob_mean_abs_diff": (lp - lp_ref).abs().mean().item(),
            "grad_rel_diff": ((g - g_ref).norm() / g_ref.norm()).item(),
        }
    for name, b in batches.items():
        times = []
        for _ in range(args.repeats):
            with Clock() as c:
                forward_backward(model, b)
            times.append(c.s)
        out.setdefault(name, {})["fwd_bwd_s"] = round(statistics.median(times), 4)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            forward_backward(model, b)
            out[name]["peak_allocated_gib"] = common.gib(torch.cuda.max_memory_allocated())
    out["varlen_speedup_vs_padded"] = out["padded"]["fwd_bwd_s"] / out["varlen"]["fwd_bwd_s"]
    out["varlen_speedup_vs_dense"] = out["dense"]["fwd_bwd_s"] / out["varlen"]["fwd_bwd_s"]
    print(out, flush=True)
    return out


def main(args: argparse.Namespace) -> dict:
    result = {"bench": "attention", "model": args.model, **run(args), "hardware": common.hardware()}
    return common.emit(result, args.out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b", choices=["toy", "0.5b", "1.5b"])
    p.add_argument("--toy", action="store_true", help="CPU smoke run on the toy model")
    p.add_argument("--num-seqs", type=int, default=24)
    p.add_argument("--min-len", type=int, default=300)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.toy:
        args.model, args.num_seqs, args.min_len, args.max_len, args.repeats = "toy", 5, 5, 40, 1
    return args


if __name__ == "__main__":
    main(parse())
