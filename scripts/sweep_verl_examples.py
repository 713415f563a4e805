"""Feeds every command line of verl's example scripts to flatrl's --print-config, and counts what loads.

    git clone https://github.com/volcengine/verl /tmp/verl   # any checkout; no verl install needed
    python scripts/sweep_verl_examples.py /tmp/verl [--out sweep.json]

Each `examples/**/*.sh` runs under bash with `python`, `python3`, `torchrun` and `ray` replaced by a stand-in that
records its arguments and exits 0, so nothing of verl runs. A recorded line that names a verl trainer module goes to
flatrl's script for it (main_ppo: grpo.py, or ppo.py with algorithm.adv_estimator=gae; an SFT trainer: sft.py;
generation and evaluation entry points are skipped) with `--print-config`. Prints the count that loaded and the
failures grouped by their one-line error (docs/VERL.md, "Sweeping verl's examples", has the last run).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@flatrl-sweep@@"
STAND_IN = f"""#!/bin/bash
# a recorded command line: its words NUL-separated, then the mark
if printf '%s\\n' "$@" | grep -q 'verl[./]trainer\\|main_ppo\\|sft_trainer'; then
  {{ printf '%s\\0' "$@"; printf '{MARK}\\n'; }} >> "$SWEEP_OUT"
fi
exit 0
"""


def record(verl: Path, work: Path) -> list[tuple[str, list[str]]]:
    """(script, argv) for every verl entry point the example scripts call."""
    bin_dir = work / "bin"
    bin_dir.mkdir()
    (bin_dir / "stand_in").write_text(STAND_IN)
    (bin_dir / "stand_in").chmod(0o755)
    for name in ("python", "python3", "torchrun", "ray"):
        (bin_dir / name).symlink_to("stand_in")
    calls = []
    for script in sorted((verl / "examples").rglob("*.sh")):
        out = work / "calls"
        out.unlink(missing_ok=True)
        env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "SWEEP_OUT": str(out),
        }
        try:  # some scripts wait on a cluster after their call (a loop, a sleep): what they recorded counts
            subprocess.run(
                ["bash", str(script)],
                cwd=verl,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=10,
            )
        except subprocess.TimeoutExpired:
            pass
        if out.exists():
            for rec in out.read_bytes().split(f"{MARK}\n".encode()):
                argv = [a.decode() for a in rec.split(b"\0") if a]
                if argv:
                    calls.append((str(script.relative_to(verl)), argv))
    return calls


def flatrl_script(argv: list[str]) -> tuple[str, list[str]] | None:
    """flatrl's script for a recorded verl call and the arguments after the module, or None (not a trainer)."""
    for i, word in enumerate(argv):
        if "verl.trainer" in word or "verl/trainer" in word or "main_ppo" in word or "sft_trainer" in word:
            rest = argv[i + 1 :]
            if "generation" in word or "eval" in word:
                return None
            if "sft" in word:
                return "sft.py", rest
            return ("ppo.py" if "algorithm.adv_estimator=gae" in rest else "grpo.py"), rest
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("verl", type=Path, help="a verl checkout (its examples/ folder is read)")
    ap.add_argument("--out", type=Path, help="every call with its return code and stderr, as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        calls = record(args.verl.resolve(), Path(tmp))
    jobs = [(src, *m) for src, argv in calls if (m := flatrl_script(argv))]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")} | {"OMP_NUM_THREADS": "1"}

    def check(job: tuple[str, str, list[str]]) -> dict:
        src, script, rest = job
        p = subprocess.run(
            [sys.executable, str(ROOT / script), *rest, "--print-config"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        return {"example": src, "script": script, "args": rest, "rc": p.returncode, "stderr": p.stderr}

    results = list(ThreadPoolExecutor(2).map(check, jobs))
    failures = collections.defaultdict(list)
    for r in results:
        if r["rc"] != 0:
            lines = r["stderr"].strip().splitlines()
            failures[lines[-1][:240] if lines else f"exit {r['rc']}"].append(r["example"])
    print(f"{len(results) - sum(map(len, failures.values()))} of {len(results)} command lines loaded "
          f"({len(calls)} calls recorded)")  # fmt: skip
    for error, examples in sorted(failures.items(), key=lambda kv: -len(kv[1])):
        print(f"\n[{len(examples)}] {error}\n    " + "\n    ".join(examples[:3]))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
