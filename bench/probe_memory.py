"""Where the device memory outside torch's allocator comes from: the set-up of a grpo.py process, one piece at a
time, with the device's used memory, torch's reserved and allocated memory, and their difference after each.

Every flatrl run held 4.3-4.4 GiB of the device outside torch's reserved memory at its generation's end (135M,
0.5B, 1.5B), and grpo.py's own ledger (perf.device_ledger) put 1.7-1.8 GiB of it at the process group's start and
the other 2.5 GiB at the engine's start (0.5B, H100, 71b1a5f; the process group was then bound to the device, so
vLLM's own groups started NCCL at once). This splits both:

    cuda context        torch.cuda's context on this process's device (and the driver's share of the device)
    process group       fsdp.init_distributed, as the trainer calls it (gloo at one rank since 428ed92's ledger
                        put NCCL's communicator at 0.55 GiB; NCCL at several ranks, lazy: each group's
                        communicator starts at its first collective; --bind-device: NCCL, eager, every later
                        group's too)
    first all_reduce    a collective on the default group (on fsdp.comm_device(), as flatrl's own are)
    second group        dist.new_group over every rank, one all_reduce on it (what each group costs: vLLM makes
                        several of its own beside the trainer's)
    bf16 matmul         a 4096 x 4096 bf16 matmul (cuBLAS handles and their workspace)
    import vllm         (the vllm engine)
    engine started      rollout.make_engine with grpo.py's defaults at --gpu-memory-utilization
    generated           one generate() call, n=8 for 8 prompts
    engine asleep       engine.sleep() (level 2)
    engine awake        engine.wake_up()

with the number of process groups this process holds after each. `--no-process-group` starts the engine
without a process group of the trainer's (as vLLM's own process would).

    python bench/probe_memory.py --model 0.5b --out $OUT/probe_memory.json       # GPU: ~1 min
    python bench/probe_memory.py --toy --out /tmp/probe.json                       # CPU (gloo, hf engine): s
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import common
import torch
import torch.distributed as dist

import fsdp
import rollout

GIB = 2**30


def process_groups() -> int:
    """How many process groups this process holds (the default one included), 0 before any."""
    if not dist.is_initialized():
        return 0
    return len(dist.distributed_c10d._world.pg_map)


def mark(marks: list[dict[str, Any]], name: str) -> None:
    """Appends the device's memory now (GiB; None without CUDA) and the process groups, and prints one line."""
    row: dict[str, Any] = {"mark": name, "process_groups": process_groups()}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used, reserved = (total - free) / GIB, torch.cuda.memory_reserved() / GIB
        row |= {
            "device_used_gib": round(used, 3),
            "reserved_gib": round(reserved, 3),
            "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
            "outside_torch_gib": round(used - reserved, 3),
        }
        if marks and "outside_torch_gib" in marks[-1]:
            added = row["outside_torch_gib"] - marks[-1]["outside_torch_gib"]
            row["outside_torch_added_gib"] = round(added, 3)
    marks.append(row)
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def main(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    path = common.build_model(args.model, Path(args.workdir) / args.model)
    marks: list[dict[str, Any]] = []
    torch.zeros(1, device=device)
    mark(marks, "cuda context")
    if args.process_group:
        run = fsdp.init_distributed(bind_device=args.bind_device)
        mark(marks, "process group")
        dist.all_reduce(torch.ones(1, device=fsdp.comm_device()))
        mark(marks, "first all_reduce")
        group = dist.new_group(list(range(run.world_size)))
        dist.all_reduce(torch.ones(1, device=fsdp.comm_device()), group=group)
        mark(marks, "second group")
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    del a
    mark(marks, "bf16 matmul")
    if args.engine == "vllm":
        import vllm  # noqa: F401  (its import alone: CUDA libraries it loads)

        mark(marks, "import vllm")
    cfg = rollout.RolloutConfig(
        name=args.engine, gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs
    )
    engine = rollout.make_engine(cfg, str(path), max_model_len=args.prompt_len + args.response_len)
    mark(marks, "engine started")
    from transformers import AutoConfig

    prompts = common.random_prompts(8, args.prompt_len, AutoConfig.from_pretrained(path).vocab_size)
    engine.generate(prompts, rollout.SamplingConfig(n=8, temperature=1.0), args.response_len, seed=0)
    mark(marks, "generated")
    engine.sleep()
    mark(marks, "engine asleep")
    engine.wake_up()
    mark(marks, "engine awake")
    engine.shutdown()
    backend = dist.get_backend() if args.process_group else None  # the trainer's group: gloo or nccl
    if dist.is_initialized():
        dist.destroy_process_group()
    return {
        "bench": "probe_memory",
        "model": args.model,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")}
        | {"backend": backend},
        "marks": marks,
        "hardware": common.hardware(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b", choices=["toy", "0.5b", "1.5b"])
    p.add_argument("--workdir", default="/tmp/flatrl-bench")
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="bench_e2e.py's share")
    p.add_argument("--max-num-seqs", type=int, default=rollout.RolloutConfig.max_num_seqs)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument(
        "--no-process-group", dest="process_group", action="store_false", help="no trainer's process group"
    )
    p.add_argument(
        "--bind-device",
        action="store_true",
        help="the process group bound to the device (init_process_group's device_id), grpo.py's before 2026-12-06: "
        "every group's NCCL communicator starts at once",
    )
    p.add_argument("--toy", action="store_true", help="CPU smoke run: the toy model, gloo, the hf engine")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.toy:
        args.model, args.engine, args.prompt_len, args.response_len = "toy", "hf", 8, 8
    return args


if __name__ == "__main__":
    a = parse_args()
    common.emit(main(a), a.out)
