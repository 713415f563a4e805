"""torchrun worker for tests/test_rollout.py: one external_launcher vLLM engine per rank, then a clean exit.

    python -m torch.distributed.run --nproc_per_node 2 tests/rollout_worker.py MODEL_DIR RESULT_JSON

Each rank samples the same prompts (seed + rank: the ranks must differ), pushes the same perturbed weights,
checks greedy logprobs against transformers' teacher-forced ones, then `shutdown()` + `destroy_process_group()`.
Rank 0 writes {"samples_differ", "stale_err", "logprob_err"} (errors are maxima over both ranks).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from test_rollout import MAX_LEN, PROMPTS, load_hf, max_logprob_err, perturb

import fsdp  # the repo root is on PYTHONPATH (the test sets it); tests/ is this script's own folder
import rollout


def main(model_dir: str, result: str) -> None:
    d = fsdp.init_distributed(timeout_s=120)
    cfg = rollout.RolloutConfig(
        gpu_memory_utilization=0.1, enforce_eager=True, max_num_seqs=16, timeout_s=240
    )
    engine = rollout.make_engine(cfg, model_dir, MAX_LEN, rank=d.rank, world_size=d.world_size)
    sampled = engine.generate(PROMPTS, rollout.SamplingConfig(n=2), max_tokens=8)
    gathered: list = [None] * d.world_size
    dist.all_gather_object(gathered, [s.response_ids for s in sampled])

    model = load_hf(Path(model_dir))
    perturb(model, seed=1)  # the same noise on every rank
    greedy = rollout.SamplingConfig(n=1, temperature=0.0, do_sample=False)
    stale_err = max_logprob_err(model, engine.generate(PROMPTS, greedy, 16), PROMPTS)
    engine.push_weights(fsdp.iter_full_params(model))
    err = max_logprob_err(model, engine.generate(PROMPTS, greedy, 16), PROMPTS)
    stale_err, err = fsdp.all_reduce(stale_err, "min"), fsdp.all_reduce(err, "max")
    if d.is_main:
        out = {"samples_differ": gathered[0] != gathered[1], "stale_err": stale_err, "logprob_err": err}
        Path(result).write_text(json.dumps(out))
    engine.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
