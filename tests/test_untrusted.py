"""Untrusted files and text never run code: an AST scan of every .py file in the repository, and the defaults.

The scan fails on `eval(` / `exec(`, `torch.load` without `weights_only=True`, `shell=True`, `os.system` /
`os.popen`, `pickle.load(s)`, `yaml.load` / `unsafe_load` / `full_load`, and `trust_remote_code` set to True
(a dataclass or function default, an assignment, or a call argument). torch.distributed.checkpoint unpickles
inside torch, out of the scan's sight, so DCP reads must go through checkpoint.dcp_load / read_dcp_metadata:
the scan fails on torch's `FileSystemReader(...)` (its read_metadata is a plain pickle.load), on `dcp.load` /
`dcp.load_state_dict` without both `storage_reader=` and `planner=` (the default planner unpickles non-tensor
values with weights_only=False). A line marked
`# unsafe on purpose` is reported apart; only tests/test_hostile_checkpoint.py may have one (it shows its
payloads are live). The hostile checkpoints themselves are in tests/test_hostile_checkpoint.py. Hostile countdown answers are in
tests/test_reward.py (test_countdown_hostile_strings).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNSAFE_CALLS = {
    "os.system", "os.popen", "pickle.load", "pickle.loads", "yaml.load", "yaml.unsafe_load", "yaml.full_load",
}  # fmt: skip
DCP_LOADS = {
    "dcp.load",
    "dcp.load_state_dict",
    "torch.distributed.checkpoint.load",
    "torch.distributed.checkpoint.load_state_dict",
}
ON_PURPOSE = "# unsafe on purpose"


def _dotted(node: ast.expr) -> str:
    """`a.b.c` for a Name/Attribute chain, "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_code(source: str, filename: str) -> tuple[list[str], int]:
    """(findings as "file:line: what", number of torch.load calls seen) for one Python source."""
    found, loads = [], 0
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if ON_PURPOSE in (lines[node.lineno - 1] if hasattr(node, "lineno") else ""):
            where += " (on purpose)"
        if isinstance(node, ast.Call):
            name, kw = _dotted(node.func), {k.arg: k.value for k in node.keywords}
            if name in ("eval", "exec"):
                found.append(f"{where}: {name}()")
            if name in UNSAFE_CALLS:
                found.append(f"{where}: {name}()")
            if name == "torch.load":
                loads += 1
                if not _is_true(kw.get("weights_only")):
                    found.append(f"{where}: torch.load without weights_only=True")
            if name.split(".")[-1] == "FileSystemReader":
                found.append(
                    f"{where}: torch's FileSystemReader (use checkpoint.dcp_load / read_dcp_metadata)"
                )
            if name in DCP_LOADS and not ("storage_reader" in kw and "planner" in kw):
                found.append(
                    f"{where}: {name} without storage_reader= and planner= (use checkpoint.dcp_load)"
                )
            if "shell" in kw and not (isinstance(kw["shell"], ast.Constant) and kw["shell"].value is False):
                found.append(f"{where}: shell=")
            if _is_true(kw.get("trust_remote_code")):
                found.append(f"{where}: trust_remote_code=True")
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            names = {t.id if isinstance(t, ast.Name) else getattr(t, "attr", "") for t in targets}
            if "trust_remote_code" in names and _is_true(node.value):
                found.append(f"{where}: trust_remote_code defaults to True")
        elif isinstance(node, ast.arguments):
            args = node.posonlyargs + node.args
            pairs = list(zip(args[len(args) - len(node.defaults) :], node.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True) if d is not None]
            for a, d in pairs:
                if a.arg == "trust_remote_code" and _is_true(d):
                    found.append(f"{filename}:{a.lineno}: trust_remote_code defaults to True")
    return found, loads


def repo_python_files() -> list[Path]:
    """Every .py file of the repository, skipping hidden folders (.venv, .git), runs/ and checkpoints/."""
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [
            d for d in dirs if not d.startswith(".") and d not in ("runs", "checkpoints", "__pycache__")
        ]
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files)


def test_the_scanner_finds_each_pattern():
    hostile = """
import os, pickle, subprocess, torch, yaml
from dataclasses import dataclass

@dataclass
class ModelConfig:
    trust_remote_code: bool = True

def load(path, trust_remote_code=True, *, mmap=False):
    eval("1 + 1")
    exec("x = 1")
    torch.load(path)
    torch.load(path, weights_only=False)
    torch.load(path, weights_only=True)
    subprocess.run("ls", shell=True)
    os.system("ls")
    pickle.loads(b"")
    yaml.load("a: 1")
    AutoModel.from_pretrained(path, trust_remote_code=True)
    model.eval()
    spec.loader.exec_module(module)
    yaml.safe_load("a: 1")
    subprocess.run(["ls"], shell=False)
    dcp.FileSystemReader(path).read_metadata()
    dcp.load(sd, checkpoint_id=path)
    dcp.load(sd, storage_reader=checkpoint.SafeFileSystemReader(path))
    torch.distributed.checkpoint.load_state_dict(sd, storage_reader=reader)
    dcp.load(sd, storage_reader=reader, planner=planner)
    pickle.loads(b"")  # unsafe on purpose: a test shows its payload is live
"""
    found, loads = unsafe_code(hostile, "hostile.py")
    lines = sorted(int(f.split(":")[1].split()[0]) for f in found)
    assert loads == 3
    # 16 findings; line 14 (weights_only=True), lines 20-23, and the dcp.load with both a storage_reader and a
    # planner (line 28) are safe; line 29 is found, but marked as deliberate
    assert lines == [7, 9, 10, 11, 12, 13, 15, 16, 17, 18, 19, 24, 25, 26, 27, 29], found
    assert [f for f in found if "(on purpose)" in f] == ["hostile.py:29 (on purpose): pickle.loads()"]


def test_repository_has_no_unsafe_code():
    files = repo_python_files()
    names = {f.relative_to(ROOT).as_posix() for f in files}
    assert {"sft.py", "grpo.py", "fsdp.py", "checkpoint.py", "reward.py", "shard_merge.py"} <= names
    assert "tests/test_faults.py" in names
    found, loads = [], 0
    for f in files:
        fnd, n = unsafe_code(f.read_text(), str(f.relative_to(ROOT)))
        found += fnd
        loads += n
    deliberate = [f for f in found if "(on purpose)" in f]
    assert [f for f in found if f not in deliberate] == []
    # the hostile-checkpoint test unpickles its own payloads to show they are live; nothing else may
    assert deliberate and all(f.startswith("tests/test_hostile_checkpoint.py:") for f in deliberate), (
        deliberate
    )
    # checkpoint.py (rng states), shard_merge.py (verl shards), a test: all weights_only=True
    assert loads >= 3


def test_defaults_run_no_foreign_code():
    import actor
    import scoring
    import sft

    assert sft.SFTModelConfig().trust_remote_code is False and actor.ModelConfig().trust_remote_code is False
    assert scoring.RewardConfig().path is None  # custom reward code only from a path the user names
