"""rollout.name="hf": transformers' generate on an unsharded copy of the model, behind rollout.Engine.

For tiny models and CPU runs without vLLM, and the reference the vLLM engine is tested against: the same
contract (rollout.py's docstring: token ids in, Samples grouped per prompt out, raw temperature-1 logprobs for the
prompts `rollout.check_prompt_indices` picks, a per-rank seed, every blocking call under `rollout.timeout_s`),
with none of vLLM's speed. Long calls (a whole validation set) run in chunks of `rollout.hf_chunk_size` sequences.
rollout.make_engine builds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

import fsdp
import rollout
import watchdog


class HFEngine:
    """transformers' generate on an unsharded copy of the model: VLLMEngine's interface and logprob semantics."""

    def __init__(
        self,
        cfg: rollout.RolloutConfig,
        model_path: str,
        max_model_len: int,
        rank: int,
        eos: list[int],
        hf_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        self.cfg, self.eos, self.max_model_len = cfg, eos, max_model_len
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = getattr(torch, cfg.dtype) if cuda else torch.float32
        config = AutoConfig.from_pretrained(model_path)
        fsdp.override_config(config, hf_overrides or {}, say=False)  # the trainer's load said what it set
        model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=dtype)
        self.model = model.to(self.device).eval()
        pad = self.model.config.pad_token_id
        self.pad = pad if pad is not None else eos[0]
        # Neutral defaults: the checkpoint's (top_k=20, repetition penalty...) must not leak into sampling.
        self.model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=self.pad)
        # generate() draws from the global RNG: this engine's state is swapped in around each call.
        self.rng_state = torch.Generator(self.device).manual_seed(cfg.seed + rank).get_state()
        self.on_host = False

    @contextlib.contextmanager
    def _own_rng(self) -> Iterator[None]:
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            (torch.cuda.set_rng_state if cuda else torch.set_rng_state)(self.rng_state)
            yield
            self.rng_state = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: rollout.SamplingConfig,
        max_tokens: int,
        seed: int | None = None,
        probes: bool = False,
    ) -> list[rollout.Completion]:
        """VLLMEngine.generate's contract. The prompts run in chunks of at most `cfg.hf_chunk_size` sequences
        (a prompt's n samples stay together), each one left-padded `generate` call under its own deadline: the
        prompts whose samples carry logprobs first (only those calls keep the raw logits, chunk x tokens x vocab
        floats), then the rest; the probes (`probes`), if any, last. With a seed, the call's chunks draw in turn
        from one generator seeded with it."""
        self.wake_up()
        if seed is not None:
            self.rng_state = torch.Generator(self.device).manual_seed(seed).get_state()
        checked = set(rollout.check_prompt_indices(len(prompts), self.cfg.logprob_check_prompts))
        probed = sorted(checked) if probes and rollout.uses_probes(self.cfg) else []
        if probed:
            checked = set()  # the rollouts carry no logprobs; the probes do
        order = sorted(range(len(prompts)), key=lambda i: i not in checked)  # stable: checked prompts first
        per_chunk = max(1, self.cfg.hf_chunk_size // sampling.n)
        by_prompt: dict[int, list[rollout.Completion]] = {}
        for start in range(0, len(order), per_chunk):
            chunk = order[start : start + per_chunk]
            want_lp = any(i in checked for i in chunk)
            new, logprobs = self._generate_chunk([prompts[i] for i in chunk], sampling, max_tokens, want_lp)
            for r, tokens in enumerate(new):
                i = chunk[r // sampling.n]  # as vLLM: logprobs for the checked prompts' rollouts only
                row = logprobs[r] if i in checked else None
                by_prompt.setdefault(i, []).append(self._completion(i, tokens, row))
        out = [sample for i in range(len(prompts)) for sample in by_prompt[i]]  # grouped per prompt, in order
        for start in range(0, len(probed), self.cfg.hf_chunk_size):
            chunk = probed[start : start + self.cfg.hf_chunk_size]
            one = dataclasses.replace(sampling, n=1)
            tokens = min(max_tokens, self.cfg.logprob_check_tokens)
            new, logprobs = self._generate_chunk([prompts[i] for i in chunk], one, tokens, True)
            for r, i in enumerate(chunk):
                out.append(self._completion(i, new[r], logprobs[r], probe=True))
        return out

    def _completion(
        self, i: int, tokens: list[int], logprobs: torch.Tensor | None, probe: bool = False
    ) -> rollout.Completion:
        """Prompt i's Completion from one row of new tokens (padded after eos) and its logprobs [R] or None."""
        stop = next((t for t, tok in enumerate(tokens) if tok in self.eos), None)
        end = len(tokens) if stop is None else stop + 1
        reason = "length" if stop is None else "stop"
        lp = None if logprobs is None else logprobs[:end].tolist()
        return rollout.Completion(i, tokens[:end], lp, reason, probe)

    def _generate_chunk(
        self, prompts: list[list[int]], sampling: rollout.SamplingConfig, max_tokens: int, want_lp: bool
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """One `generate` call holding each prompt n times: (new tokens per row, padded after eos; their raw
        temperature-1 logprobs [B, R] when want_lp, else None)."""
        from transformers import GenerationConfig

        rows = [p for p in prompts for _ in range(sampling.n)]  # grouped per prompt
        width = max(len(p) for p in rows)
        if (max_new := min(max_tokens, self.max_model_len - width)) <= 0:
            raise ValueError(f"rollout: a {width}-token prompt leaves no room within max_model_len")
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)  # [B, P]
        mask = torch.zeros_like(ids)  # [B, P]
        for r, p in enumerate(rows):
            ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
        greedy = sampling.greedy
        gen_cfg = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy or sampling.top_k <= 0 else sampling.top_k,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            output_logits=want_lp,  # the raw logits, before temperature/top-k/top-p
            return_dict_in_generate=True,
        )
        with watchdog.deadline("generate", self.cfg.timeout_s), self._own_rng():
            out = self.model.generate(
                ids.to(self.device), attention_mask=mask.to(self.device), generation_config=gen_cfg
            )
        new = out.sequences[:, width:]  # [B, R]
        if not want_lp:
            return new.cpu().tolist(), None
        logprobs = torch.stack(
            [
                torch.log_softmax(lg.float(), -1).gather(-1, new[:, t, None])[:, 0]
                for t, lg in enumerate(out.logits)
            ],
            1,
        ).cpu()  # [B, R]
        return new.cpu().tolist(), logprobs

    @torch.no_grad()
    def push_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies the streamed tensors in, strictly: an unknown or a missing name is an error."""
        params = dict(self.model.named_parameters())  # a tied lm_head appears once, as the embedding
        seen = set()
        with watchdog.deadline("push_weights", self.cfg.timeout_s):
            for name, tensor in named_params:
                if name not in params:
                    raise KeyError(f"rollout: push_weights got {name!r}, which the model does not have")
                params[name].copy_(tensor)
                seen.add(name)
        if missing := set(params) - seen:
            raise ValueError(
                f"rollout: push_weights missed {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )

    def sleep(self, level: int | None = None) -> None:
        """Moves the copy to host memory (CUDA with free_cache_engine only); `level` is vLLM's, and this copy's
        weights are always kept."""
        if self.cfg.free_cache_engine and self.device.type == "cuda" and not self.on_host:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.on_host = True

    def wake_up(self) -> None:
        """Moves the copy back to its device."""
        if self.on_host:
            self.model.to(self.device)
            self.on_host = False

    def pop_call_seconds(self) -> dict[str, float]:
        """VLLMEngine's split of generate()'s time; this engine has none to report (perf/gen_*_s stay absent)."""
        return {}

    def shutdown(self) -> None:
        """Frees the copy."""
        del self.model
        gc.collect()
