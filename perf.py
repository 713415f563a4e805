"""Performance accounting shared by the RL scripts and bench/: FLOPs and MFU, per-phase memory, the memory plan.

FLOPs of a decoder-only transformer (Qwen2 / Llama layout), for one token trained (forward + backward):

    matmul_params = layers * (H*Dq + 2*H*Dkv + Dq*H + 3*H*I) + V*H      (q, k, v, o, gate/up/down, lm_head)
    train_flops_per_token = 6 * matmul_params                            (2 forward + 4 backward per weight)
    attention_train_flops = 6 * layers * Dq * sum_i L_i^2                (QK^T and AV, causal: half of L_i^2)

with H = hidden size, Dq = heads * head_dim, Dkv = kv_heads * head_dim, I = intermediate size, V = vocabulary,
L_i the length of sequence i. matmul_params is the "6 x params" of the issue for tied embeddings (the embedding
matrix is counted once, as the lm_head it also is; a lookup costs no FLOPs) and the non-embedding parameters
plus the lm_head otherwise. Biases and norms are left out (< 0.1%). Recomputation under gradient checkpointing
is not counted (this is model FLOPs, not hardware FLOPs), nor is a LoRA run's smaller backward.

    MFU = train FLOPs / seconds / PEAK_FLOPS      PEAK_FLOPS = 989e12 (H100/H200 SXM dense bf16)

always against 989 TFLOP/s, whatever the device, so numbers compare across machines (on CPU they are tiny).
`perf/mfu` (rl.finish_step) is the policy update's: 6 * matmul_params * the tokens it trained (prompt +
response, times ppo_epochs, all ranks) / its seconds / world size / PEAK_FLOPS; `perf/mfu_attn` adds the
attention term; `perf/update_tokens_per_s` is those tokens / seconds / world size.

`PhaseTimer` is log.Timer plus the CUDA memory of each phase: `perf/memory/<phase>_peak_allocated_gb` and
`_peak_reserved_gb` (the peak within the phase, nested phases included: the counters are reset at every phase
boundary and folded into each open phase) and `_device_used_gb` (total minus free at the phase's end, which
also sees memory outside torch's allocator: the CUDA context, NCCL, vLLM's non-torch buffers).

With `watch_gc` (rl.step_timer) it also gives the garbage collector's pauses per phase, `perf/gc/<phase>_s`, and
the step's full collections, `perf/gc/full_collections` (PhaseGC).

`plan(cfg)` is the memory preflight (`--trainer.plan`): per phase (gen, old_logprob, update, sync) the bytes of
the trainer's parameters, gradients, optimizer state, reference model, activations and logits, and the
engine's weights and KV cache, estimated from the model's config.json and the run's settings, next to the
device's memory, with the flags that lower the phase that does not fit. Its formulas are in `_plan_phases`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

import log

PEAK_FLOPS = 989e12
"""Dense bf16 tensor-core peak of an H100/H200 SXM (NVIDIA's datasheet figure without sparsity), FLOP/s."""
MATMUL_FLOPS_H200 = 787e12
"""What a bf16 8192^3 matmul reached on the lent H200 (bench/README.md, device baselines): the practical ceiling."""
GIB = 2**30


# --------------------------------------------------------------------------------------------- FLOPs


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that FLOPs and memory depend on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """From a Hugging Face config (Qwen2, Llama, Mistral layouts)."""
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            hidden=cfg.hidden_size,
            layers=cfg.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's linear maps: q, k, v, o and the gated MLP."""
        H, dq, dkv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return H * dq + 2 * H * dkv + dq * H + 3 * H * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token: every layer's plus the lm_head (V x H)."""
        return self.layers * self.layer_matmul_params + self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters, tied embeddings counted once (biases of q/k/v and the norms included)."""
        H, dq, dkv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.layer_matmul_params + dq + 2 * dkv + 2 * H  # + q/k/v biases, two norms
        embeddings = self.vocab * H * (1 if self.tied else 2)
        return self.layers * per_layer + H + embeddings


@functools.cache
def model_shape(path: str) -> ModelShape:
    """ModelShape of the model folder (or hub id) `path`, read from its config.json once per process."""
    from transformers import AutoConfig

    return ModelShape.from_config(AutoConfig.from_pretrained(os.path.expanduser(path)))


def lora_params(shape: ModelShape, model_cfg: Any) -> int:
    """The parameters a LoRA run trains: rank x (fan-in + fan-out) of each decoder layer's linear map (q, k, v, o,
    gate, up, down on the Llama / Qwen2 module names) that target_modules names and exclude_modules leaves, by
    lora.apply_lora's rules; 0 without LoRA. A saved adapter (lora_adapter_path) gives its own rank and modules.
    SmolLM2-135M at rank 32, all-linear: 9.77M, 7% of its 134.5M."""
    if not getattr(model_cfg, "uses_lora", False):
        return 0
    import lora

    rank, targets, exclude = model_cfg.lora_rank, model_cfg.target_modules, model_cfg.exclude_modules
    if model_cfg.lora_adapter_path:
        saved = lora.read_adapter_config(model_cfg.lora_adapter_path)
        rank, targets, exclude = saved["rank"], saved["target_modules"], saved["exclude_modules"]
    H, inter = shape.hidden, shape.intermediate
    dq, dkv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    maps = {
        "self_attn.q_proj": H + dq, "self_attn.k_proj": H + dkv, "self_attn.v_proj": H + dkv,
        "self_attn.o_proj": dq + H, "mlp.gate_proj": H + inter, "mlp.up_proj": H + inter, "mlp.down_proj": inter + H,
    }  # fmt: skip
    wanted = lora._parse_targets(targets)  # None: all-linear
    return sum(
        rank * fans
        for i in range(shape.layers)
        for suffix, fans in maps.items()
        if lora.targeted(f"model.layers.{i}.{suffix}", wanted, exclude)
    )


def train_flops_per_token(shape: ModelShape) -> float:
    """6 x matmul_params: forward and backward FLOPs of the weights for one token."""
    return 6.0 * shape.matmul_params


def attention_train_flops(shape: ModelShape, lengths: list[int]) -> float:
    """Forward + backward FLOPs of QK^T and AV over sequences of these lengths (causal: only the lower half)."""
    return 6.0 * shape.layers * shape.heads * shape.head_dim * sum(n * n for n in lengths)


def mfu(flops: float, seconds: float, peak: float = PEAK_FLOPS) -> float:
    """Model FLOPs utilisation: flops / seconds / peak (0 when no time passed)."""
    return flops / seconds / peak if seconds > 0 else 0.0


# -------------------------------------------------------------------------------------------- memory


class PhaseMemory:
    """CUDA memory per phase: `with mem("update"): ...`; `pop()` -> perf/memory/* metrics (GiB). No-op on CPU."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.open: list[str] = []
        self.peaks: dict[
            str, list[float]
        ] = {}  # phase -> [peak allocated, peak reserved, device used], bytes

    def _fold(self) -> None:
        """Charges the peak since the last reset to every open phase, then resets the counters."""
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        for name in self.open:
            p = self.peaks.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            p[0], p[1] = max(p[0], allocated), max(p[1], reserved)
        torch.cuda.reset_peak_memory_stats()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        self._fold()
        self.open.append(name)
        try:
            yield
        finally:
            self._fold()
            self.open.remove(name)
            free, total = torch.cuda.mem_get_info()
            p = self.peaks[name]
            if total - free >= p[2]:  # the device's use at the phase's end, and torch's share of it then
                p[2], p[3] = total - free, torch.cuda.memory_reserved()

    def pop(self) -> dict[str, float]:
        """perf/memory/<phase>_{peak_allocated,peak_reserved,device_used,reserved_end}_gb since the last pop;
        clears them. reserved_end: torch's reserved memory at the end that device_used was read at (with a sleeping
        vLLM engine it still counts the engine's released pool: `device_ledger`)."""
        out = {}
        for name, (allocated, reserved, used, reserved_end) in self.peaks.items():
            out[f"perf/memory/{name}_peak_allocated_gb"] = allocated / GIB
            out[f"perf/memory/{name}_peak_reserved_gb"] = reserved / GIB
            out[f"perf/memory/{name}_device_used_gb"] = used / GIB
            out[f"perf/memory/{name}_reserved_end_gb"] = reserved_end / GIB
        self.peaks.clear()
        return out


def device_ledger(mark: str) -> str | None:
    """One line on the device's memory at a point of the run's set-up (rl.start, rl.make_engine), None on CPU:
    what the device has in use (total minus free: every process's, the CUDA context and memory outside torch's
    allocator included), torch's reserved and allocated memory, and the difference of the first two, the memory
    outside torch's allocator (the CUDA context, NCCL, cuBLAS handles, CUDA graphs' own memory, what vLLM maps
    itself). The engine's start shows what it adds outside its gpu_memory_utilization budget.

        memory at engine started: device used 29.14 GiB, torch reserved 24.80 (allocated 24.50), outside torch 4.34
    """
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    used, reserved = (total - free) / GIB, torch.cuda.memory_reserved() / GIB
    allocated = torch.cuda.memory_allocated() / GIB
    return (
        f"memory at {mark}: device used {used:.2f} GiB, torch reserved {reserved:.2f} (allocated {allocated:.2f}), "
        f"outside torch {used - reserved:.2f}"
    )


def peaks_text(metrics: dict[str, float]) -> str:
    """trainer.debug's memory part of a step's console line: each phase's peak allocated device memory in GiB, from
    the step's perf/memory/<phase>_peak_allocated_gb metrics (PhaseMemory)."""
    suffix = "_peak_allocated_gb"
    peaks = ", ".join(
        f"{k.removeprefix('perf/memory/').removesuffix(suffix)} {v:.2f}"
        for k, v in metrics.items()
        if k.startswith("perf/memory/") and k.endswith(suffix)
    )
    return f"peak allocated GiB: {peaks}" if peaks else "no CUDA device (memory not tracked)"


class PhaseGC:
    """The Python garbage collector's pauses per phase: `perf/gc/<phase>_s` (seconds of collections that ended
    while the phase was open, from any thread) and `perf/gc/full_collections` (generation 2). vLLM's in-process
    engine makes many short-lived objects each decode step in the trainer's process, whose heap (the model, the
    data) a full collection walks: the generation phase's distance from a bare engine's may be here.
    Hooks itself into gc.callbacks until `close()`."""

    def __init__(self) -> None:
        self.open: list[str] = []
        self.seconds: dict[str, float] = {}
        self.full = 0
        self.started: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        if self.started is None:
            return
        paused, self.started = time.perf_counter() - self.started, None
        for name in self.open:
            self.seconds[name] += paused
        self.full += info.get("generation") == 2

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.seconds.setdefault(name, 0.0)
        self.open.append(name)
        try:
            yield
        finally:
            self.open.remove(name)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def pop(self) -> dict[str, float]:
        out = {f"perf/gc/{name}_s": s for name, s in self.seconds.items()}
        out["perf/gc/full_collections"] = float(self.full)
        self.seconds, self.full = {}, 0
        return out


class PhaseTimer(log.Timer):
    """log.Timer that also records each phase's CUDA memory (PhaseMemory), and with `watch_gc` the garbage
    collector's pauses in it (PhaseGC; `close()` unhooks it); `pop()` returns them all.

    explain: called with a phase's name, a context manager wrapped around that phase (rl.step_timer's turns an
    out-of-memory error into one naming the phase and the flags to lower)."""

    def __init__(
        self, sync: Any = None, explain: Callable[[str], Any] | None = None, watch_gc: bool = False
    ) -> None:
        super().__init__(sync=sync)
        self.memory = PhaseMemory()
        self.gc = PhaseGC() if watch_gc else None
        self.explain = explain

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        explained = self.explain(name) if self.explain is not None else nullcontext()
        collected = self.gc(name) if self.gc is not None else nullcontext()
        with self.memory(name), collected, super().__call__(name), explained:
            yield

    def close(self) -> None:
        if self.gc is not None:
            self.gc.close()

    def pop(self) -> dict[str, float]:
        return super().pop() | self.memory.pop() | (self.gc.pop() if self.gc is not None else {})


def update_metrics(
    shape: ModelShape, tokens: float, sum_sq_lengths: float, seconds: float, world_size: int
) -> dict[str, float]:
    """perf/mfu, perf/mfu_attn, perf/update_tokens_per_s of a policy update over all ranks.

    Args:
        tokens: tokens trained by all ranks (prompt + response of every sample, times the epochs).
        sum_sq_lengths: the sum of each trained sequence's length squared (times the epochs), for attention.
        seconds: the update's wall time; world_size: ranks (devices) that ran it at once.
    """
    flops = train_flops_per_token(shape) * tokens
    attn = 6.0 * shape.layers * shape.heads * shape.head_dim * sum_sq_lengths
    device_seconds = seconds * world_size
    return {
        "perf/mfu": mfu(flops, device_seconds),
        "perf/mfu_attn": mfu(flops + attn, device_seconds),
        "perf/update_tokens_per_s": tokens / device_seconds if device_seconds > 0 else 0.0,
    }


# ---------------------------------------------------------------------------------------------- plan


ENGINE_ASLEEP_BYTES = 1 * GIB
"""What a sleeping vLLM engine keeps on the device (CUDA graph pool, workspaces): an estimate, not measured."""
CUDA_CONTEXT_BYTES = int(0.6 * GIB)
"""The CUDA context and library handles outside torch's allocator: an estimate."""


COMPILED_LAYER_SHARE = 0.66
"""What a compiled decoder layer (model.compile_layers) keeps for backward, as a share of the eager count below:
inductor's partitioner recomputes the norms, SiLU and the products in the backward instead of saving them.
Measured on CPU with saved-tensor hooks over one bf16 Qwen2 layer (sdpa, 512 tokens): 38,976 bytes a token at
the 0.5B shape and 70,712 at 1.5B, against 57,664 and 103,992 eager (0.676, 0.680), and 0.659 and 0.664 of the
hand count (59,136 and 106,496)."""


def activation_bytes_per_token(
    shape: ModelShape, checkpointed_layers: int, recompute: bool = True, compiled: bool = False
) -> float:
    """Activations a training forward keeps for backward, bytes per token, bf16 compute (FSDP mixed precision),
    with `checkpointed_layers` of the decoder layers recomputing theirs (0: none; shape.layers: all).

    Per layer: two RMSNorms (fp32 input copy 4H, bf16 input 2H, bf16 output 2H each: 16H), q/k/v/o and the
    attention kernel's saved q, k, v, output and their contiguous copies (6 Dq + 4 Dkv), the gated MLP (gate,
    SiLU output, up, product: 8I). A checkpointed layer keeps only its input (2H), and one layer's full set is
    alive during its recomputation (left out with recompute=False; counted eager even when `compiled`, as it
    stands for the layer's backward, whose temporaries the compiled one makes too). Counted by hand from
    transformers' Qwen2 modules; a layer that is not checkpointed keeps COMPILED_LAYER_SHARE of it when
    `compiled`.
    """
    dq, dkv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = 16 * shape.hidden + 6 * dq + 4 * dkv + 8 * shape.intermediate
    k = min(checkpointed_layers, shape.layers)
    kept = per_layer * (COMPILED_LAYER_SHARE if compiled else 1.0)
    return (shape.layers - k) * kept + k * 2 * shape.hidden + (per_layer if k and recompute else 0)


def update_bytes(
    shape: ModelShape, checkpointed_layers: int, tokens: float, fused: bool = False, compiled: bool = False
) -> dict[str, float]:
    """A policy update's micro-batch of `tokens` (bytes): the activations kept for backward, the training logits
    and the logprob kernel's workspace, and the recomputed layer's full set where it exceeds those. The
    recomputation meets neither the logits (backward frees them and their gradient at the lm_head first) nor the
    layers that are not checkpointed (fsdp.load_model checkpoints the first layers, so the backward is through the
    others before it recomputes one): only the checkpointed layers' inputs (tests/test_bench_e2e_verl.py checks the
    plan against the GPU runs). `compiled`: model.compile_layers (COMPILED_LAYER_SHARE)."""
    k = checkpointed_layers
    saved = activation_bytes_per_token(shape, k, recompute=False, compiled=compiled) * tokens
    layer = activation_bytes_per_token(shape, k, compiled=compiled) * tokens - saved
    inputs = min(k, shape.layers) * 2 * shape.hidden * tokens
    logits, kernel = logits_bytes_per_token(shape, True) * tokens, kernel_workspace_bytes(shape)
    # model.use_fused_kernels: no logits; the head's weight gradient builds up in one fp32 [V, H] buffer
    if fused:
        logits, kernel = 0.0, kernel + 4 * shape.vocab * shape.hidden
    return {
        "activations": saved,
        "logits": logits,
        "kernel": kernel,
        "recomputed layer": max(0.0, inputs + layer - saved - logits - kernel),
    }


def checkpointed_layers(model_cfg: Any, shape: ModelShape) -> int:
    """How many decoder layers recompute their activations under a ModelConfig's checkpointing settings (an
    unresolved auto counts as all: the plan printed before it is resolved must not be low)."""
    if not model_cfg.enable_gradient_checkpointing:
        return 0
    layers = getattr(model_cfg, "gradient_checkpointing_layers", "all")
    return shape.layers if isinstance(layers, str) else min(layers, shape.layers)


def logits_bytes_per_token(shape: ModelShape, training: bool) -> float:
    """bf16 logits [N, V] (kept by the chunked logprob kernel), plus their bf16 gradient in a backward."""
    return (4 if training else 2) * shape.vocab


def kernel_workspace_bytes(shape: ModelShape, chunk_size: int = 1024) -> float:
    """losses._ChunkedTokenStats: about three fp32 [chunk_size, V] buffers alive at once (eager; an upper bound
    for the compiled CUDA path, whose fused kernels keep no fp32 [chunk_size, V] temporaries)."""
    return 3 * 4 * chunk_size * shape.vocab


@dataclass
class Plan:
    """Estimated device bytes per phase and component (`phases[phase][component]`), and the device's total."""

    phases: dict[str, dict[str, float]]
    device_total: float | None
    fixes: dict[str, str]

    @property
    def peak(self) -> tuple[str, float]:
        """(phase, bytes) of the largest phase."""
        name = max(self.phases, key=lambda k: sum(self.phases[k].values()))
        return name, sum(self.phases[name].values())

    def render(self) -> str:
        """The plan as a few lines of text: each phase's total and parts, the device, the verdict."""
        lines = ["memory plan (estimates from config.json and the settings; GiB):"]
        for name, parts in self.phases.items():
            detail = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items() if v >= 0.05 * GIB)
            lines.append(f"  {name:<13} {sum(parts.values()) / GIB:7.1f}  ({detail})")
        name, peak = self.peak
        if self.device_total is None:
            lines.append(f"  peak {peak / GIB:.1f} GiB in {name}; no CUDA device here to compare with")
            return "\n".join(lines)
        lines.append(f"  device {self.device_total / GIB:.1f} GiB; peak {peak / GIB:.1f} GiB in {name}")
        over = [k for k, parts in self.phases.items() if sum(parts.values()) > self.device_total]
        if not over:
            lines.append("  fits")
        for k in over:
            lines.append(f"  {k} does not fit: {self.fixes[k]}")
        return "\n".join(lines)


def _micro_batch_tokens(cfg: Any, sp_size: int = 1) -> int:
    """Most tokens in one actor micro-batch (of an SP group of `sp_size` GPUs): the token budget (per GPU), or
    micro-batch size x longest sequence."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if cfg.actor.use_dynamic_bsz:
        return max(cfg.actor.ppo_max_token_len_per_gpu * sp_size, longest)
    return cfg.actor.ppo_micro_batch_size_per_gpu * longest


def _plan_phases(cfg: Any, shape: ModelShape, world_size: int, device_total: float | None) -> dict:
    """The estimate behind `plan` (bytes):

    trainer, resident    fp32 params 4P/W + AdamW 8P/W, half of each with fsdp_config.model_dtype bfloat16 (+ the
                         reference in param_dtype, bf16 2P/W, with a KL loss and no LoRA),
                         W the ranks sharing the shards (model.fsdp_config.hsdp_shard_size with HSDP);
                         with LoRA the gradients and AdamW count the adapters' parameters alone (lora_params),
                         which sit in the params beside the frozen base's P;
                         gradients 4P/W (bf16: 2P/W) during the update only (freed by zero_grad(set_to_none));
                         the optimizer step: the AdamW state and foreach AdamW's sqrt(v) buffer (4P/W; none with
                         actor.optim.fused) beside the gradients, where they exceed what the backward held
                         (activations, logits, unsharded);
                         with offload_optimizer_in_rollout the AdamW state is off the device from its build
                         and from each push until the update's first optimizer step (sync, gen, old_logprob;
                         in the update too when that step is its only one, except by what the state exceeds
                         the backward's share)
    unsharded            bf16 copies FSDP gathers: the root (embedding, norm) 2(VH + H) and two layers
                         (one computing, one prefetched) 2 * 2 * layer params
    update               + update_bytes: activations kept for backward (a whole layer's COMPILED_LAYER_SHARE
                         of the eager count with compiled layers), training logits, kernel workspace, and the
                         recomputed layer's full set beyond the logits and the whole layers' activations (none
                         of them alive at its recomputation);
                         model.use_fused_kernels: no logits, an fp32 [V, H] weight-gradient buffer instead;
                         with Ulysses SP (fsdp_config.ulysses_sequence_parallel_size) a rank holds 1/SP of a
                         micro-batch's tokens, so its activations and logits are divided by SP (sp.py); a token
                         budget (use_dynamic_bsz) is per GPU, so an SP group's micro-batch holds SP budgets
    old_logprob          + inference logits + kernel workspace (no activations are kept without grad)
    gen, sync            + the engine's budget rollout.gpu_memory_utilization x device memory (weights, KV
                         cache, its activations); while it sleeps ENGINE_ASLEEP_BYTES (the whole budget in
                         every phase without free_cache_engine, or with rollout.async_steps=1)
    every phase          + CUDA_CONTEXT_BYTES
    PPO (cfg.critic)     + the critic's params and AdamW, as the actor's by its own fsdp_config (AdamW off the device
                         in rollout like the actor's); the reference also with algorithm.use_kl_in_reward; an
                         "update_critic" phase: critic gradients, activations of a critic micro-batch, its
                         unsharded copies, no logits (a scalar head), and its optimizer step's sqrt(v) buffer
                         where that exceeds them (none with critic.optim.fused)
    """
    fs = cfg.model.fsdp_config
    P, W = shape.params, getattr(fs, "hsdp_shard_size", 0) or world_size  # HSDP shards over its group only
    lora = getattr(cfg.model, "uses_lora", False)
    algorithm = getattr(cfg, "algorithm", None)  # PPO's KL-in-reward also needs the reference
    kl = getattr(cfg.actor, "use_kl_loss", False) or getattr(algorithm, "use_kl_in_reward", False)
    b = _BYTES[
        getattr(fs, "model_dtype", "float32")
    ]  # the stored weights', gradients' and AdamW moments' dtype
    ref = _BYTES[getattr(fs, "param_dtype", "bfloat16")] * P / W if kl and not lora else 0.0
    # what the optimizer holds and the backward fills: LoRA's A and B alone, beside the frozen base
    trained = lora_params(shape, cfg.model) if lora else P
    params = 0.0 if fs.cpu_offload else b * (P + (trained if lora else 0)) / W
    adam = 0.0 if fs.cpu_offload else 2 * b * trained / W
    grads = 0.0 if fs.cpu_offload else b * trained / W
    unsharded = 2 * (shape.vocab * shape.hidden + shape.hidden) + 4 * shape.layer_matmul_params
    sp_size = getattr(fs, "ulysses_sequence_parallel_size", 1)
    T = _micro_batch_tokens(cfg, sp_size) / sp_size  # this rank's share
    ckpt = checkpointed_layers(cfg.model, shape)
    engine = cfg.rollout.gpu_memory_utilization * device_total if device_total else 0.0
    if getattr(cfg.rollout, "name", "vllm") == "hf":
        engine = 2 * P  # an unsharded bf16 copy, no KV cache
    # The engine never sleeps while rollouts are generated one step ahead (rollout.async_steps=1)
    awake = not getattr(cfg.rollout, "free_cache_engine", True) or getattr(cfg.rollout, "async_steps", 0)
    asleep = engine if awake else ENGINE_ASLEEP_BYTES
    offload_in_rollout = getattr(fs, "offload_optimizer_in_rollout", False)
    rollout_adam = 0.0 if offload_in_rollout else adam
    base = {"cuda context": CUDA_CONTEXT_BYTES, "params": params, "reference": ref}
    workspace = kernel_workspace_bytes(shape)
    fused = getattr(cfg.model, "use_fused_kernels", False)
    import actor  # not at the top: perf stays importable without transformers' models

    compiled = getattr(cfg.model, "compile_layers", False) is not False and actor.compiles(cfg.model)
    tail = update_bytes(shape, ckpt, T, fused, compiled)
    # Offloaded and one optimizer step an update: the state comes back at that step, after the last backward, so it
    # never meets the activations and logits. The step itself holds the state and foreach AdamW's sqrt(v) buffer
    # (one more copy of a moment's size); it sets the update's peak where those exceed what the backward held on top
    # of the resident state (1.5B at dd661b4: params + grads + AdamW + that buffer, 28.8 GiB, against 27.5-28.7
    # measured; the backward's 24.4 planned).
    resident = 0.0 if offload_in_rollout and _one_step(cfg) else adam
    fused_adamw = getattr(getattr(cfg.actor, "optim", None), "fused", False)  # optim.fused: no sqrt(v) buffer
    step_extra = max(
        0.0, adam - resident + (0.0 if fused_adamw else adam / 2) - unsharded - sum(tail.values())
    )
    critic = getattr(cfg, "critic", None)
    c_adam = c_rollout_adam = 0.0
    if critic is not None:
        c_off = critic.model.fsdp_config.cpu_offload
        cb = _BYTES[getattr(critic.model.fsdp_config, "model_dtype", "float32")]
        base["critic params"] = 0.0 if c_off else cb * P / W
        c_adam = 0.0 if c_off else 2 * cb * P / W
        c_rollout_adam = 0.0 if offload_in_rollout else c_adam
    phases = {
        "gen": base | {"optimizer": rollout_adam, "engine": engine},
        "old_logprob": base
        | {"optimizer": rollout_adam, "engine asleep": asleep, "unsharded": unsharded}
        | {"logits": 0.0 if fused else logits_bytes_per_token(shape, False) * T, "kernel": workspace},
        "update": base
        | {"optimizer": resident, "grads": grads, "engine asleep": asleep, "unsharded": unsharded}
        | tail
        | {"optimizer step": step_extra},
        "sync": base | {"optimizer": rollout_adam, "engine": engine, "unsharded": unsharded},
    }
    if critic is None:
        return phases
    for name, phase in phases.items():  # the critic's AdamW is back on the device from its own first step
        phase["critic optimizer"] = c_adam if name == "update" else c_rollout_adam
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    c_sp = getattr(critic.model.fsdp_config, "ulysses_sequence_parallel_size", 1)
    Tc = (
        max(critic.ppo_max_token_len_per_gpu * c_sp, longest)
        if critic.use_dynamic_bsz
        else critic.ppo_micro_batch_size_per_gpu * longest
    ) / c_sp
    c_ckpt = checkpointed_layers(critic.model, shape)
    c_activations = activation_bytes_per_token(shape, c_ckpt) * Tc
    c_fused = getattr(
        getattr(critic, "optim", None), "fused", False
    )  # its step's sqrt(v) buffer, as the actor's
    phases["update_critic"] = base | {  # before the actor's update: the actor's AdamW still as in rollout
        "optimizer": rollout_adam,
        "critic optimizer": c_adam,
        "critic grads": 0.0 if c_off else cb * P / W,
        "engine asleep": asleep,
        "unsharded": unsharded,
        "activations": c_activations,
        "critic optimizer step": max(0.0, (0.0 if c_fused else c_adam / 2) - unsharded - c_activations),
    }
    return phases


_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _one_step(cfg: Any) -> bool:
    """Whether each update is one optimizer step (ppo_epochs 1, a mini-batch of the whole batch); False where the
    config does not say (a bench's partial config)."""
    batch = getattr(cfg.data, "train_batch_size", None)
    return batch is not None and cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size >= batch


def plan(cfg: Any, world_size: int = 1, device_total: float | None = None) -> Plan:
    """The memory preflight of an RL run (grpo.py / ppo.py config), one rank's device.

    Args:
        cfg: the script's config (model.path's config.json is read; data, actor, rollout, model settings).
        world_size: ranks of the job (with HSDP the shards are split over hsdp_shard_size of them).
        device_total: device bytes; None reads this rank's CUDA device (None again on CPU).
    Returns: a Plan; `render()` prints it.
    """
    if device_total is None and torch.cuda.is_available():
        device_total = float(torch.cuda.mem_get_info()[1])
    shape = model_shape(cfg.model.path)
    budget = (
        "actor.ppo_max_token_len_per_gpu"
        if cfg.actor.use_dynamic_bsz
        else "actor.ppo_micro_batch_size_per_gpu"
    )
    ckpt = ""
    if not cfg.model.enable_gradient_checkpointing:
        ckpt = "--model.enable_gradient_checkpointing, or "
    elif checkpointed_layers(cfg.model, shape) < shape.layers:
        ckpt = "--model.gradient_checkpointing_layers all, or "
    critic = getattr(cfg, "critic", None)
    c_ckpt = ", or turn on --critic.model.enable_gradient_checkpointing"
    fixes = {
        "gen": "lower --rollout.gpu_memory_utilization or turn on "
        "--model.fsdp_config.offload_optimizer_in_rollout",
        "old_logprob": f"lower --{budget}",
        "update": f"lower --{budget}, or turn on {ckpt}--model.fsdp_config.cpu_offload, or raise "
        "--model.fsdp_config.ulysses_sequence_parallel_size",
        "sync": "lower --rollout.gpu_memory_utilization or turn on "
        "--model.fsdp_config.offload_optimizer_in_rollout",
        "update_critic": "lower --critic.ppo_micro_batch_size_per_gpu (or --critic.ppo_max_token_len_per_gpu "
        "with --critic.use_dynamic_bsz)"
        + (c_ckpt if critic is not None and not critic.model.enable_gradient_checkpointing else ""),
    }
    return Plan(_plan_phases(cfg, shape, world_size, device_total), device_total, fixes)


AUTO_CHECKPOINT_MARGIN = 1.1
"""gradient_checkpointing_layers=auto keeps the update's plan times this under the other phases: the plan's update
figure was 0.92-0.96x the measured one at 0.5B and 1.5B (bench/README.md), so this covers an error the other way."""


def resolve_auto_checkpointing(
    cfg: Any, world_size: int = 1, device_total: float | None = None
) -> tuple[Any, list[str]]:
    """cfg with each gradient_checkpointing_layers=auto (the policy's model, PPO's critic.model) replaced by the
    fewest decoder layers that keep its update phase's plan, times AUTO_CHECKPOINT_MARGIN, at or under the largest
    phase without an update (gen, old_logprob, sync: with the engine awake its share sets the step's peak), or,
    where the update's optimizer step sets the update's plan with every layer recomputed (an offloaded AdamW
    state back on the device: 1.5B on an 80 GB H100), that keep the plan there and its backward, times the
    margin, under the larger of the two; and a line for each saying what it came to. Without a CUDA device the
    engine's share is unknown (0 in the plan), so auto comes to all layers or nearly."""
    targets = [("model", "update", cfg.model)]
    if getattr(cfg, "critic", None) is not None:
        targets.append(("critic.model", "update_critic", cfg.critic.model))
    targets = [
        (key, phase)
        for key, phase, m in targets
        if m.enable_gradient_checkpointing and m.gradient_checkpointing_layers == "auto"
    ]
    if not targets:  # nothing to size: the model's config is not read
        return cfg, []
    if device_total is None and torch.cuda.is_available():
        device_total = float(torch.cuda.mem_get_info()[1])
    shape = model_shape(cfg.model.path)
    said = []
    for key, phase in targets:
        # the update's optimizer step (an offloaded state back on the device) sets its plan whatever the layers
        # recompute where the activations stay under it: fewer recomputed layers then raise nothing
        floor = _update_plan(cfg, key, phase, shape.layers, shape, world_size, device_total)[0]
        for k in range(shape.layers + 1):
            total, backward, ceiling = _update_plan(cfg, key, phase, k, shape, world_size, device_total)
            if total * AUTO_CHECKPOINT_MARGIN <= ceiling or (
                total <= floor * (1 + 1e-9) and backward * AUTO_CHECKPOINT_MARGIN <= max(ceiling, floor)
            ):
                break
        trial = _with_checkpoint_layers(cfg, key, k)
        # every layer is "all": what models whose layers cannot be picked one by one (fsdp.load_model) also take
        cfg = trial if k < shape.layers else _with_checkpoint_layers(cfg, key, "all")
        where = "" if device_total else "; no CUDA device here, so the engine's share is not counted"
        said.append(
            f"{key}.gradient_checkpointing_layers=auto: {k} of {shape.layers} layers recompute ({phase} planned at "
            f"{total / GIB:.1f} GiB against the step's other peak {ceiling / GIB:.1f} GiB{where})"
        )
    return cfg, said


def _update_plan(
    cfg: Any, key: str, phase: str, k: int, shape: ModelShape, world_size: int, device_total: float | None
) -> tuple[float, float, float]:
    """With `key`'s first k layers recomputed: the update phase's plan, its backward's part (all but the optimizer
    step's), and the largest phase without an update (bytes)."""
    plan = _plan_phases(_with_checkpoint_layers(cfg, key, k), shape, world_size, device_total)
    parts = plan[phase]
    total = sum(parts.values())
    backward = total - parts.get("optimizer step", 0.0) - parts.get("critic optimizer step", 0.0)
    return total, backward, max(sum(plan[n].values()) for n in ("gen", "old_logprob", "sync"))


def _with_checkpoint_layers(cfg: Any, key: str, k: int | str) -> Any:
    """cfg with `key`'s (model or critic.model) gradient_checkpointing_layers set to k."""
    if key == "critic.model":
        model = _replace(cfg.critic.model, gradient_checkpointing_layers=k)
        return _replace(cfg, critic=_replace(cfg.critic, model=model))
    return _replace(cfg, model=_replace(cfg.model, gradient_checkpointing_layers=k))


def _replace(obj: Any, **changes: Any) -> Any:
    """A copy of a dataclass or a SimpleNamespace (the benches' configs) with `changes`."""
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **changes)
    return type(obj)(**(vars(obj) | changes))
