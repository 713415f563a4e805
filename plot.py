"""plot.py: learning curves and time per phase of one or more runs, as small PNGs, from their metrics.jsonl.

    python plot.py RUN [RUN...] [--out DIR]

RUN is a run folder (trainer.default_local_dir) or its metrics.jsonl. Several runs overlay, one colour per run,
labelled with their folder names (the shortest path suffix that tells them apart). DIR defaults to RUN/plots for
one run and to ./plots for several. Each figure has a fixed file name and is written only when some run logged
one of its metrics (a figure with nothing to show is skipped, not an error):

    reward.png            reward/mean (line) and val/reward/mean (dashed, dots)
    kl.png                actor/kl_loss, actor/reward_kl_penalty, actor/ppo_kl: whichever were logged
    entropy.png           actor/entropy
    response_length.png   response_length/mean
    clipfrac.png          actor/pg_clipfrac
    loss.png              SFT: train/loss and val/loss
    timing.png            one stacked bar per run: mean seconds per step of every timing_s/<phase>

Reading follows log.read_metrics: null (NaN/inf) points are left out, and a step logged twice (a resumed run)
keeps its last line. `timing_s/step` wraps every phase but `val` (rl.finish_step validates after it), so the
bar stacks the phases inside a step, then "other" (step time the phases do not account for), then val.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

import log

# (file stem, y label, metrics). The order of the metrics sets their line styles: solid, dashed, dotted.
FIGURES = (
    ("reward", "reward", ("reward/mean", "val/reward/mean")),
    ("kl", "KL", ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")),
    ("entropy", "entropy (nats / token)", ("actor/entropy",)),
    ("response_length", "response tokens", ("response_length/mean",)),
    ("clipfrac", "share of tokens clipped", ("actor/pg_clipfrac",)),
    ("loss", "loss (nats / token)", ("train/loss", "val/loss")),
)
LINE_STYLES = ("-", "--", ":")
FIGSIZE_IN, DPI = (4.8, 3.2), 100  # 480 x 320 pixels: small enough to commit under docs/


@dataclass(frozen=True)
class PlotConfig:
    """Which runs to draw and where the PNGs go."""

    runs: Annotated[list[str], tyro.conf.Positional]
    """Run folders (or their metrics.jsonl files)."""
    out: str | None = None
    """Output folder; default RUN/plots for one run, ./plots for several."""


Series = dict[str, tuple[list[int], list[float]]]  # metric -> (steps, values)


def series(rows: list[dict]) -> Series:
    """Every metric of one run as (steps, values), in step order, without its null points.

    Args:
        rows: log.read_metrics output.
    Returns:
        {metric: ([step, ...], [value, ...])}; metrics in first-seen order.
    """
    out: Series = {}
    for r in rows:
        for k, v in r.items():
            if k != "step" and v is not None:
                steps, values = out.setdefault(k, ([], []))
                steps.append(r["step"])
                values.append(float(v))
    return out


def run_labels(paths: list[Path]) -> list[str]:
    """The shortest trailing part of each run's path that no other run shares (folder names when unique)."""
    parts = [p.resolve().parts for p in paths]
    for n in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-n:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]  # the same path twice


def run_folder(path: str | Path) -> Path:
    """The run folder of a run folder or of its metrics.jsonl."""
    path = Path(path)
    return path.parent if path.is_file() else path


def load_runs(paths: list[str]) -> dict[str, list[dict]]:
    """{label: log.read_metrics rows} for each run folder or metrics.jsonl path, labels from run_labels."""
    labels = run_labels([run_folder(p) for p in paths])
    return {label: log.read_metrics(p) for label, p in zip(labels, paths, strict=True)}


def _figure():
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    return fig, fig.subplots()


def _save(fig, path: Path) -> None:
    fig.savefig(path, format="png", metadata={"Software": None})  # no version stamp: same data, same bytes


def plot_curves(
    runs: dict[str, Series], stem: str, ylabel: str, metrics: tuple[str, ...], out: Path
) -> Path | None:
    """One figure of `metrics` against step for every run; None (nothing written) when no run logged any."""
    present = [(label, m) for label, s in runs.items() for m in metrics if m in s]
    if not present:
        return None
    fig, ax = _figure()
    colors = {label: f"C{i % 10}" for i, label in enumerate(runs)}
    for label, m in present:
        steps, values = runs[label][m]
        name = label if len({m for _, m in present}) == 1 else f"{label}: {m}"
        sparse = m.startswith("val/")  # validation runs every test_freq steps: dots show where it ran
        ax.plot(
            steps,
            values,
            LINE_STYLES[metrics.index(m)],
            color=colors[label],
            label=name,
            marker="o" if sparse else None,
            markersize=3,
            linewidth=1.2,
        )
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = out / f"{stem}.png"
    _save(fig, path)
    return path


def plot_timing(times: dict[str, dict[str, float]], out: Path) -> Path | None:
    """Stacked bars of mean seconds per step by phase, one per run (`times`: label -> log.phase_times)."""
    stacks = {label: stack_phases(t) for label, t in times.items() if t}
    if not stacks:
        return None
    seen = list(dict.fromkeys(p for s in stacks.values() for p in s))
    tail = ("step", "other", "val")  # whole-step time, then what the phases inside a step leave, then val
    phases = [p for p in seen if p not in tail] + [p for p in tail if p in seen]
    fig, ax = _figure()
    from matplotlib import colormaps

    palette = colormaps["tab20"]  # 20 distinct colours: ppo.py alone times 11 phases
    labels = list(stacks)
    bottom = [0.0] * len(labels)
    for i, phase in enumerate(phases):
        heights = [stacks[label].get(phase, 0.0) for label in labels]
        ax.bar(labels, heights, bottom=bottom, color=palette(i % 20), label=phase, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylabel("seconds / step (mean)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    path = out / "timing.png"
    _save(fig, path)
    return path


def stack_phases(times: dict[str, float]) -> dict[str, float]:
    """The bar's segments from log.phase_times: the phases inside a step, "other" (the rest of timing_s/step),
    then val (timed outside the step). A run that times only whole steps (sft.py) gets one "step" segment."""
    inner = {p: s for p, s in times.items() if p not in ("step", "val")}
    stack = dict(inner)
    if "step" in times:
        rest = times["step"] - sum(inner.values())
        if not inner:
            stack["step"] = times["step"]
        elif rest > 0:
            stack["other"] = rest
    if "val" in times:
        stack["val"] = times["val"]
    return stack


def main(cfg: PlotConfig) -> list[Path]:
    """Draws every figure that has data; returns the paths written."""
    if not cfg.runs:
        raise ValueError("give at least one run folder")
    rows = load_runs(cfg.runs)
    out = (
        Path(cfg.out) if cfg.out else (run_folder(cfg.runs[0]) / "plots" if len(rows) == 1 else Path("plots"))
    )
    out.mkdir(parents=True, exist_ok=True)
    curves = {label: series(r) for label, r in rows.items()}
    written = [plot_curves(curves, stem, ylabel, metrics, out) for stem, ylabel, metrics in FIGURES]
    written.append(plot_timing({label: log.phase_times(r) for label, r in rows.items()}, out))
    return [p for p in written if p is not None]


if __name__ == "__main__":
    for path in main(tyro.cli(PlotConfig)):
        print(path)
