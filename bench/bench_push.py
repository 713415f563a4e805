"""Weight push: seconds to move every weight of the FSDP2 trainer into the colocated vLLM engine.

For each model size: the policy as grpo.py holds it (fsdp.load_model + shard_model: fp32 master, one rank) and a
flatrl engine (rollout.make_engine, flatrl's defaults but `enforce_eager`: CUDA graphs do not take part in a
push and cost start-up time). Timed, `--repeats` times each, median and min reported:

    gather        fsdp.iter_full_params over every parameter, cast to the engine dtype, nothing pushed
    push_awake    actor.push_weights into an awake engine (gather + vLLM load_weights + prefix-cache reset)
    sleep         engine.sleep() at sleep_level L (what the end of the gen phase costs)
    cycle         actor.push_weights into a sleeping engine: wake weights, gather + load, wake KV cache,
                  prefix-cache reset: the sync phase of a training step (the issue's target: < 0.3 s, 1.5B)
    sleep+cycle   both, per level (2 is flatrl's default; 1 for comparison)

After the last cycle the engine generates a few tokens and the trainer recomputes their logprobs
(actor.compute_logprobs): `logprob_diff_mean` shows the engine runs the pushed weights (buffers included).

    python bench/bench_push.py --sizes 0.5b,1.5b --out $OUT/push.json     # H200: ~2 min
    python bench/bench_push.py --toy --out /tmp/push_toy.json              # CPU: ~40 s
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

import common
import torch
from common import Clock

import actor
import fsdp
import rollout


def timed(fn, repeats: int) -> dict:
    """Median and min seconds of `repeats` calls of fn()."""
    times = []
    for _ in range(repeats):
        with Clock() as c:
            fn()
        times.append(c.s)
    return {"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4)}


def bench_size(size: str, args: argparse.Namespace, d: fsdp.Dist, work: str) -> dict:
    """All timings of one model size."""
    path = str(common.build_model(size, f"{work}/{size}"))
    policy = fsdp.shard_model(fsdp.load_model(path), d.device, fsdp.FSDPConfig())
    cfg = rollout.RolloutConfig(
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=True,
        cpu_kvcache_space_gb=1,
        max_num_seqs=16 if args.toy else rollout.RolloutConfig.max_num_seqs,
    )
    engine = rollout.make_engine(cfg, path, max_model_len=args.max_model_len)
    dtype = torch.float32 if d.device.type == "cpu" else getattr(torch, cfg.dtype)
    push = lambda: actor.push_weights(engine, policy, dtype)  # noqa: E731
    push()  # warm-up: the first push pays one-time costs
    out: dict = {"params": sum(p.numel() for p in policy.parameters()), "sleep_mode": engine.sleep_enabled}
    out["gather"] = timed(lambda: [None for _ in fsdp.iter_full_params(policy, dtype)], args.repeats)
    out["push_awake"] = timed(push, args.repeats)
    for level in [int(x) for x in args.levels.split(",")]:
        engine.cfg = dataclasses.replace(engine.cfg, sleep_level=level)
        sleeps, cycles = [], []
        for _ in range(args.repeats):
            with Clock() as s:
                engine.sleep()
            with Clock() as c:
                push()
            sleeps.append(s.s)
            cycles.append(c.s)
        med = lambda xs: round(statistics.median(xs), 4)  # noqa: E731
        out[f"level{level}"] = {
            "sleep_median_s": med(sleeps),
            "cycle_median_s": med(cycles),
            "cycle_min_s": round(min(cycles), 4),
            "sleep_plus_cycle_median_s": med([a + b for a, b in zip(sleeps, cycles, strict=True)]),
        }
        print(size, f"level {level}", out[f"level{level}"], flush=True)
    out["logprob_diff_mean"] = check_push(engine, policy, d.device)
    engine.shutdown()
    return out  # the policy goes with this frame; main() empties the CUDA cache


def check_push(engine: rollout.VLLMEngine, policy: torch.nn.Module, device: torch.device) -> float:
    """Mean |engine - trainer| logprob of a few freshly generated tokens (the push's end-to-end check)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(engine.llm_kwargs["model"]).vocab_size
    prompts = common.random_prompts(4, 32, vocab, seed=1)
    out = engine.generate(prompts, rollout.SamplingConfig(n=1), 16, seed=0)
    samples = [
        actor.Sample(prompts[s.prompt_index], s.response_ids, s.logprobs, "length", i)
        for i, s in enumerate(out)
    ]
    check = actor.PushCheck(device)
    actor.compute_logprobs(policy, samples, actor.ActorConfig(), actor.Layout(True, 0, device), 1.0, check)
    return check.result(tol=float("inf"), step=0)["rollout/logprob_diff_mean"]


def main(args: argparse.Namespace) -> dict:
    d = fsdp.init_distributed()
    work = args.workdir or tempfile.mkdtemp(prefix="flatrl-bench-")
    sizes = common.per_size(args.sizes, lambda size: bench_size(size, args, d, work))
    result = {
        "bench": "push",
        "sizes": sizes,
        "settings": {"repeats": args.repeats, "gpu_memory_utilization": args.gpu_memory_utilization},
        "targets": {"1.5b level2 cycle_median_s": 0.3},
        "hardware": common.hardware(),
    }
    return common.emit(result, args.out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.5b,1.5b", help="comma-separated: toy, 0.5b, 1.5b")
    p.add_argument("--toy", action="store_true", help="CPU smoke run on the toy model")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--levels", default="2,1", help="sleep levels to time the cycle with")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=rollout.RolloutConfig.gpu_memory_utilization
    )
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.toy:
        args.sizes, args.repeats, args.max_model_len = "toy", 2, 64
    return args


if __name__ == "__main__":
    main(parse())
