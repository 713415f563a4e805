"""Countdown reward that is the accuracy: 1.0 for a correct equation, 0.0 for anything else.

reward.countdown_score gives a well-formed wrong answer 0.1 (TinyZero's format score), so its mean is not the share
of problems solved. With this file as the reward (`--custom_reward_function.path scripts/countdown_accuracy.py`),
`val/reward/mean` is the greedy accuracy that scripts/repro.sh reports. The check itself is countdown_score's.
"""

import reward


def compute_score(
    data_source: str, solution_str: str, ground_truth: dict, extra_info: dict | None = None
) -> float:
    """verl's custom-reward signature; 1.0 iff the last `<answer>` equation uses each number once and hits the target."""
    if not data_source.startswith("countdown"):
        raise ValueError(f"countdown_accuracy scores countdown rows only, got data_source {data_source!r}")
    return reward.countdown_score(solution_str, ground_truth, format_score=0.0)
