"""Policy update throughput: grpo.py's update (actor.update with grpo.policy_loss) packed (use_remove_padding + use_dynamic_bsz) against padded.

The policy as grpo.py holds it (FSDP2, fp32 master weights, bf16 compute, AdamW), GRPO samples of random tokens:
`--num-prompts` x n responses, prompts of `--prompt-len` tokens, responses 50/50 `--short-len` and
`--long-len` tokens (drawn per response, seeded), advantages +-1. Per mode, one warm-up update, then
`--steps` timed updates (`--mini-batches` optimizer steps each), and one timed old-logprob pass
(actor.compute_logprobs, forward only):

    packed   model.use_remove_padding, actor.use_dynamic_bsz, ppo_max_token_len_per_gpu=--token-budget:
             one [1, N] row per micro-batch, varlen attention on GPU (attention.VARLEN)
    padded   right-padded [B, T] micro-batches of --micro-batch-size responses (sdpa with a padding mask)
    fused    packed, with model.use_fused_kernels: logprobs from the hidden states in row chunks, no [N, V] logits
    compiled packed, with model.compile_layers: each decoder layer's forward through torch.compile (its warm-up
             update pays the compilation)

Figures: trained tokens (prompt + response, padding not counted) per second; MFU = 6 x matmul params x tokens
/ seconds / 989 TFLOP/s (perf.py), also against the 787 TFLOP/s an 8192^3 bf16 matmul reaches on the H200;
peak CUDA memory; perf.plan's update-phase estimate for the packed run next to its measured peak; actor.update's own
split (`update_parts_s`: the micro-batches' forwards and backwards, the optimizer steps, the micro-batch count), and
with `--profile` on CUDA the device's busy share (its kernels' and copies' time over the timed updates' wall: below 1
the device waited for the host). `--checkpoint-layers N` recomputes the first N layers (with --gradient-checkpointing).

    python bench/bench_update.py --sizes 0.5b,1.5b --out $OUT/update.json      # H200: ~3 min
    python bench/bench_update.py --toy --out /tmp/update_toy.json               # CPU: ~30 s

SmolLM2-135M (scripts/get_smollm2.py), issue 17's shape, full fine-tuning and LoRA r32 + gradient checkpointing
(H200: expected well under 2 minutes each without --profile, not yet run; --profile --steps 1 adds the operator table and the op count):

    M=models/smollm2-135m-instruct; S="--modes packed --num-prompts 64 --n 8 --prompt-len 128 --short-len 64
        --long-len 384 --mini-batches 1 --steps 2 --token-budget 65536"
    python bench/bench_update.py --sizes $M $S --out $OUT/update_smollm2_full.json
    python bench/bench_update.py --sizes $M $S --lora-rank 32 --gradient-checkpointing --out $OUT/update_smollm2_lora.json
    # CPU smoke of the same path (~1 min): --num-prompts 2 --n 2 --prompt-len 32 --short-len 16 --long-len 48
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import random
import tempfile
from pathlib import Path
from types import SimpleNamespace

import common
import torch
from common import Clock

import actor
import fsdp
import grpo
import losses
import optim
import perf
import rl
import rollout


def make_samples(args: argparse.Namespace, vocab: int) -> list[actor.Sample]:
    """num_prompts x n samples, grouped per prompt, responses short or long at random (seeded)."""
    rng = random.Random(0)
    prompts = common.random_prompts(args.num_prompts, args.prompt_len, vocab)
    samples = []
    for g, p in enumerate(prompts):
        for _ in range(args.n):
            L = args.short_len if rng.random() < 0.5 else args.long_len
            ids = [rng.randrange(min(300, vocab // 2), vocab) for _ in range(L)]
            samples.append(actor.Sample(p, ids, [0.0] * L, "length", g, advantages=rng.choice([-1.0, 1.0])))
    return samples


@contextlib.contextmanager
def profiled(on: bool):
    """torch.profiler over the block (CPU and CUDA activity) when `on`, else nothing; yields the profiler or None."""
    if not on:
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield prof


def run_mode(policy, optimizer, samples, args, packed: bool, device) -> dict:
    """Warm-up + timed updates + one timed old-logprob pass in one layout; figures of the timed part."""
    actor_cfg = actor.ActorConfig(
        ppo_mini_batch_size=args.num_prompts // args.mini_batches,
        use_dynamic_bsz=packed,
        ppo_max_token_len_per_gpu=args.token_budget,
        ppo_micro_batch_size_per_gpu=args.micro_batch_size,
    )
    cfg = grpo.GRPOConfig(actor=actor_cfg, data=rl.RLDataConfig(max_response_length=args.long_len))
    layout = actor.Layout(packed, 0, device)
    guard = optim.SkipGuard(10**6)
    loss_fn = functools.partial(grpo.policy_loss, cfg=cfg, check=None)
    update = lambda: actor.update(
        policy, optimizer, guard, samples, args.num_prompts, actor_cfg, layout, loss_fn
    )  # noqa: E731
    actor.compute_logprobs(policy, samples, actor_cfg, layout, 1.0)  # sets old_logprobs
    update()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    parts: dict[str, float] = {}  # actor.update's own split (perf/actor_*), summed over the timed updates
    with Clock() as c, profiled(args.profile) as prof:
        for _ in range(args.steps):
            for k, v in update().items():
                if k.startswith("perf/actor_"):
                    k = k.removeprefix("perf/actor_")
                    parts[k] = parts.get(k, 0.0) + v
    with Clock() as lp:
        actor.compute_logprobs(policy, samples, actor_cfg, layout, 1.0)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    tokens = args.steps * sum(lengths)
    shape = perf.model_shape(args.path)
    m = perf.update_metrics(shape, tokens, args.steps * sum(n * n for n in lengths), c.s, 1)
    out = {
        "seconds": round(c.s, 3),
        "tokens": tokens,
        "tok_per_s": tokens / c.s,
        "mfu": m["perf/mfu"],
        "mfu_vs_matmul_peak": m["perf/mfu"] * perf.PEAK_FLOPS / perf.MATMUL_FLOPS_H200,
        "mfu_attn": m["perf/mfu_attn"],
        "old_logprob_tok_per_s": sum(lengths) / lp.s,
        "micro_batches": len(actor.micro_batches(samples, list(range(len(samples))), actor_cfg)),
        "update_parts_s": parts,
    }
    if prof is not None:  # where the update's time goes: the top operators by their own device (or CPU) time
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        events = prof.key_averages()
        out["profile_top"] = events.table(sort_by=key, row_limit=15)
        # host work: every aten op is one dispatch (and on GPU mostly one launch); at small hidden sizes the
        # update is bound by how many there are, not by their FLOPs
        out["aten_ops_per_update"] = sum(e.count for e in events if e.key.startswith("aten::")) // args.steps
        # the device's own time over the timed updates' wall: below 1, it waited for the host
        if torch.cuda.is_available():
            device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
            out["device_busy_share"] = device_us / 1e6 / c.s
        print(out["profile_top"], flush=True)
    if torch.cuda.is_available():
        out |= {
            "peak_allocated_gib": common.gib(torch.cuda.max_memory_allocated()),
            "peak_reserved_gib": common.gib(torch.cuda.max_memory_reserved()),
        }
    return out


def bench_size(size: str, args: argparse.Namespace, d: fsdp.Dist, work: str) -> dict:
    """packed and padded runs of one model size, and the plan of the packed one."""
    # A model folder (e.g. the real SmolLM2-135M-Instruct, scripts/get_smollm2.py) or a built random shape.
    args.path = size if Path(size).is_dir() else str(common.build_model(size, f"{work}/{size}"))
    model_cfg = actor.ModelConfig(
        path=args.path,
        lora_rank=args.lora_rank,
        lora_alpha=2.0 * args.lora_rank,
        enable_gradient_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing_layers=args.checkpoint_layers,
    )
    policy, _ = actor.load(model_cfg, d.device)
    optimizer, _ = optim.build(policy.parameters(), actor.ActorConfig().optim, total_steps=100)
    samples = make_samples(args, perf.model_shape(args.path).vocab)
    out: dict = {"attn_implementation": policy.config._attn_implementation}
    for mode in args.modes.split(","):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if mode == "fused":
            losses.fuse_lm_head(policy)
        if mode == "compiled":
            fsdp.compile_layers(policy)
        try:
            out[mode] = run_mode(policy, optimizer, samples, args, mode != "padded", d.device)
        finally:
            setattr(policy, losses.FUSED_HEAD, False)
            for layer in fsdp.decoder_layers(policy):  # the class's own forward again
                vars(layer).pop("forward", None)
        print(size, mode, out[mode], flush=True)
    if "packed" in out and "padded" in out:
        out["packed_vs_padded"] = out["packed"]["tok_per_s"] / out["padded"]["tok_per_s"]
    if "packed" in out and "compiled" in out:
        out["compiled_vs_packed"] = out["compiled"]["tok_per_s"] / out["packed"]["tok_per_s"]
    if "packed" in out and "fused" in out:
        out["fused_vs_packed"] = out["fused"]["tok_per_s"] / out["packed"]["tok_per_s"]
        if "peak_allocated_gib" in out["fused"]:
            out["fused_vs_packed_peak_allocated"] = (
                out["fused"]["peak_allocated_gib"] / out["packed"]["peak_allocated_gib"]
            )
    plan_cfg = SimpleNamespace(
        model=model_cfg,
        rollout=rollout.RolloutConfig(),
        actor=actor.ActorConfig(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=args.token_budget),
        data=SimpleNamespace(max_prompt_length=args.prompt_len, max_response_length=args.long_len),
    )
    update = perf.plan(plan_cfg, 1).phases["update"]
    estimate = sum(v for k, v in update.items() if k not in ("engine asleep", "cuda context"))
    out["plan_update_gib"] = common.gib(estimate)  # no engine here: its share is left out
    if "peak_allocated_gib" in out.get("packed", {}):
        out["plan_vs_measured_peak_allocated"] = out["plan_update_gib"] / out["packed"]["peak_allocated_gib"]
    return out


def main(args: argparse.Namespace) -> dict:
    d = fsdp.init_distributed()
    work = args.workdir or tempfile.mkdtemp(prefix="flatrl-bench-")
    sizes = common.per_size(args.sizes, lambda size: bench_size(size, args, d, work))
    settings = {k: getattr(args, k) for k in ("num_prompts", "n", "prompt_len", "short_len", "long_len")}
    settings |= {k: getattr(args, k) for k in ("token_budget", "micro_batch_size", "steps", "mini_batches")}
    settings |= {k: getattr(args, k) for k in ("lora_rank", "gradient_checkpointing", "checkpoint_layers")}
    result = {
        "bench": "update",
        "sizes": sizes,
        "settings": settings,
        "targets": {"packed_vs_padded": 1.5, "1.5b packed mfu": 0.35},
        "reference": "plain transformers step, sdpa, 32 x 768 uniform, 0.5B: 84k tok/s, MFU 0.25",
        "hardware": common.hardware(),
    }
    return common.emit(result, args.out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.5b,1.5b", help="comma-separated: toy, 0.5b, 1.5b, or model folders")
    p.add_argument("--toy", action="store_true", help="CPU smoke run on the toy model")
    p.add_argument(
        "--modes",
        default="packed,padded,fused",
        help="comma-separated: packed, padded, fused, compiled (the docstring says)",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--long-len", type=int, default=512)
    p.add_argument("--token-budget", type=int, default=16384, help="packed: tokens per micro-batch")
    p.add_argument("--micro-batch-size", type=int, default=16, help="padded: responses per micro-batch")
    p.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per update")
    p.add_argument("--steps", type=int, default=2, help="timed updates per mode")
    p.add_argument(
        "--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (alpha 2 x rank)"
    )
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument(
        "--checkpoint-layers",
        default="all",
        type=lambda v: v if v == "all" else int(v),
        help="with --gradient-checkpointing: model.gradient_checkpointing_layers, all (default) or the first N layers",
    )
    p.add_argument("--profile", action="store_true", help="print (and keep) torch.profiler's top operators")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.toy:
        args.sizes, args.num_prompts, args.n, args.prompt_len = "toy", 4, 4, 8
        args.short_len, args.long_len, args.token_budget, args.micro_batch_size, args.steps = 4, 24, 64, 4, 1
    return args


if __name__ == "__main__":
    main(parse())
