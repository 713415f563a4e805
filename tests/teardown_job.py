"""A trainer of a few lines, run through fsdp.run_main as sft.py is, that ends as MODE says.

    [RANK=... WORLD_SIZE=... MASTER_ADDR=... MASTER_PORT=...] python tests/teardown_job.py MODE

Every mode first does a DTensor op on a 1-D mesh of all ranks, as FSDP2 does each step, so that DTensor's caches
keep the mesh (and through it the process group) alive after main returns.
- ok: returns {"answer": 42.0}.
- inflight: also starts 200 all-reduces of tensors made in Python, drops them and returns without waiting: the
  process group's worker threads then hold the last reference to each tensor, and release it whenever they are
  done. This is the race a finished run hit at exit, held wide open: with a plain destroy_process_group a worker
  releases one after interpreter shutdown began, and the process aborts (SIGABRT) after a successful run.
- raise: raises ValueError("teardown_job: failed on purpose").
- exit143: raises SystemExit(143), as a trainer stopped by SIGTERM does.
tests/test_teardown.py runs it and reads the exit codes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402

import fsdp  # noqa: E402


def main(mode: str) -> dict[str, float]:
    d = fsdp.init_distributed(timeout_s=60)
    mesh = fsdp.device_mesh("cpu")
    x = distribute_tensor(torch.arange(4.0 * d.world_size), mesh, [Shard(0)])  # [4 * world], 4 per rank
    total = (x * 2).sum().full_tensor().item()  # sharding propagation caches the mesh
    assert total == 4 * d.world_size * (4 * d.world_size - 1), total
    if mode == "inflight":
        for _ in range(200):
            dist.all_reduce(torch.ones(1000), async_op=True)
    elif mode == "raise":
        raise ValueError("teardown_job: failed on purpose")
    elif mode == "exit143":
        raise SystemExit(143)
    return {"answer": 42.0}


if __name__ == "__main__":
    fsdp.run_main(main, sys.argv[1])
