"""What runs inside vLLM's worker for flatrl (rollout.py starts the engine and calls these): the choice of weight-push
method, the push itself, the filters for vLLM warnings known to be harmless (rollout.py's note 9), and, with
`rollout.engine_process`, the `WorkerExtension` whose methods vLLM mixes into a worker in another process.

No vLLM import here: these functions receive vLLM's worker object. In-process, `collective_rpc(fn)` runs them in
this process; in the engine's own process vLLM imports this module by the name in `worker_extension_cls`.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

# vLLM logger -> start of the messages dropped from it (note 9). Each is harmless in flatrl, for the reason given.
HARMLESS_VLLM_WARNINGS: dict[str, tuple[str, ...]] = {
    "vllm.model_executor.model_loader.reload.layerwise": (
        # A tied lm_head gets no tensor of its own (it is the embedding; _push re-processes it; an untied one
        # left out fails push_weights' name check), and rotary tables are buffers, not checkpoint tensors: vLLM
        # keeps their values. rollout/logprob_diff_* checks the pushed weights every step.
        "ParallelLMHead: Failed to load weights",
        "RotaryEmbedding: Failed to load weights",
    ),
    "vllm.renderers.base": (
        # The engine starts with skip_tokenizer_init and takes token ids: vLLM's chat rendering is never used.
        "Chat template warmup failed",
        # Stop tokens are passed in every request (stop_token_ids), never read from a tokenizer.
        "Using None for EOS token id because tokenizer is not initialized",
    ),
}


class DropMessages(logging.Filter):
    """Drops the records whose message starts with one of `prefixes` (a traceback attached to one goes too)."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def quiet_known_harmless() -> None:
    """Adds the HARMLESS_VLLM_WARNINGS filters to vLLM's loggers, once per process."""
    for name, prefixes in HARMLESS_VLLM_WARNINGS.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in log.filters):
            log.addFilter(DropMessages(prefixes))


def choose_push_method(worker: Any) -> str:
    """Runs in the vLLM worker: 'load_weights' if the model takes checkpoint tensors as is, else 'reload_weights'."""
    model = worker.model_runner.model
    if worker.model_config.quantization is None and all(p.numel() > 0 for p in model.parameters()):
        return "load_weights"
    reload = getattr(worker, "reload_weights", None)
    # Old vLLMs' reload_weights() took no tensors and re-read the checkpoint from disk: stale weights, never that.
    if reload is not None:
        if (
            "weights_iterator"
            in inspect.signature(getattr(worker.model_runner, "reload_weights", reload)).parameters
        ):
            return "reload_weights"
    raise RuntimeError(
        "rollout: this vLLM has no in-memory weight update for this model (repacked/quantised)"
    )


def load_pushed(worker: Any, method: str, weights: Iterator[tuple[str, torch.Tensor]], tied: bool) -> None:
    """Runs in the vLLM worker: streams `weights` into the model with the method chosen at start."""
    model = worker.model_runner.model
    if method == "load_weights":
        model.load_weights(weights)
    else:
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    head = getattr(model, "lm_head", None)
    if tied and hasattr(head, "quant_method"):
        # A tied lm_head shares the embedding's Parameter but gets no tensor of its own, so its post-load step
        # does not rerun: on CPU that step packs the weight for oneDNN, and the logits kept using the OLD
        # embedding (measured here: 1.4 nats off after a push). Rerun it; on CUDA it is a no-op.
        head.quant_method.process_weights_after_loading(head)


# Most bytes one push RPC carries with rollout.engine_process (rollout.VLLMEngine._push_buckets): bounds the
# extra copy each side holds while the engine core's process loads a bucket (verl's CUDA-IPC weight sync buckets
# its transfers the same way).
PUSH_BUCKET_BYTES = 256 << 20
# Byte offsets of the tensors in a bucket are multiples of this (of every dtype's size), so .view(dtype) works.
PUSH_ALIGN = 64


def bucket_views(buf: torch.Tensor, meta: list[list[Any]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors in a push bucket: `buf` is its bytes [N] uint8, a meta row is [name, dtype, shape, offset]."""
    out = []
    for name, dtype, shape, offset in meta:
        dt = getattr(torch, dtype.removeprefix("torch."))
        nbytes = math.prod(shape) * dt.itemsize
        out.append((name, buf[offset : offset + nbytes].view(dt).view(shape)))
    return out


class WorkerExtension:
    """Methods vLLM mixes into its worker (EngineArgs.worker_extension_cls) when the engine core runs in its own
    process (rollout.engine_process): `llm.collective_rpc("flatrl_...", args=...)` calls them by name, so no
    function is pickled (vLLM would need VLLM_ALLOW_INSECURE_SERIALIZATION=1 for that). Arguments arrive through
    vLLM's msgpack: lists, not tuples, and no tensors; a push bucket comes as bytes (CPU) or as offsets into a
    CUDA buffer shared once through an IPC handle (`flatrl_map_buffer`)."""

    def flatrl_setup(self, tied: bool) -> str:
        """Filters vLLM's known-harmless warnings in this process too; returns the push method (choose_push_method)."""
        quiet_known_harmless()
        self.flatrl_tied = tied
        self.flatrl_buffer: torch.Tensor | None = None  # the shared CUDA bucket, once mapped
        # reload_weights takes the whole model in one call: the buckets wait here until the final one.
        self.flatrl_pending: list[tuple[str, torch.Tensor]] = []
        self.flatrl_method = choose_push_method(self)
        return self.flatrl_method

    def flatrl_map_buffer(self, handle: list[Any]) -> None:
        """Maps the trainer's CUDA bucket: `handle` is its storage's `_share_cuda_()` tuple (as a list)."""
        storage = torch.UntypedStorage._new_shared_cuda(*handle)
        buf = torch.empty(0, dtype=torch.uint8, device=storage.device)
        self.flatrl_buffer = buf.set_(storage, 0, (storage.nbytes(),), (1,))  # [N]

    def flatrl_load_bucket(self, meta: list[list[Any]], data: bytes, first: bool, final: bool) -> None:
        """Loads one push bucket: from `data` (CPU), else from the mapped CUDA buffer, which the trainer filled
        and synchronised before this call. load_weights takes each bucket as it comes; reload_weights (vLLM's
        layerwise reload wants a layer's tensors in one call) gets all of them with the final bucket."""
        if self.flatrl_buffer is not None:
            tensors = bucket_views(self.flatrl_buffer, meta)
            if self.flatrl_method != "load_weights":
                tensors = [(n, t.clone()) for n, t in tensors]  # the trainer refills the buffer next
        else:
            tensors = bucket_views(torch.frombuffer(bytearray(data), dtype=torch.uint8), meta) if meta else []
        if first:  # a push that failed half-way left its buckets here
            self.flatrl_pending = []
        try:
            if self.flatrl_method == "load_weights":
                load_pushed(self, "load_weights", iter(tensors), self.flatrl_tied and final)
            else:
                self.flatrl_pending += tensors
                if final:
                    load_pushed(self, self.flatrl_method, iter(self.flatrl_pending), self.flatrl_tied)
            if self.flatrl_buffer is not None:
                torch.cuda.synchronize()  # copies out of the buffer done before the trainer overwrites it
        finally:
            if final or self.flatrl_method == "load_weights":
                self.flatrl_pending = []
