"""sft.py with a slow checkpoint writer: a 1 s sleep after each DCP save (model/, then optim/).

    RANK=... python tests/sft_slow_save.py SFT_ARGS...

tests/test_faults.py starts it to SIGKILL a run while a checkpoint is half written, which at the toy model's
size otherwise takes a few milliseconds. Nothing else differs from `python sft.py`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch.distributed as dist  # noqa: E402

import checkpoint  # noqa: E402
import config  # noqa: E402
import sft  # noqa: E402

_save = checkpoint.dcp.save


def _slow_save(*args, **kwargs):
    out = _save(*args, **kwargs)
    time.sleep(1.0)
    return out


checkpoint.dcp.save = _slow_save
try:
    sft.main(config.parse(sft.SFTConfig))
finally:
    if dist.is_initialized():
        dist.destroy_process_group()
