"""The trainer side of an RL step, shared by grpo.py and ppo.py: the policy's settings and loading, the samples it
trains on, the logprob passes, the weight-push check, a loss-agnostic update loop and the push into the engine.

    policy, hf_files = actor.load(cfg.model, device)                # FSDP2-sharded Hugging Face causal LM
    actor.compute_logprobs(policy, samples, cfg.actor, layout, temperature, check)   # old logprobs, no grad
    actor.update(policy, optimizer, guard, samples, n_prompts, cfg.actor, layout, loss_fn)  # epochs x mini x micro
    actor.push_weights(engine, policy, dtype)                       # one full parameter at a time

The objectives are not here: grpo.py and ppo.py each write theirs (`loss_fn(model, mb) -> (loss, metrics)`) and
hand it to `update`, which owns only the loop: epochs x mini-batches (one optimizer step each) x micro-batches
(one forward/backward each), the gradient-sync gating, clipping and the skip guard. ppo.py's critic uses the same
loop with its value loss.

A `Sample` is one response with everything an update needs. Its `advantages` is a float (GRPO & co.: one
advantage for every token of the response) or a [L] tensor (PPO's GAE). A `MicroBatch` turns any per-sample
value into [S, R] (S responses, R the longest response) with `per_token`.

Micro-batches: every rank runs the same number of forward/backward passes (FSDP's collectives pair up), so a
rank with fewer samples runs an empty pass (one pad token, no loss). Losses are normalised by the token /
sequence counts of the whole mini-batch on all ranks (MicroBatch.global_tokens, global_seqs), so the split into
micro-batches and ranks does not change the update.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist

import config
import data
import fsdp
import lora
import losses
import optim
import sp


@dataclass(frozen=True)
class ModelConfig:
    """The policy (and, frozen, the reference): verl's actor_rollout_ref.model."""

    path: str = "runs/sft_model"
    """Hugging Face model id (e.g. Qwen/Qwen2.5-0.5B-Instruct) or local folder (a shard_merge.py output)."""
    trust_remote_code: bool = False
    """Allow the model folder's own Python code to run (off: a downloaded model must not run code)."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation used by the trainer."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in the backward pass to save memory: on by default, as in verl and TRL (a command
    sized for their memory fits here too). Off, every layer's activations stay: grpo.py's 0.5B update on the H200
    took 5.1 s instead of 7.7, in 50 GiB of device memory instead of 25 (bench/README.md)."""
    gradient_checkpointing_layers: Literal["all", "auto"] | int = "all"
    """With enable_gradient_checkpointing, which decoder layers recompute: all (verl's and TRL's behaviour); N,
    the first N; auto (grpo.py and ppo.py), the fewest that keep the update phase's planned memory (perf.plan,
    with a 10% margin) at or under the step's largest other phase, which the engine's awake share sets, so the
    update runs faster without raising the step's peak (or, where the update's optimizer step, an offloaded AdamW
    state back on the device, sets its plan anyway, under that step). The run prints what auto came to. At the e2e bench's
    shapes (vLLM share 0.3 of an H200, one optimizer step a step, the optimizer state offloaded in the rollout)
    the plan gives none of 24 layers at 0.5B, the setting of the H200 run at 8723179 (0.53x TRL's step time, 0.90x
    its peak memory), and 17 of 28 at 1.5B (not yet measured)."""
    use_remove_padding: bool = True
    """Pack sequences into one row per micro-batch (no padding tokens computed)."""
    use_fused_kernels: bool = False
    """The policy's (and reference's) logprobs and entropy straight from the final hidden states and the LM head's
    weight, one row chunk at a time (losses.fuse_lm_head, as verl's option of this name): the [B, T, V] logits and
    their gradient are never held (9.3 GiB at 16,384 tokens and Qwen's 151,936 ids), and the backward recomputes
    each chunk's logits (about 9% more FLOPs at 0.5B). Exact against the plain head on CPU; not yet measured on a
    GPU. Refused for heads that scale or cap their logits."""
    compile_layers: Literal["auto"] | bool = "auto"
    """torch.compile each decoder layer's forward (dynamic shapes: the layers and the micro-batch lengths share
    their compiled graphs): fuses the per-layer elementwise work (norms, rotary, activation, dtype casts) that the
    host issues op by op, which bounds the update at small sizes on a fast GPU (bench/README.md). FSDP2's hooks
    and the activation recomputation stay outside the compiled code, and parameter names do not change. The
    first micro-batches pay the compilation (18-76 s more in the first step on an H100). auto (the default): on
    with a CUDA device, off on CPU (aot_eager there captures the graphs but fuses nothing), with Ulysses sequence
    parallelism, and beside an in-process engine generating ahead (grpo.py's rollout.async_steps=1 without
    rollout.engine_process=true: tracing a layer patches module calls process-wide, and vLLM's sampler in the
    other thread fails); true there is refused. Measured on H100s (bench/README.md): at 0.5B the checkpointed
    update 1.46x the tokens/s of eager (MFU 0.17 -> 0.25) and grpo.py's step 0.94x (ecfbe9a); on SmolLM2-135M
    with LoRA the update 0.75x and the step 0.91x of eager (f8597ea)."""
    lora_rank: Annotated[int, config.NON_NEGATIVE] = 0
    """LoRA rank; 0 trains all weights. With LoRA the reference policy is the base model (adapters off) and
    the engine receives the merged weights."""
    lora_alpha: Annotated[float, config.POSITIVE] = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    target_modules: str | list[str] = "all-linear"
    """Modules LoRA wraps: `all-linear` or a list of names such as [q_proj, v_proj]."""
    exclude_modules: str | list[str] | None = None
    """Modules LoRA leaves out even where target_modules names them (verl's and PEFT's exclude_modules): a string
    is a regex the whole module name must match (re.fullmatch; verl's example `.*visual.*`), a list holds names
    or name suffixes. An exclusion that leaves no module to wrap is an error."""
    lora_adapter_path: str | None = None
    """A saved PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, as PEFT and
    `shard_merge.py --adapter-only` write it) to start from instead of fresh adapters, as verl's key: LoRA is on
    even with lora_rank 0, and the folder's r, lora_alpha, target_modules, exclude_modules and lora_dropout
    replace this config's (each change said on stderr). Read with safetensors only; a tensor that lands on no
    LoRA parameter, a parameter left without one, or a shape mismatch is an error naming the tensor. The reference
    policy is the base model with no adapter (verl's ref_in_actor)."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Settings put on the model's config before it is built, in the trainer and in the rollout engine (verl's
    model.override_config; DAPO's recipe: `+actor_rollout_ref.model.override_config.attention_dropout=0.`). A name
    the config lacks is set anyway and said on stderr."""
    fsdp_config: fsdp.FSDPConfig = field(default_factory=fsdp.FSDPConfig)
    """Sharding, mixed precision and offload."""

    @property
    def uses_lora(self) -> bool:
        """LoRA is on: a rank, or a saved adapter to start from (verl: either one)."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None

    def __post_init__(self) -> None:
        if self.compile_layers is True and self.fsdp_config.ulysses_sequence_parallel_size > 1:
            raise ValueError(
                "model.compile_layers does not go with fsdp_config.ulysses_sequence_parallel_size > 1 (the "
                "all-to-alls inside each layer are not compiled); set one of them off"
            )
        layers = self.gradient_checkpointing_layers
        if isinstance(layers, int) and (isinstance(layers, bool) or layers < 0):
            raise ValueError(
                f"model.gradient_checkpointing_layers must be 'all', 'auto' or a layer count >= 0, got {layers!r}"
            )


@dataclass(frozen=True)
class PolicyLossConfig:
    """Which surrogate the policy objective uses (verl's actor.policy_loss)."""

    loss_mode: Literal["vanilla", "gspo", "geo_mean", "gpg", "cispo", "sapo"] = "vanilla"
    """vanilla: PPO-clip per token. The others are grpo.py's only (its `surrogate` holds each formula):
    gspo: a sequence-level importance ratio (GSPO, arXiv:2507.18071; verl suggests clip ratios 3e-4 / 4e-4);
    geo_mean: the geometric mean of the clipped token ratios (GMPO, arXiv:2507.20673; verl's example clips at
    0.4 / 0.4); gpg: the plain policy gradient -A log pi, no ratio (GPG, arXiv:2504.02546; pair with
    algorithm.adv_estimator=gpg); cispo: -sg(clip(ratio)) A log pi (CISPO, arXiv:2506.13585; verl's example
    clip_ratio_low 10, i.e. no lower bound, clip_ratio_high 0.2); sapo: a sigmoid gate of the ratio instead of a
    clip (SAPO, arXiv:2511.20347; actor.tau_pos / tau_neg). gspo, geo_mean and sapo weigh every sequence the same
    (seq-mean-token-mean, as verl) whatever actor.loss_agg_mode says; the KL and entropy terms follow it."""


@dataclass(frozen=True)
class ActorConfig:
    """The policy update (verl's actor_rollout_ref.actor)."""

    ppo_mini_batch_size: Annotated[int, config.AT_LEAST_ONE] = 256
    """Prompts per optimizer step (times rollout.n responses), over all ranks."""
    ppo_micro_batch_size_per_gpu: Annotated[int, config.AT_LEAST_ONE] = 8
    """Responses per forward/backward on one rank."""
    use_dynamic_bsz: bool = False
    """Micro-batches under a token budget (ppo_max_token_len_per_gpu) instead of a fixed count."""
    ppo_max_token_len_per_gpu: Annotated[int, config.AT_LEAST_ONE] = 16384
    """Token budget of one micro-batch when use_dynamic_bsz is on (also used for the logprob passes)."""
    ppo_epochs: Annotated[int, config.AT_LEAST_ONE] = 1
    """Passes over each step's samples."""
    old_logprobs_from_update: bool = True
    """When the update is one optimizer step over the whole batch (ppo_epochs 1, ppo_mini_batch_size = the
    step's prompts) the weights have not moved before its forward, so the old logprobs are that forward's, detached
    (ratio 1; TRL does the same), and that forward also checks the weight push and measures the entropy: no
    separate old-logprob pass runs. Off: always the full pass. ppo.py keeps the full pass when the KL is in the
    reward (it needs them before the advantages) and in the critic's warm-up steps (no actor update)."""
    clip_ratio_low: Annotated[float, config.NON_NEGATIVE] = 0.2
    """PPO clip: the ratio is kept above 1 - clip_ratio_low (1 or more: no lower bound, as verl's CISPO example's
    10)."""
    clip_ratio_high: Annotated[float, config.NON_NEGATIVE] = 0.2
    """PPO clip: the ratio is kept below 1 + clip_ratio_high (DAPO's clip-higher when > clip_ratio_low).
    policy_loss.loss_mode=geo_mean bounds the log-ratio to [-clip_ratio_low, clip_ratio_high] instead."""
    clip_ratio_c: Annotated[float, config.Range(1, low_open=True)] = 3.0
    """Dual-clip bound for negative advantages (arXiv:1912.09729); must be > 1."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become one number; normalised over the global mini-batch."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) to the loss (needs the reference model)."""
    kl_loss_coef: Annotated[float, config.NON_NEGATIVE] = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3); a '+' suffix takes k2's gradient."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The surrogate: PPO-clip (vanilla), GSPO, GMPO, GPG, CISPO or SAPO (grpo.py)."""
    tau_pos: Annotated[float, config.POSITIVE] = 1.0
    """SAPO's gate temperature for tokens of positive advantage (policy_loss.loss_mode=sapo; verl's default, the
    paper's value): the gate sigmoid(tau (ratio - 1)) 4 / tau falls off faster off policy as tau grows."""
    tau_neg: Annotated[float, config.POSITIVE] = 1.05
    """SAPO's gate temperature for tokens of zero or negative advantage (verl's default; the paper keeps it above
    tau_pos: negative updates spread over many unsampled tokens and are damped faster)."""
    entropy_coeff: Annotated[float, config.NON_NEGATIVE] = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    grad_clip: Annotated[float, config.POSITIVE] = 1.0
    """Clip the global gradient norm to this."""
    optim: optim.OptimConfig = field(default_factory=lambda: optim.OptimConfig(lr=1e-6))
    """Optimizer and schedule."""


def load(
    cfg: ModelConfig, device: torch.device, value_head: bool = False, dtype: torch.dtype | None = None
) -> tuple[torch.nn.Module, dict]:
    """The model at cfg.path (with a scalar value head for ppo.py's critic), FSDP2-sharded on `device`, and the
    files a checkpoint needs to describe it (checkpoint.save_checkpoint's hf_files). Its weights are stored in
    `dtype` (None: model.fsdp_config.model_dtype)."""
    layers = cfg.gradient_checkpointing_layers
    if cfg.enable_gradient_checkpointing and layers == "auto":
        raise ValueError(
            "model.gradient_checkpointing_layers=auto is sized by the RL memory plan (grpo.py, ppo.py: "
            "perf.resolve_auto_checkpointing); here give 'all' or a layer count"
        )
    model = fsdp.load_model(
        cfg.path,
        trust_remote_code=cfg.trust_remote_code,
        attn_implementation=cfg.attn_implementation,
        gradient_checkpointing=cfg.enable_gradient_checkpointing,
        value_head=value_head,
        checkpoint_layers=None if layers == "all" else layers,
        config_overrides=cfg.override_config,
        dtype=dtype or getattr(torch, cfg.fsdp_config.model_dtype),
    )
    sp.setup(model, cfg.fsdp_config.ulysses_sequence_parallel_size, device.type, cfg.use_remove_padding)
    hf_files = dict(config=model.config, generation_config=getattr(model, "generation_config", None))
    if cfg.uses_lora and value_head:
        fsdp.print0(
            "critic.model.lora_rank, lora_adapter_path and exclude_modules are ignored: the critic trains every "
            "weight (its value head is new)",
            file=sys.stderr,
        )
    elif cfg.uses_lora:
        settings, notes = lora.start_lora(model, cfg)
        for line in notes:
            fsdp.print0(line, file=sys.stderr)
        hf_files["lora"] = dict(settings, base_model_name_or_path=cfg.path)
    if cfg.use_fused_kernels and value_head:
        fsdp.print0("critic.model.use_fused_kernels is ignored: a value head has no vocabulary to fuse")
    elif cfg.use_fused_kernels:
        losses.fuse_lm_head(model)
    if compiles(cfg):
        if cfg.compile_layers == "auto":
            fsdp.print0(
                "model.compile_layers=auto: the decoder layers compile (inductor) in the first steps; "
                "model.compile_layers=false runs them eager"
            )
        fsdp.compile_layers(model)
    return fsdp.shard_model(model, device, cfg.fsdp_config), hf_files


def compiles(cfg: ModelConfig) -> bool:
    """What model.compile_layers comes to: true and false as they are; auto, on with a CUDA device and without
    Ulysses sequence parallelism (grpo.py turns it off beside an in-process engine generating ahead)."""
    if cfg.compile_layers == "auto":
        return torch.cuda.is_available() and cfg.fsdp_config.ulysses_sequence_parallel_size == 1
    return bool(cfg.compile_layers)


def load_reference(cfg: ModelConfig, policy: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The frozen reference policy: with LoRA the policy itself (compute_logprobs(ref=True) turns its adapters
    off, so no second copy), else a second sharded copy of the starting weights, stored on GPU in the compute
    dtype (as verl's reference): FSDP2 casts fp32 weights to it anyway, so the logprobs are the same bits at half
    the memory of an fp32 copy."""
    if cfg.uses_lora:
        return policy
    dtype = getattr(torch, cfg.fsdp_config.param_dtype) if device.type == "cuda" else None
    return load(cfg, device, dtype=dtype)[0].eval().requires_grad_(False)


# ------------------------------------------------------------------------------------- samples, batches


@dataclass
class Sample:
    """One response and everything the update needs about it."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float] | None  # [L] the engine's, temperature 1; None: not a checked prompt's
    finish_reason: str
    group: int  # index of its prompt in this rank's share of the step's prompts
    score: float = 0.0
    reward_info: dict[str, float] = field(
        default_factory=dict
    )  # the function's own score and dict keys (scoring.score)
    advantages: float | torch.Tensor = 0.0  # one value for every token, or [L]
    old_logprobs: torch.Tensor | None = None  # [L], the trainer's at the sampling temperature, or vLLM's
    ref_logprobs: torch.Tensor | None = None  # [L]
    values: torch.Tensor | None = None  # [L], the critic's (ppo.py)
    returns: torch.Tensor | None = None  # [L], the critic's targets (ppo.py)
    loss_mask: torch.Tensor | None = None  # [L] 1: the loss counts it, 0: rejection sampling dropped it
    sum_pi_squared: torch.Tensor | None = None  # [L] sum_v pi_v^2 of the old policy (grpo.py's OTB weights)

    @property
    def loss_tokens(self) -> float:
        """How many of its tokens the loss counts: all, less those rollout rejection sampling dropped."""
        return float(len(self.response_ids)) if self.loss_mask is None else float(self.loss_mask.sum())

    @property
    def checkable(self) -> bool:
        """Whether it carries the engine's logprob of every response token: one of the push check's samples
        (rollout.logprob_check_prompts), and not rl.generate's stand-in [0] for an empty response."""
        return self.rollout_logprobs is not None and len(self.rollout_logprobs) == len(self.response_ids)


@dataclass(frozen=True)
class Layout:
    """How samples become model inputs on this rank: packed (padding-free) or padded rows, the pad id, the device."""

    packed: bool
    pad_id: int
    device: torch.device


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. On CUDA through pinned memory without blocking: a copy from pageable memory
    synchronises the stream, and a micro-batch loop that waits for the GPU to drain its queue leaves it idle
    while the host prepares the next kernels."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def collate(samples: list[Sample], layout: Layout) -> dict:
    """Model inputs for the samples (prompt + response, loss mask on the response); [[pad]] when empty.

    Also `labels` and `label_mask` [B, T] (data.shift_labels) and `response_index` [M], the flat row-major
    positions of the labelled tokens (response_matrix). All built on the host and copied without a device sync;
    `max_seqlen` stays on the host, where data.model_inputs reads it.
    """
    if not samples:
        seqs, masks = [[layout.pad_id]], [[0]]
    else:
        seqs = [s.prompt_ids + s.response_ids for s in samples]
        masks = [[0] * len(s.prompt_ids) + [1] * len(s.response_ids) for s in samples]
    if layout.packed:  # GPU: no N x N mask (varlen attention)
        b = data.pack_batch(seqs, masks, mask_dtype=data.packed_mask_dtype(layout.device))
    else:
        b = data.pad_batch(seqs, masks, layout.pad_id)
    b["labels"], b["label_mask"] = data.shift_labels(b)
    b["response_index"] = b["label_mask"].reshape(-1).nonzero().reshape(-1)
    return {k: v if k == "max_seqlen" else to_device(v, layout.device) for k, v in b.items()}


def response_matrix(values: torch.Tensor, index: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-token values at the response positions of a micro-batch, as [S, R] (R = longest response).

    values: [B, T] from the model (either layout); index: collate's `response_index`, the flat positions of
    the S responses' tokens one after another, which is how collate() laid them out. No device sync.
    """
    flat = values.reshape(-1)[index]  # [sum(lengths)]
    S, R = len(lengths), max(lengths, default=1)
    lens = torch.tensor(lengths)
    rows = torch.repeat_interleave(torch.arange(S), lens)
    cols = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    out = values.new_zeros(S, R)  # [S, R]
    out[to_device(rows, values.device), to_device(cols, values.device)] = flat
    return out


def padded(rows: list[torch.Tensor | list[float] | float], R: int, device: torch.device) -> torch.Tensor:
    """Right-pads per-sample 1-D values (or broadcasts scalars) into [S, R] float32 on `device` (built on the
    host: the samples keep theirs there)."""
    out = torch.zeros(len(rows), R)
    for i, r in enumerate(rows):
        r = torch.as_tensor(r, dtype=torch.float32)
        out[i, : (r.numel() if r.dim() else R)] = r
    return to_device(out, device)


def mask_of(lengths: list[int], device: torch.device, R: int | None = None) -> torch.Tensor:
    """[S, R] float mask of S responses of these lengths (R: the longest, unless given)."""
    R = max(lengths, default=1) if R is None else R
    return to_device((torch.arange(R)[None] < torch.tensor(lengths)[:, None]).float(), device)


@dataclass
class MicroBatch:
    """One forward/backward's samples, their model inputs and response masks, and the token and sequence counts of
    the mini-batch they belong to (all micro-batches, all ranks), which losses and metrics normalise by:
    global_tokens counts the tokens the loss counts (`mask`), global_valid_tokens every response token (`valid`),
    the same unless rollout rejection sampling dropped some."""

    samples: list[Sample]
    inputs: dict  # collate's
    lengths: list[int]  # response lengths
    valid: torch.Tensor  # [S, R] every response token
    mask: torch.Tensor  # [S, R] the tokens the loss counts: valid less rejection sampling's drops (loss_mask)
    global_tokens: float = 0.0
    global_seqs: float = 0.0
    global_valid_tokens: float = 0.0

    @classmethod
    def of(
        cls,
        samples: list[Sample],
        layout: Layout,
        global_tokens: float = 0.0,
        global_seqs: float = 0.0,
        global_valid_tokens: float | None = None,
    ):
        """global_valid_tokens: global_tokens when not given (no token dropped)."""
        lengths = [len(s.response_ids) for s in samples]
        valid = mask = mask_of(lengths, layout.device)
        if any(s.loss_mask is not None for s in samples):
            keep = [1.0 if s.loss_mask is None else s.loss_mask for s in samples]
            mask = valid * padded(keep, valid.shape[1], layout.device)
        every = global_tokens if global_valid_tokens is None else global_valid_tokens
        return cls(samples, collate(samples, layout), lengths, valid, mask, global_tokens, global_seqs, every)

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """The model's per-token [B, T] values at the response positions, as [S, R]."""
        return response_matrix(values, self.inputs["response_index"], self.lengths)

    def per_token(self, name: str) -> torch.Tensor | None:
        """The samples' `name` as [S, R] (a float broadcast over its response, a [L] tensor right-padded), or None
        when they carry none (e.g. old_logprobs left to the update's own forward)."""
        values = [getattr(s, name) for s in self.samples]
        if any(v is None for v in values):
            return None
        return padded(values, self.mask.shape[1], self.mask.device) * self.valid

    def token_mean(self, x: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the mini-batch's token mean of x [S, R] (the shares sum to the mean)."""
        return losses.agg_loss(x.detach(), self.mask, "token-mean", global_tokens=self.global_tokens)

    def valid_mean(self, x: torch.Tensor) -> torch.Tensor:
        """token_mean over every response token (`valid`), those rejection sampling dropped too."""
        return losses.agg_loss(x.detach(), self.valid, "token-mean", global_tokens=self.global_valid_tokens)


# ------------------------------------------------------------------------------------------- passes


class PushCheck:
    """Is the engine running the trained weights? The mean and max |trainer - engine| logprob at temperature 1 over
    every token of the samples that carry the engine's logprobs (rollout.logprob_check_prompts), and the policy's
    entropy over every response token (actor/entropy, at the sampling temperature).

    Measured on a forward that runs anyway: the old-logprob pass, or the update's own forward when that gives
    the old logprobs (`forward(check=...)`); with grpo.py's algorithm.rollout_bypass (no old-logprob pass) and
    several optimizer steps a batch, a no-grad pass of its own over one prompt's samples a rank. Sums stay on the
    device; `result` syncs once.
    """

    def __init__(self, device: torch.device) -> None:
        zero = lambda: torch.zeros((), device=device)  # noqa: E731
        self.diff_sum, self.diff_max, self.entropy_sum = zero(), zero(), zero()
        self.tokens = self.entropy_tokens = 0

    def add(self, mb: MicroBatch, raw: torch.Tensor | None, entropy: torch.Tensor) -> None:
        """Records one micro-batch: raw [S, R] the trainer's temperature-1 logprobs (None when no sample of it
        carries the engine's), entropy [S, R]."""
        if raw is not None:
            on = [
                L if s.checkable else 0 for L, s in zip(mb.lengths, mb.samples, strict=True)
            ]  # checked tokens
            R = raw.shape[1]
            engine = padded([s.rollout_logprobs if s.checkable else [] for s in mb.samples], R, raw.device)
            diff = (raw.detach() - engine).abs() * mask_of(on, raw.device, R)  # [S, R]
            self.diff_sum += diff.sum()
            self.diff_max = torch.maximum(self.diff_max, diff.max())
            self.tokens += sum(on)
        self.entropy_sum += (entropy.detach() * mb.valid).sum()
        self.entropy_tokens += sum(mb.lengths)

    def result(self, tol: float, step: int, stale: bool = False, probed: bool = False) -> dict[str, float]:
        """rollout/logprob_diff_mean and _max, actor/entropy over all ranks (collective).

        Raises RuntimeError (on every rank) when the mean exceeds `tol` (rollout.logprob_diff_tol) or is NaN: the
        engine is not running the trained weights; or when no rank checked a token: the push went unchecked.
        `stale`: the samples came from weights one update old (rollout.async_steps=1), so there is nothing to
        check; the difference is reported as rollout/offpolicy_diff_mean and _max (one update's change of the
        policy plus the engine's numerics). `probed`: the push was checked on probes (rl.check_push), so the
        samples carry no logprobs: actor/entropy only.
        """
        tokens = fsdp.all_reduce(self.tokens)
        entropy = fsdp.all_reduce(float(self.entropy_sum)) / max(fsdp.all_reduce(self.entropy_tokens), 1)
        if probed:
            return {"actor/entropy": entropy}
        if stale:
            return {
                "rollout/offpolicy_diff_mean": fsdp.all_reduce(float(self.diff_sum)) / max(tokens, 1),
                "rollout/offpolicy_diff_max": fsdp.all_reduce(float(self.diff_max), "max"),
                "actor/entropy": entropy,
            }
        if tokens == 0:
            raise RuntimeError(
                "no sample carries the engine's logprobs, so the weight push cannot be checked "
                "(rollout.logprob_check_prompts selects the prompts whose samples carry them)"
            )
        mean = fsdp.all_reduce(float(self.diff_sum)) / tokens
        if not mean <= tol:
            raise RuntimeError(
                f"step {step + 1}: vLLM's logprobs differ from the trainer's by {mean:.4f} on average (> "
                f"rollout.logprob_diff_tol={tol}): the engine is not running the trained weights"
            )
        return {
            "rollout/logprob_diff_mean": mean,
            "rollout/logprob_diff_max": fsdp.all_reduce(float(self.diff_max), "max"),
            "actor/entropy": entropy,
        }


def forward(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float,
    with_entropy: bool = False,
    check: PushCheck | None = None,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The policy's per-token logprobs [S, R] of mb's responses at `temperature` (differentiable, fp32), and their
    entropies [S, R] when asked for (or None). With `check`, this forward also feeds the push check. With
    `with_sum_pi_squared`, a third tensor: sum_v pi_v^2 [S, R] at `temperature`, no gradient."""
    raw_needed = check is not None and any(s.checkable for s in mb.samples)
    lp, ent, raw, *sps = sp.forward_logprobs(
        model,
        mb.inputs,
        mb.inputs["labels"],
        temperature,
        with_entropy or check is not None,
        with_raw=raw_needed,
        with_sum_pi_squared=with_sum_pi_squared,
    )
    lp, ent = mb.rows(lp), None if ent is None else mb.rows(ent)
    if check is not None:
        check.add(mb, mb.rows(raw) if raw_needed else None, ent)
    return lp, ent, *(mb.rows(t) for t in sps)


def micro_batches(samples: list[Sample], idx: list[int], cfg: Any, sp_size: int = 1) -> list[list[int]]:
    """Splits samples[idx] into micro-batches with cfg's sizes (ActorConfig or ppo.CriticConfig: by count, or under
    a token budget with use_dynamic_bsz, which is per GPU: an SP group of `sp_size` GPUs holds sp_size times it,
    as verl); every rank gets the same number of them (an all-reduce)."""
    lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in idx]
    if cfg.use_dynamic_bsz:
        kw = dict(max_token_len=cfg.ppo_max_token_len_per_gpu * sp_size)
    else:
        kw = dict(micro_batch_size=cfg.ppo_micro_batch_size_per_gpu)
    n = int(fsdp.all_reduce(len(data.micro_batches(lengths, **kw)), "max"))
    return [[idx[j] for j in g] for g in data.micro_batches(lengths, **kw, min_num=n)]


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module,
    samples: list[Sample],
    cfg: ActorConfig,
    layout: Layout,
    temperature: float,
    check: PushCheck | None = None,
    ref: bool = False,
    with_sum_pi_squared: bool = False,
) -> None:
    """Sets sample.old_logprobs (with `check`: also feeds the push check; with `with_sum_pi_squared` also
    sample.sum_pi_squared, from the same logits) or, with ref=True, sample.ref_logprobs (with any LoRA adapters of
    `model` off: the base model is the reference), [L] on the host. Eval mode, no grad."""
    model.eval()
    names = (
        ["ref_logprobs"] if ref else ["old_logprobs"] + (["sum_pi_squared"] if with_sum_pi_squared else [])
    )
    # with SP: the group's samples, on each of its ranks
    group, _, mine = sp.share_samples(model, samples, 0)
    for g in micro_batches(group, list(range(len(group))), cfg, sp.size_of(model)):
        mb = MicroBatch.of([group[i] for i in g], layout)
        with lora.disabled(model) if ref else contextlib.nullcontext():
            lp, _, *sps = forward(
                model, mb, temperature, check=check, with_sum_pi_squared=with_sum_pi_squared
            )
        for name, values in zip(names, [lp, *sps], strict=True):
            values = values.cpu()  # [S, R]
            for j, s in enumerate(mb.samples):
                setattr(s, name, values[j, : mb.lengths[j]])
    if group is not samples:  # SP: keep this rank's own results
        for s, i in zip(samples, mine, strict=True):
            for name in names:
                setattr(s, name, getattr(group[i], name))


def mini_batches(
    samples: list[Sample], n_prompts: int, mini_batch_size: int, sp_size: int = 1
) -> list[list[int]]:
    """Indices of samples per mini-batch: `mini_batch_size` prompts over all ranks, this rank's share of them
    (a sequence-parallel group of `sp_size` ranks shares one share).

    Raises ValueError when the mini-batch does not split into the ranks or divide this rank's prompts.
    """
    world = dist.get_world_size() // sp_size
    per_rank = mini_batch_size // world  # prompts per mini-batch on this rank
    if per_rank < 1 or mini_batch_size % world or n_prompts % per_rank:
        raise ValueError(
            f"ppo_mini_batch_size={mini_batch_size} must split into {world} ranks and divide "
            f"data.train_batch_size / world = {n_prompts}"
        )
    return [
        [i for i, s in enumerate(samples) if start <= s.group < start + per_rank]
        for start in range(0, n_prompts, per_rank)
    ]


def one_optimizer_step(cfg: ActorConfig, train_batch_size: int) -> bool:
    """Whether the update is one optimizer step over the whole batch (ppo_epochs 1, one mini-batch of all the
    step's prompts) with cfg.old_logprobs_from_update: its forward then sees the weights that sampled, so it gives
    the old logprobs and no separate pass runs."""
    return (
        cfg.old_logprobs_from_update and cfg.ppo_epochs == 1 and cfg.ppo_mini_batch_size == train_batch_size
    )


def in_train_mode(update: Callable[..., dict]) -> Callable[..., dict]:
    """Decorates an update whose first argument is the model: train mode while it runs, eval mode after (also
    on an exception), as verl's dp_actor. from_pretrained returns a model in eval mode, and Hugging Face decoder
    layers recompute activations (model.enable_gradient_checkpointing) only when `self.training`; the no-grad
    passes (compute_logprobs, ppo.compute_values) run in eval mode."""

    @functools.wraps(update)
    def wrapper(model: torch.nn.Module, *args, **kwargs) -> dict:
        model.train()
        try:
            return update(model, *args, **kwargs)
        finally:
            model.eval()

    return wrapper


LossFn = Callable[[torch.nn.Module, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""An objective: (model, micro-batch) -> (loss, metrics). The loss is this micro-batch's share of the mini-batch's
loss (normalised by mb.global_tokens / global_seqs), each metric a detached 0-dim tensor, likewise its share (e.g.
mb.token_mean), so that summing over micro-batches and ranks gives the mini-batch's value."""


@in_train_mode
def update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    guard: optim.SkipGuard,
    samples: list[Sample],
    n_prompts: int,
    cfg: Any,
    layout: Layout,
    loss_fn: LossFn,
    prefix: str = "actor/",
    on_empty: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """`cfg.ppo_epochs` passes over mini-batches of this rank's samples, one optimizer step each (when the guard
    lets it: a NaN/inf loss or gradient norm skips it), minimising `loss_fn` summed over the micro-batches.

    Args:
        n_prompts: prompts of this rank's share (sample.group < n_prompts).
        cfg: ActorConfig or ppo.CriticConfig: ppo_epochs, ppo_mini_batch_size, the micro-batch sizes, grad_clip.
        on_empty: run in place of loss_fn on a rank whose micro-batch is empty, between the empty forward and its
            backward, where loss_fn's own collectives fall, to pair them (every rank runs the same number of
            micro-batches; grpo.py's rollout_bypass all-reduces in each).
    Returns:
        loss_fn's metrics and {prefix}grad_norm, each the mean over the optimizer steps, all ranks; and this rank's
        seconds in the micro-batches' forwards and backwards (with the gradient norm) and in the optimizer steps
        (with an offloaded state's return), summed over the update, with the micro-batch count:
        perf/{name}_micro_batches_s, perf/{name}_optimizer_step_s, perf/{name}_micro_batch_count ({name}: the prefix
        without its slash). Both times end at a device sync that runs anyway (the norm's) or once a step.
    """
    world, P = dist.get_world_size(), sp.size_of(model)
    # SP: the ranks of a group train the group's samples together
    samples, n_prompts, _ = sp.share_samples(model, samples, n_prompts)
    sums: dict[str, torch.Tensor] = {}  # metric sums, device tensors until the update ends (no sync per pass)
    grad_norms = []
    seconds = {"micro_batches": 0.0, "optimizer_step": 0.0}
    n_micro_batches = 0
    for _ in range(cfg.ppo_epochs):
        for idx in mini_batches(samples, n_prompts, cfg.ppo_mini_batch_size, P):
            # over the data-parallel ranks: the P ranks of an SP group hold the same samples
            # the tokens the loss counts (rollout rejection sampling may drop some; at least 1: no 0 / 0)
            tokens = max(fsdp.all_reduce(sum(samples[i].loss_tokens for i in idx)) / P, 1.0)
            # every response token, dropped ones too (grpo.py's mismatch/* metrics average over them, as verl's)
            valid_tokens = max(fsdp.all_reduce(sum(len(samples[i].response_ids) for i in idx)) / P, 1.0)
            seqs = fsdp.all_reduce(len(idx)) / P
            groups = micro_batches(samples, idx, cfg, P)
            n_micro_batches += len(groups)
            loss_sum, start = 0.0, time.perf_counter()
            for k, g in enumerate(groups):
                model.set_requires_gradient_sync(k == len(groups) - 1)  # reduce-scatter once per mini-batch
                mb = MicroBatch.of([samples[i] for i in g], layout, tokens, seqs, valid_tokens)
                if (
                    not g
                ):  # this rank ran out of samples: an empty pass keeps FSDP's collectives paired; adds 0
                    nothing = sp.forward_logits(model, mb.inputs).sum() * 0
                    if on_empty is not None:  # where loss_fn's collectives fall: after the forward's gathers,
                        on_empty()  # before the backward's reductions (NCCL pairs a group's calls in order)
                    nothing.backward()
                    continue
                loss, metrics = loss_fn(model, mb)
                (loss * world).backward()  # FSDP averages gradients over ranks; each rank's loss is its share
                loss_sum = loss_sum + loss.detach()
                for name, v in metrics.items():
                    sums[name] = sums.get(name, 0.0) + v
            grad_norm = fsdp.grad_norm_and_clip(model, cfg.grad_clip)  # a float: the backward has run
            stepped = time.perf_counter()
            seconds["micro_batches"] += stepped - start
            if guard.take_step(
                fsdp.all_reduce(float(loss_sum)) / P, grad_norm
            ):  # global numbers: all ranks agree
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # the step's kernels (and the state's copies back) have run: this stream's, so that an engine
            # generating ahead in a thread (rollout.async_steps) is not waited for
            if layout.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            seconds["optimizer_step"] += time.perf_counter() - stepped
            grad_norms.append(grad_norm)
    out = {name: fsdp.all_reduce(float(v)) / P / len(grad_norms) for name, v in sums.items()}
    name = prefix.rstrip("/")
    out |= {f"perf/{name}_{part}_s": s for part, s in seconds.items()}
    out[f"perf/{name}_micro_batch_count"] = float(n_micro_batches)
    return out | {f"{prefix}grad_norm": sum(grad_norms) / len(grad_norms)}


def push_weights(engine, model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Streams the trainer's full parameters into this rank's engine (rollout.Engine), one at a time, LoRA
    modules merged; every rank calls it together (each parameter is all-gathered)."""
    params = fsdp.iter_full_params(model, dtype)
    scaling = next((m.scaling for m in model.modules() if isinstance(m, lora.LoRALinear)), None)
    engine.push_weights(params if scaling is None else lora.merged_params(params, scaling))
