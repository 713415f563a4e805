"""grpo.py's rollout rejection sampling (algorithm.rollout_rs) and the importance weights' batch normalisation
(algorithm.rollout_is_batch_normalize), verl 0.9's rollout_correction: the masks on hand-made log ratios, the
normaliser by hand, on one rank and over two gloo ranks."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

import actor
import grpo


def _keep(modes: str, threshold: str, rows: list[list[float]], lengths: list[int]) -> list[list[float]]:
    """rejection_mask's keep on the valid tokens of rows of log pi_trainer - log pi_engine (padding: 5.0,
    which must not count)."""
    R = max(len(r) for r in rows)
    log_ratio = torch.tensor([r + [5.0] * (R - len(r)) for r in rows], dtype=torch.float64)
    valid = actor.mask_of(lengths, torch.device("cpu"), R).double()
    keep, _ = grpo.rejection_mask(log_ratio, valid, grpo.rs_bounds(modes, threshold))
    return [row[:n].tolist() for row, n in zip(keep, lengths, strict=True)]


def test_token_k1_bounds_the_engine_over_trainer_ratio() -> None:
    """token_k1 with 0.8_1.5 keeps a token where pi_engine / pi_trainer lies in [0.8, 1.5]: 1.45 and 0.81 stay,
    1.55 and 0.79 go (the bounds are on the engine's ratio, so a sign slip keeps the wrong ones); `1.6` alone is
    [1/1.6, 1.6]."""
    ratios = [1.45, 1.55, 0.81, 0.79]
    row = [-math.log(q) for q in ratios]  # log pi_trainer - log pi_engine
    assert _keep("token_k1", "0.8_1.5", [row], [4]) == [[1.0, 0.0, 1.0, 0.0]]
    row = [-math.log(q) for q in (1.59, 1.61, 1 / 1.59, 1 / 1.61)]
    assert _keep("token_k1", 1.6, [row], [4]) == [[1.0, 0.0, 1.0, 0.0]]


def test_token_k2_and_k3_bound_the_divergence_from_above() -> None:
    """k2 = r^2 / 2 and k3 = exp(r) - 1 - r at 0.02: k2 keeps +-0.19 (0.01805) and drops +-0.21 (0.02205);
    k3 keeps 0.19 (0.01925) and -0.2 (0.01873) but drops 0.2 (0.02140): k3 is lopsided, k2 is not."""
    assert _keep("token_k2", "0.02", [[0.19, -0.19, 0.21, -0.21]], [4]) == [[1.0, 1.0, 0.0, 0.0]]
    assert _keep("token_k3", "0.02", [[0.19, -0.2, 0.2]], [3]) == [[1.0, 1.0, 0.0]]


def test_sequence_modes_drop_whole_responses() -> None:
    """seq_sum_k1 0.5_2: -sum r = 0.6 <= log 2 = 0.693 keeps, 0.72 drops, every token of it; seq_mean_k3 0.02
    keeps [0.25, 0] (mean k3 0.0170) where seq_sum_k3 drops it (0.0340); seq_max_k2 0.02 keeps a response whose
    largest |r| is 0.19 and drops one with 0.21. The padding (5.0) never counts."""
    rows, lengths = [[-0.3, -0.3], [-0.36, -0.36, 0.0]], [2, 3]
    assert _keep("seq_sum_k1", "0.5_2", rows, lengths) == [[1.0, 1.0], [0.0, 0.0, 0.0]]
    assert _keep("seq_mean_k3", "0.02", [[0.25, 0.0]], [2]) == [[1.0, 1.0]]
    assert _keep("seq_sum_k3", "0.02", [[0.25, 0.0]], [2]) == [[0.0, 0.0]]
    rows, lengths = [[0.0, 0.19, 0.0], [0.0, -0.21, 0.0], [0.1]], [3, 3, 1]
    assert _keep("seq_max_k2", "0.02", rows, lengths) == [[1.0] * 3, [0.0] * 3, [1.0]]


def test_modes_combine_every_one_must_keep() -> None:
    """verl's example rollout_rs=token_k1,seq_max_k2 with 0.6_1.6,2.5: a token out of token_k1's ratio bounds
    goes alone; a response with one token past seq_max_k2 (r = 2.3: k2 2.645 > 2.5, ratio 0.1 out too) goes
    whole; r = 0.4 (ratio 0.67, k2 0.08) keeps."""
    rows = [[0.0, 0.55, 0.4], [0.4, 2.3, 0.0]]  # ratio exp(-0.55) = 0.577 < 0.6
    assert _keep("token_k1,seq_max_k2", "0.6_1.6,2.5", rows, [3, 3]) == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "modes, threshold, needle",
    [
        ("token", "2.0", "algorithm.rollout_rs='token': token is not a mode; give one or more of token_k1,"),
        ("token_k1,seq_max_k1", "2.0", "seq_max_k1 is not a mode"),
        ("token_k2", None, "needs one bound for all its modes or one per mode (1)"),
        ("token_k1,token_k2", "1,2,3", "one per mode (2)"),
        ("token_k2", "0.5_2", "'0.5_2' is not a bound for token_k2; it takes one positive number"),
        ("token_k1", "0_2", "it takes 'lower_upper' or 'upper', positive ratios"),
    ],
)
def test_bad_modes_and_bounds_are_one_line_naming_the_key(modes, threshold, needle) -> None:
    with pytest.raises(ValueError) as e:
        grpo.AlgorithmConfig(rollout_rs=modes, rollout_rs_threshold=threshold)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def _samples(log_ratios: list[list[float]]) -> list[actor.Sample]:
    """Samples whose old logprobs less the engine's are these rows (one response each)."""
    out = []
    for k, row in enumerate(log_ratios):
        old = -torch.rand(len(row), generator=torch.Generator().manual_seed(k))
        rollout = (old - torch.tensor(row)).tolist()
        out.append(actor.Sample([1], [2] * len(row), rollout, "stop", k, old_logprobs=old))
    return out


def _algorithm(level: str, **kw) -> grpo.AlgorithmConfig:
    return grpo.AlgorithmConfig(
        rollout_is_threshold=2.0,
        rollout_is=True,
        rollout_is_level=level,
        rollout_is_batch_normalize=True,
        **kw,
    )


def test_token_level_batch_normalisation_makes_the_mean_weight_one() -> None:
    """Token weights min(ratio, 2) of 1.5, 2 (3 truncated), 0.5 and 1: their mean over the 4 tokens, 1.25, is the
    factor, and the weights divided by it average exactly 1 over the response tokens."""
    rows = [[math.log(1.5), math.log(3.0)], [math.log(0.5), 0.0]]
    mean, metrics = grpo.rollout_correction(_samples(rows), _algorithm("token"))
    assert abs(mean - 1.25) < 1e-6 and metrics["mismatch/rollout_is_batch_norm_factor"] == mean
    w = torch.tensor([[1.5, 2.0], [0.5, 1.0]])
    assert abs(float((w / mean).mean()) - 1.0) < 1e-6


def test_sequence_level_batch_normalisation_averages_responses_not_tokens() -> None:
    """Sequence weights 1.5 (1 token), 2 (3 truncated; 2 tokens) and 0.5 (3 tokens): the factor is their mean over
    the 3 responses, 4/3 (a token-weighted mean would be (1.5 + 4 + 1.5) / 6 = 7/6); the responses' weights divided
    by it average 1."""
    h = math.log(3.0) / 2
    rows = [[math.log(1.5)], [h, h], [math.log(0.5) / 3] * 3]
    mean, _ = grpo.rollout_correction(_samples(rows), _algorithm("sequence"))
    assert abs(mean - 4 / 3) < 1e-6
    assert abs(sum(w / mean for w in (1.5, 2.0, 0.5)) / 3 - 1.0) < 1e-6


def test_rejection_sets_loss_masks_and_logs_fractions() -> None:
    """rollout_rs without rollout_is: each sample's loss_mask is its keep row, loss_tokens counts the kept tokens,
    and the metrics are the fractions of response tokens and of responses dropped, each mode's too."""
    rows = [[0.0, 0.55, 0.4], [0.4, 2.3, 0.0], [0.0, 0.0]]
    samples = _samples(rows)
    alg = grpo.AlgorithmConfig(rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.6_1.6,2.5")
    mean, m = grpo.rollout_correction(samples, alg)
    assert mean == 1.0
    assert [s.loss_mask.tolist() for s in samples] == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0]]
    assert [s.loss_tokens for s in samples] == [2.0, 0.0, 2.0]
    assert abs(m["mismatch/rollout_rs_masked_fraction"] - 4 / 8) < 1e-9
    assert abs(m["mismatch/rollout_rs_seq_masked_fraction"] - 2 / 3) < 1e-9
    # token_k1 drops 0.55 and 2.3 (ratio 0.1); seq_max_k2 the second response
    assert abs(m["mismatch/rollout_rs_token_k1_masked_fraction"] - 2 / 8) < 1e-9
    assert abs(m["mismatch/rollout_rs_seq_max_k2_masked_fraction"] - 3 / 8) < 1e-9
    assert abs(m["mismatch/rollout_rs_seq_max_k2_seq_masked_fraction"] - 1 / 3) < 1e-9
    mb = actor.MicroBatch.of(samples, actor.Layout(False, 0, torch.device("cpu")))
    assert mb.mask.tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert mb.valid.sum() == 8 and mb.per_token("old_logprobs")[1].abs().sum() > 0  # values on every token


# ------------------------------------------------------------------------ 2 ranks (spawns processes)


def _rank_main(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks: rank 0 holds one token of weight 1.5, rank 1 three of 0.5."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = [[math.log(1.5)]] if rank == 0 else [[math.log(0.5)] * 3]
    mean, metrics = grpo.rollout_correction(_samples(rows), _algorithm("token"))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"mean": mean}))
    dist.destroy_process_group()


def test_batch_normalisation_uses_the_mean_over_all_ranks(tmp_path) -> None:
    """The factor is the token mean over both ranks, (1.5 + 3 x 0.5) / 4 = 0.75, on each: not rank 0's 1.5 nor
    rank 1's 0.5."""
    from conftest import free_port

    torch.multiprocessing.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=2)
    means = [json.loads((tmp_path / f"rank{r}.json").read_text())["mean"] for r in range(2)]
    assert all(abs(m - 0.75) < 1e-6 for m in means), means
