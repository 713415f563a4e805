"""Two ranks, one of which dies or hangs while the other waits in a collective (tests/test_faults.py).

    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P python tests/dead_rank.py MODE TIMEOUT_S

Both ranks join with `fsdp.init_distributed(timeout_s)` and build the 1-D device mesh `fsdp.shard_model` builds.
Then rank 1 exits (MODE=die) or sleeps without joining (MODE=hang), and rank 0 all-reduces on the mesh's group
(the group FSDP's collectives use). Rank 0 prints `waited S s: ERROR` and exits 1 when the collective fails,
or prints `no error` and exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fsdp  # noqa: E402

mode, timeout_s = sys.argv[1], float(sys.argv[2])
d = fsdp.init_distributed(timeout_s=timeout_s)
mesh = dist.device_mesh.init_device_mesh("cpu", (d.world_size,))
print(f"rank {d.rank}: mesh group is the default group: {mesh.get_group() is dist.group.WORLD}", flush=True)
dist.barrier()  # both ranks are up
if d.rank == 1:
    if mode == "die":
        os._exit(3)
    time.sleep(3600)
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=mesh.get_group())
except Exception as e:  # what a trainer sees: an error it can exit with
    print(f"waited {time.monotonic() - start:.2f} s: {type(e).__name__}: {str(e)[:200]}", flush=True)
    os._exit(1)
print("no error", flush=True)
os._exit(0)
