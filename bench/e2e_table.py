"""The issue-21 table from bench_e2e.py's JSON files: one row per framework of each file, side by side.

    python3 bench/e2e_table.py bench/results/e2e_0.5b_defaults_f7812f0.json $OUT/e2e_verl_0.5b.json ...

Columns: the step (median after the first), samples an hour, peak device memory used (sampled over the steps
where the run has it), generation and the rest of the step, and flatrl's ratios against each peer of the same file.
A framework that was skipped or failed gets its reason instead of figures; one taken from an earlier file
(--flatrl-from, --peers-from) names that file's commit. Generation is each framework's own phase: flatrl's and
verl's `gen`, TRL's `vLLM.generate` (TRL times no trainer phase of its own that covers the update, so "rest" is
the step less generation for all three). With `--async-steps 1` flatrl's generation runs beside the update, and
the column holds its exposed part: `gen` plus `gen_wait`, the time the step waited for it. Where the file has bare
vLLM's generation of one step (bench_e2e.py --bare-vllm), a last row gives it, flatrl's generation against it, flatrl's
engine.generate alone on that engine where the file has it, and its share of each framework's step. Below the
table, for each file whose flatrl run has them (since edec20c): the device memory outside torch's allocator at
each phase's end, and the `memory at ...` lines of grpo.py's set-up with vLLM's own memory lines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GEN = {"flatrl": "gen", "trl": "vLLM.generate", "verl": "gen"}


def used(r: dict) -> float | None:
    return r.get("peak_device_used_sampled_gib") or r.get("peak_device_used_gib")


def fmt(x: float | None, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def rows(path: str) -> list[list[str]]:
    """The table's rows for one bench_e2e result file."""
    d = json.loads(Path(path).read_text())
    commit = d.get("hardware", {}).get("commit")
    gpu = d.get("hardware", {}).get("gpu")
    label = f"{Path(path).stem} ({d.get('model')}, {commit}, {gpu})"
    out = []
    for name in ("flatrl", "trl", "verl"):
        r = d.get(name)
        if not isinstance(r, dict):
            continue
        if "step_s" not in r:
            why = r.get("skipped") or r.get("error") or r.get("running") or "no step"
            if name != "flatrl" and str(why).startswith("not in --peers"):
                continue
            out.append([label, name, f"no step: {str(why).splitlines()[0][:120]}"] + [""] * 6)
            continue
        phases = r.get("phases_s", {})
        gen = phases.get(GEN[name])
        if gen is not None and "gen_wait" in phases:  # async: the generation that the step waited for
            gen += phases["gen_wait"]
        src = f" (from {r['from_commit']})" if r.get("from_file") else ""
        ratio = ""
        if name != "flatrl":
            mine = d.get("flatrl", {})
            if mine.get("step_s"):
                ratio = f"step {mine['step_s'] / r['step_s']:.3f}"
                if used(mine) and used(r):
                    ratio += f", memory {used(mine) / used(r):.3f}"
        out.append(
            [
                label,
                name + src,
                fmt(r["step_s"]),
                fmt(r.get("samples_per_hour", 0) / 1000, 1) + "k",
                fmt(used(r)),
                fmt(gen),
                fmt(r["step_s"] - gen if gen is not None else None),
                fmt(r.get("mfu"), 3),
                ratio,
            ]
        )
    bare = d.get("bare_vllm")
    if isinstance(bare, dict) and bare.get("gen_s"):  # the floor of every generation phase of this file's run
        q = d.get("ratios") or {}
        shares = [
            f"{q[k]:.3f} of {who}'s step"
            for k, who in (("bare_vllm_share_of_flatrl_step", "flatrl"), ("bare_vllm_share_of_trl_step", "TRL"),
                           ("bare_vllm_share_of_verl_step", "verl"))
            if q.get(k)
        ]  # fmt: skip
        if q.get("flatrl_gen_vs_bare_vllm"):
            shares.insert(0, f"flatrl's generation {q['flatrl_gen_vs_bare_vllm']:.3f}x")
        if bare.get("flatrl_generate_s"):  # flatrl's engine.generate on that engine, outside the trainer
            alone = f"flatrl's engine.generate alone {bare['flatrl_generate_s']:.2f} s"
            if bare.get("flatrl_generate_check2_s"):  # the push check on 2 prompts
                alone += f" ({bare['flatrl_generate_check2_s']:.2f} s checking 2 prompts)"
            if bare.get("flatrl_generate_woken_s"):  # on an engine slept and woken just before
                alone += f", {bare['flatrl_generate_woken_s']:.2f} s on a woken engine"
            if bare.get("bare_lp_check_s"):  # bare vLLM asking the check's logprobs
                alone += f", bare vLLM asking the check's logprobs {bare['bare_lp_check_s']:.2f} s"
            if bare.get("bare_probe_check_s"):  # bare vLLM with the check on short probe requests
                alone += f", with the check on short probes {bare['bare_probe_check_s']:.2f} s"
            shares.insert(1, alone)
        if len(bare.get("gen_s_each") or []) == 2:  # the interleaved calls: the mean and each call
            a, b = bare["gen_s_each"]
            shares.insert(1, f"bare calls {a:.2f} / {b:.2f} s (first / last)")
        src = f" (from {bare['from_file']})" if bare.get("from_file") else ""
        out.append(
            [
                label,
                "bare vLLM, generation only" + src,
                "",
                "",
                "",
                fmt(bare["gen_s"]),
                "",
                "",
                "; ".join(shares),
            ]
        )
    return out


def table(paths: list[str]) -> str:
    head = ["run", "framework", "step (s)", "samples/h", "peak used (GiB)", "gen (s)", "rest (s)", "MFU",
            "flatrl / this"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in paths:
        lines += ["| " + " | ".join(r) + " |" for r in rows(p)]
    return "\n".join(lines)


def memory_notes(paths: list[str]) -> str:
    """Where each file's flatrl run kept its device memory outside torch's allocator (bench_e2e's
    outside_torch_by_phase_gib, memory_log), its generation and update phases in parts (gen_parts_s, update_parts_s),
    and each step's vLLM call beside the host's speed and the device's busy share then (host_loop_ms_gen_each,
    gpu_busy_pct_gen_each, since 864d4e1's lease) and when the steps' peak device memory was sampled
    (peak_device_used_where), one block a file; empty when none has them."""
    blocks = []
    for p in paths:
        f = json.loads(Path(p).read_text()).get("flatrl") or {}
        outside, log = f.get("outside_torch_by_phase_gib") or {}, f.get("memory_log") or []
        parts = f.get("gen_parts_s") or {}
        if not (outside or log or parts or f.get("update_parts_s")):
            continue
        lines = [f"{Path(p).stem}, flatrl:"]
        if parts:  # what the phase holds beyond vLLM's own call
            gen = (f.get("phases_s") or {}).get("gen", 0.0)
            lines.append(
                f"  generation phase {gen:.2f} s, its generate() calls in parts (s): "
                + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
            )
        # actor.update's split: a host-bound update shows as seconds per micro-batch that do not shrink with its tokens
        if up := f.get("update_parts_s"):
            n, mb_s = up.get("micro_batch_count", 0), up.get("micro_batches_s", 0.0)
            lines.append(
                f"  update phase {(f.get('phases_s') or {}).get('update', 0.0):.2f} s: {n:.0f} micro-batches "
                f"{mb_s:.2f} s ({mb_s / max(n, 1):.3f} s each), optimizer step {up.get('optimizer_step_s', 0.0):.2f} s"
            )
        each = f.get("gen_call_each", {}).get("engine") or []
        host, busy = f.get("host_loop_ms_gen_each") or [], f.get("gpu_busy_pct_gen_each") or []
        # each step's vLLM call beside the host's speed (a fixed loop's ms, another process) and the device's busy %
        if each and (host or busy):
            cell = lambda v, unit: "-" if v is None else f"{v:.1f} {unit}"  # noqa: E731
            lines.append(
                "  each step's vLLM call, the host's loop and the device's busy share meanwhile: "
                + ", ".join(
                    f"{e:.2f} s / {cell(h, 'ms')} / {cell(b, '%')}"
                    for e, h, b in zip(
                        each, host or [None] * len(each), busy or [None] * len(each), strict=False
                    )
                )
            )
        if where := f.get("peak_device_used_where"):  # bench_e2e.peak_where: when the steps' peak was sampled
            lines.append(
                f"  the steps' largest device-used sample: {where['gib']:.2f} GiB in step {where['step']}, "
                f"{where['s_into_step']:.2f} s in, phase {where['phase']} (after {where['after']})"
            )
        if outside:  # negative where the sleeping engine's released pool still counts in torch's reserved
            lines.append(
                "  outside torch's allocator at each phase's end (GiB): "
                + ", ".join(f"{k} {v:.2f}" for k, v in outside.items())
            )
        lines += [f"  {line}" for line in log]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) < 2:
        sys.exit("usage: python3 bench/e2e_table.py E2E_JSON... (--help: what the columns are)")
    print(table(sys.argv[1:]))
    if notes := memory_notes(sys.argv[1:]):
        print("\n" + notes)
