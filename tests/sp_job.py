"""torchrun job of tests/test_sp.py: GRPO's policy update and PPO's critic update on fixed samples, under a given
Ulysses degree. `python sp_job.py MODEL SP OUT.json [fused]`; rank 0 writes the metrics (one step each) to OUT.json;
`fused` runs the policy with model.use_fused_kernels.

The samples do not depend on the SP degree: 8 prompts x 2 responses, one of them longer than a rank's share of
its micro-batch; each rank builds the same global list and keeps its own prompts' samples (as rl.py's sampling
does: the ranks of an SP group then pool theirs, sp.share_samples), so SP=1 and SP=2 on W ranks train on the
same global batch.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import actor  # noqa: E402
import data  # noqa: E402
import fsdp  # noqa: E402
import grpo  # noqa: E402
import losses  # noqa: E402
import optim  # noqa: E402
import ppo  # noqa: E402
import rl  # noqa: E402


def global_samples() -> list[actor.Sample]:
    """16 samples of 8 prompts; the last response is 150 tokens (prompt + response 160)."""
    rng = random.Random(0)
    out = []
    for p in range(8):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(3, 10))]
        for k in range(2):
            n = 150 if (p, k) == (7, 1) else rng.randrange(2, 12)
            adv = rng.uniform(-1, 1)
            out.append(
                actor.Sample(
                    prompt, [rng.randrange(3, 60) for _ in range(n)], None, "stop", p, advantages=adv
                )
            )
    return out


def main() -> None:
    model_path, sp_size, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    fused = sys.argv[4:] == ["fused"]  # the policy with model.use_fused_kernels (the critic has no LM head)
    d = fsdp.init_distributed(300)
    torch.manual_seed(0)
    n_prompts = 8 // d.world_size  # each rank generates for its own prompts (rl.py), SP or not
    samples = [s for s in global_samples() if s.group // n_prompts == d.rank]
    for s in samples:
        s.group -= d.rank * n_prompts
    fs = fsdp.FSDPConfig(ulysses_sequence_parallel_size=sp_size)
    model_cfg = actor.ModelConfig(path=model_path, fsdp_config=fs, use_fused_kernels=fused)
    layout = actor.Layout(True, 0, d.device)
    # the largest forward any rank ran, in tokens: under SP no rank holds the 160-token sequence whole
    seen = [0]
    cfg = grpo.GRPOConfig(
        data=rl.RLDataConfig(max_response_length=150),
        actor=actor.ActorConfig(
            ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=3, old_logprobs_from_update=False
        ),
    )
    policy, _ = actor.load(model_cfg, d.device)
    policy.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    actor.compute_logprobs(policy, samples, cfg.actor, layout, 1.0)
    for s in samples:
        s.old_logprobs = s.old_logprobs - 0.05  # ratio != 1: the clip and its metrics are exercised
    opt, _ = optim.build(policy.parameters(), cfg.actor.optim, 1)
    loss_fn = lambda m, mb: grpo.policy_loss(m, mb, cfg, None)  # noqa: E731
    metrics = actor.update(policy, opt, optim.SkipGuard(3), samples, n_prompts, cfg.actor, layout, loss_fn)
    old_sum = fsdp.all_reduce(sum(float(s.old_logprobs.sum()) for s in samples))

    pcfg = ppo.PPOConfig(data=cfg.data, critic=ppo.CriticConfig(model=model_cfg, ppo_mini_batch_size=8))
    critic, _ = actor.load(model_cfg, d.device, value_head=True)
    ppo.compute_values(critic, samples, pcfg.critic, layout)
    for s in samples:
        s.returns = torch.linspace(-1, 1, len(s.response_ids))
    copt, _ = optim.build(critic.parameters(), pcfg.critic.optim, 1)
    closs = lambda m, mb: ppo.value_loss(m, mb, pcfg)  # noqa: E731
    metrics |= actor.update(
        critic, copt, optim.SkipGuard(3), samples, n_prompts, pcfg.critic, layout, closs, prefix="critic/"
    )
    values_sum = fsdp.all_reduce(sum(float(s.values.sum()) for s in samples))
    metrics |= {
        "old_logprobs_sum": old_sum,
        "values_sum": values_sum,
        "max_tokens": fsdp.all_reduce(max(seen), "max"),
        "fused_head": bool(getattr(policy, losses.FUSED_HEAD, False)),
    }
    if sp_size > 1:  # a forward that bypasses sp.py on whole sequences is refused, not run on mixed batches
        whole = data.pack_batch([[5, 6, 7]], [[0, 1, 1]], mask_dtype=None)
        try:
            policy(**data.model_inputs({k: v.to(d.device) for k, v in whole.items()}))
        except ValueError as e:
            metrics["direct_call_refused"] = "sp.forward_logprobs" in str(e)
    if d.is_main:
        with open(out_path, "w") as f:
            json.dump(metrics, f)
    fsdp.close_distributed(finished=True)


if __name__ == "__main__":
    main()
