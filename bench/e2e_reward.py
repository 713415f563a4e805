"""bench_e2e.py's reward: a cheap deterministic 0/1 function of the response text (random models write noise,
so any fixed rule gives groups with both scores: GRPO has a signal and nothing is skipped). The same rule for
flatrl (verl's signature) and TRL (its batch signature)."""


def score(text: str) -> float:
    """1.0 when the character codes of the first 64 characters sum to an odd number, else 0.0."""
    return float(sum(map(ord, text[:64])) % 2)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """flatrl / verl custom reward function."""
    return score(solution_str)


def trl_reward(completions: list, **kwargs) -> list[float]:
    """TRL reward function: one float per completion (strings, or chat messages)."""
    return [score(c if isinstance(c, str) else c[-1]["content"]) for c in completions]
