"""dpo.py: preference optimisation (DPO, IPO, SimPO; KTO on unpaired rows) of a Hugging Face causal LM, sharded
with FSDP2.

Each optimizer step takes `data.train_batch_size` pairs (KTO: rows). Every completion's logprob is the sum of its
token logprobs (IPO and SimPO: the mean, as TRL) under the policy and under the reference, the frozen starting
model. The loss (losses.py: dpo_sigmoid_loss, ipo_loss, simpo_loss, kto_loss) is the mean over the global batch,
so gradient accumulation and the number of ranks do not change the update. The chosen and rejected completions
of a micro-batch go through one forward, packed padding-free as in sft.py.

Launch (the defaults train the toy model after SFT: configs/dpo_toy.yaml's header has the commands):
    python dpo.py --config configs/dpo_toy.yaml
    torchrun --nproc_per_node 8 dpo.py --config configs/dpo_ultrafeedback_zephyr.yaml
    torchrun --nproc_per_node 1 dpo.py --config configs/dpo_arith_words_smollm2.yaml algorithm.loss_type=ipo
Then `python shard_merge.py --ckpt-dir RUN/global_step_N --out DIR` writes a Hugging Face folder.

Data: parquet or jsonl rows. Paired (sigmoid, ipo, simpo): `prompt`, `chosen`, `rejected`, each a string or a
list of {role, content} messages (TRL's preference format). A chosen / rejected conversation that holds the user
turn too (UltraFeedback binarized, HH-RLHF as messages) is split into its prompt (every message before the last)
and its completion (the last, an assistant message); `prompt` may then be absent, and when present must equal
that prompt. Unpaired (kto): `prompt`, `completion`, `label` (true: desirable).

Reference: with LoRA the policy with its adapters off (no second copy); with full fine-tuning a second frozen
copy, as TRL's DPOTrainer makes by default; `algorithm.precompute_ref_logprobs` instead computes the reference
logprobs of every example once, before the first step (and again from the same starting weights on resume),
and keeps no copy. SimPO needs no reference.

Metrics (TRL's names and meanings, under train/ and val/): rewards/chosen and rewards/rejected, the mean implicit
reward beta * (log pi - log pi_ref) of the chosen / rejected completions (SimPO: beta * the mean token logprob);
rewards/accuracies, the share of pairs whose chosen reward is the larger (ties count as wrong); rewards/margins,
the mean of chosen minus rejected reward; logps/chosen, logps/rejected, the policy's sequence logprobs. KTO: the
rewards and logps average over the desirable / undesirable rows, margins is their difference, `kl` the clamped
KL estimate z0; no accuracies (rows are unpaired).

Where it deviates from TRL:
1. KTO's KL estimate pairs each row's prompt with the completion of row (i + n // 2) mod n of its file, fixed at
   load (TRL pairs rows within a preprocessing batch), and averages over the global batch, all ranks.
2. One optimizer step per global batch; no `padding_free` flag: packing is `model.use_remove_padding`.
3. Truncation: `data.truncation=keep_end` keeps a long prompt's last `max_prompt_length` tokens and cuts each
   completion to fit `max_length` (TRL's keep_end); the default "error" rejects the row, naming it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.distributed as dist

import actor
import checkpoint
import config
import data
import fsdp
import log
import lora
import losses
import optim

Seq = tuple[list[int], list[int]]  # (prompt ids, completion ids)


@dataclass(frozen=True)
class DPODataConfig:
    """Preference data (paired, or unpaired for KTO)."""

    train_files: str | list[str] = "runs/toy/dpo_policy/train.parquet"
    """Parquet or jsonl file(s): prompt/chosen/rejected rows (KTO: prompt/completion/label)."""
    val_files: str | list[str] | None = "runs/toy/dpo_policy/val.parquet"
    """Validation file(s) in the same layout; None disables validation."""
    prompt_key: str = "prompt"
    """Column of the prompt: a string (one user turn) or chat messages."""
    chosen_key: str = "chosen"
    """Column of the preferred completion: a string (one assistant turn) or chat messages."""
    rejected_key: str = "rejected"
    """Column of the dispreferred completion."""
    completion_key: str = "completion"
    """KTO: column of the completion."""
    label_key: str = "label"
    """KTO: column of the label, a bool (true: desirable)."""
    apply_chat_template: bool = True
    """Render through the tokenizer's chat template; without it the text is prompt + completion + eos."""
    max_prompt_length: Annotated[int, config.AT_LEAST_ONE] = 512
    """Longest prompt in tokens."""
    max_length: Annotated[int, config.AT_LEAST_ONE] = 1024
    """Longest prompt + completion in tokens."""
    truncation: Literal["error", "keep_end"] = "error"
    """A longer row: stop with an error naming it, or keep the prompt's end and cut the completions' ends."""
    skip_bad_rows: bool = False
    """Skip (and count) unusable rows instead of stopping at the first."""
    train_batch_size: Annotated[int, config.AT_LEAST_ONE] = 64
    """Global batch: pairs (KTO: rows) per optimizer step, over all ranks."""
    micro_batch_size_per_gpu: Annotated[int, config.AT_LEAST_ONE] = 8
    """Pairs (KTO: rows) per forward/backward on one rank."""
    use_dynamic_bsz: bool = False
    """Micro-batches under a token budget (`max_token_len_per_gpu`) instead of a fixed number of pairs."""
    max_token_len_per_gpu: Annotated[int, config.AT_LEAST_ONE] = 16384
    """Token budget of one micro-batch (all its sequences) when `use_dynamic_bsz` is on."""


@dataclass(frozen=True)
class DPOAlgorithmConfig:
    """The preference loss (TRL's DPOConfig / KTOConfig / CPOConfig names)."""

    loss_type: Literal["sigmoid", "ipo", "kto", "simpo"] = "sigmoid"
    """sigmoid: DPO (arXiv:2305.18290); ipo (arXiv:2310.12036); kto (arXiv:2402.01306, unpaired rows); simpo
    (arXiv:2405.14734, no reference)."""
    beta: Annotated[float, config.POSITIVE] = 0.1
    """Strength of the KL constraint (IPO's tau; SimPO's reward scale)."""
    label_smoothing: Annotated[float, config.Range(0, 0.5, high_open=True)] = 0.0
    """cDPO: the probability that a pair's label is flipped (sigmoid and simpo)."""
    simpo_gamma: Annotated[float, config.NON_NEGATIVE] = 0.5
    """SimPO's target reward margin gamma."""
    desirable_weight: Annotated[float, config.POSITIVE] = 1.0
    """KTO's lambda_D, the weight of desirable rows."""
    undesirable_weight: Annotated[float, config.POSITIVE] = 1.0
    """KTO's lambda_U, the weight of undesirable rows."""
    precompute_ref_logprobs: bool = False
    """Compute the reference logprobs of every example once before training, keeping no reference copy."""


@dataclass(frozen=True)
class DPOOptimConfig(optim.OptimConfig):
    """AdamW with warmup then cosine (the Zephyr recipe's schedule), and gradient clipping."""

    lr: Annotated[float, config.POSITIVE] = 5e-7
    """Peak learning rate."""
    warmup_steps_ratio: Annotated[float, config.UNIT] = 0.1
    """Fraction of the total steps spent warming the learning rate up linearly from 0."""
    lr_scheduler: Literal["cosine", "constant"] = "cosine"
    """Schedule after warmup."""
    weight_decay: Annotated[float, config.NON_NEGATIVE] = 0.0
    """AdamW decoupled weight decay."""
    clip_grad: Annotated[float, config.POSITIVE] = 1.0
    """Clip the global gradient norm to this (the norm before clipping is logged as train/grad_norm)."""


@dataclass(frozen=True)
class DPOTrainerConfig(config.TrainerConfig):
    """config.TrainerConfig with DPO's run folder."""

    default_local_dir: str = "runs/dpo"
    """Run folder: metrics.jsonl, config.yaml, report.md, global_step_N/ checkpoints."""
    experiment_name: str = "dpo"
    """Run name for tensorboard/wandb."""


@dataclass(frozen=True)
class DPOConfig:
    """Preference optimisation with FSDP2 (see the module docstring)."""

    data: DPODataConfig = field(default_factory=DPODataConfig)
    model: actor.ModelConfig = field(default_factory=lambda: actor.ModelConfig(path="runs/demo/sft_hf"))
    algorithm: DPOAlgorithmConfig = field(default_factory=DPOAlgorithmConfig)
    optim: DPOOptimConfig = field(default_factory=DPOOptimConfig)
    trainer: DPOTrainerConfig = field(default_factory=DPOTrainerConfig)


# ------------------------------------------------------------------------------------------------ data


def _turns(row: data.Row, key: str, role: str) -> list[dict]:
    """row[key] as chat messages: a string becomes one `role` turn; a list must hold {role, content} strings."""
    value = row.get(key)
    if value is None:
        raise data.BadRow(row, key, "missing_key", f"row has columns {sorted(row)}")
    if isinstance(value, str):
        if not value.strip():
            raise data.BadRow(row, key, "empty", f"{value!r}")
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        want = "a string or a non-empty list of {role, content} messages"
        raise data.BadRow(row, key, "bad_type", f"want {want}, got {value!r:.60}")
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise data.BadRow(row, key, "bad_messages", f"message {j} is not {{role, content}}: {m!r:.60}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def split_row(row: data.Row, prompt_key: str, keys: list[str]) -> tuple[list[dict], list[list[dict]]]:
    """(prompt messages, one completion's messages per key) of a row, as the module docstring describes."""
    convs = [_turns(row, k, "assistant") for k in keys]
    full = [any(m["role"] != "assistant" for m in c) for c in convs]
    if not any(full):
        return _turns(row, prompt_key, "user"), convs
    prompts = []
    for k, c, f in zip(keys, convs, full, strict=True):
        if not f or len(c) < 2 or c[-1]["role"] != "assistant":
            raise data.BadRow(
                row,
                k,
                "bad_messages",
                "a conversation must end in an assistant turn after the prompt's turns",
            )
        prompts.append(c[:-1])
    if any(p != prompts[0] for p in prompts):
        raise data.BadRow(row, keys[1], "prompt_mismatch", f"its prompt turns differ from {keys[0]!r}'s")
    if row.get(prompt_key) is not None and _turns(row, prompt_key, "user") != prompts[0]:
        raise data.BadRow(
            row, prompt_key, "prompt_mismatch", f"differs from the prompt turns inside {keys[0]!r}"
        )
    return prompts[0], [c[-1:] for c in convs]


class PreferenceDataset:
    """Token ids of preference rows, tokenised up front.

    Attributes:
        examples: [{"prompt": ids, "completions": [ids, ...] (chosen, rejected; KTO: the completion), "label":
            bool or None, "kl": KTO's mismatched completion ids or None, "origin"}].
        skipped: {reason: count} with skip_bad_rows; truncated: rows cut under truncation=keep_end; pad_id.
    Raises:
        data.BadRow "FILE row I: key 'K': reason: detail" for the first unusable row (without skip_bad_rows).
    """

    def __init__(self, paths: str | list[str], tokenizer, cfg: DPODataConfig, kto: bool):
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; completions end with eos")
        self.tok, self.cfg, self.kto = tokenizer, cfg, kto
        self.pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self.skipped: dict[str, int] = {}
        self.truncated = 0
        self.examples: list[dict] = []
        for row in data.load_rows(paths):
            try:
                self.examples.append(self._example(row))
            except data.BadRow as e:
                if not cfg.skip_bad_rows:
                    raise
                self.skipped[e.reason] = self.skipped.get(e.reason, 0) + 1
        if not self.examples:
            raise ValueError(f"{paths}: no usable rows (skipped: {self.skipped})")
        n = len(self.examples)
        for i, e in enumerate(self.examples):  # KTO's mismatched pair (deviation 1)
            other = self.examples[(i + n // 2) % n]["completions"][0]
            e["kl"] = other[: cfg.max_length - len(e["prompt"])] if kto else None

    def _encode(self, text: str) -> list[int]:
        # add_special_tokens=False: the chat template already wrote any BOS / special tokens into the text.
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def _example(self, row: data.Row) -> dict:
        cfg = self.cfg
        keys = [cfg.completion_key] if self.kto else [cfg.chosen_key, cfg.rejected_key]
        label = None
        if self.kto:
            label = row.get(cfg.label_key)
            if not isinstance(label, bool):
                raise data.BadRow(row, cfg.label_key, "bad_label", f"want true or false, got {label!r:.40}")
        if cfg.apply_chat_template:
            prompt, convs = split_row(row, cfg.prompt_key, keys)
            head = self.tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            prompt_ids, completions = self._encode(head), []
            for k, c in zip(keys, convs, strict=True):
                text = self.tok.apply_chat_template(prompt + c, tokenize=False, add_generation_prompt=False)
                if not text.startswith(head):
                    raise data.BadRow(
                        row, k, "template_not_prefix", "the prompt's rendering does not start it"
                    )
                ids = self._encode(text[len(head) :])
                eos = [j for j, t in enumerate(ids) if t == self.tok.eos_token_id]
                completions.append(
                    ids[: eos[-1] + 1] if eos else ids
                )  # the template's text after eos is dropped
        else:
            texts = [row.get(k) for k in [cfg.prompt_key, *keys]]
            for k, t in zip([cfg.prompt_key, *keys], texts, strict=True):
                if not isinstance(t, str) or not t.strip():
                    raise data.BadRow(row, k, "bad_type", f"want a non-empty string, got {t!r:.60}")
            prompt_ids = self._encode(texts[0])
            completions = [self._encode(t) + [self.tok.eos_token_id] for t in texts[1:]]
        longest = len(prompt_ids) + max(len(c) for c in completions)
        if len(prompt_ids) > cfg.max_prompt_length or longest > cfg.max_length:
            if cfg.truncation == "error":
                detail = f"{len(prompt_ids)} prompt tokens, {longest} in all"
                limits = f"max_prompt_length {cfg.max_prompt_length}, max_length {cfg.max_length}"
                raise data.BadRow(row, keys[0], "too_long", f"{detail} > {limits}")
            prompt_ids = prompt_ids[-cfg.max_prompt_length :]
            completions = [c[: cfg.max_length - len(prompt_ids)] for c in completions]
            self.truncated += 1
        if not all(completions):
            raise data.BadRow(row, keys[0], "empty", "a completion has no tokens")
        return dict(prompt=prompt_ids, completions=completions, label=label, kl=None, origin=row.origin)

    def __len__(self) -> int:
        return len(self.examples)

    def seqs(self, i: int) -> list[Seq]:
        """The sequences of example i the loss reads (chosen, rejected; KTO: the completion, then its KL pair)."""
        e = self.examples[i]
        return [(e["prompt"], c) for c in e["completions"]] + ([(e["prompt"], e["kl"])] if self.kto else [])

    def tokens(self, i: int) -> int:
        return sum(len(p) + len(c) for p, c in self.seqs(i))


# ------------------------------------------------------------------------------------------- passes


def sequence_logps(model: torch.nn.Module, seqs: list[Seq], layout: actor.Layout) -> torch.Tensor:
    """Summed completion-token logprobs [S] of `seqs`, all in one forward (packed or padded: `layout`)."""
    samples = [actor.Sample(p, c, None, "", 0) for p, c in seqs]
    inputs = actor.collate(samples, layout)  # [[pad]] when empty: the forward still runs (FSDP's collectives)
    lp = losses.forward_logprobs(model, inputs, inputs["labels"], with_raw=False)[0]  # [B, T]
    if not seqs:
        return lp.sum()[None] * 0  # [1]: touches every parameter, adds nothing
    rows = actor.response_matrix(lp, inputs["response_index"], [len(c) for _, c in seqs])  # [S, R]
    return rows.sum(-1)  # [S]


def share(ds: PreferenceDataset, indices: list[int], cfg: DPODataConfig) -> list[list[int]]:
    """This rank's share of a global batch as micro-batches of example indices (every rank gets the same count)."""
    d = dist.get_rank(), dist.get_world_size()
    mine = data.split_for_rank(indices, d[0], d[1], lengths=[ds.tokens(i) for i in indices])
    lengths = [ds.tokens(i) for i in mine]
    kw = dict(max_token_len=cfg.max_token_len_per_gpu) if cfg.use_dynamic_bsz else {}
    kw = kw or dict(micro_batch_size=cfg.micro_batch_size_per_gpu)
    n = int(fsdp.all_reduce(len(data.micro_batches(lengths, **kw)), "max"))
    return [[mine[j] for j in g] for g in data.micro_batches(lengths, **kw, min_num=n)]


@torch.no_grad()
def reference_logps(
    ref: torch.Tensor | torch.nn.Module, ds: PreferenceDataset, groups: list[list[int]], layout: actor.Layout
) -> dict[int, torch.Tensor]:
    """{example: its sequences' reference logprobs [k]} for the examples of `groups`: rows of a precomputed
    table [n, k], or a no-grad pass of the reference model (the policy with its LoRA adapters off: lora.disabled
    does nothing to a model without them)."""
    if isinstance(ref, torch.Tensor):
        return {i: ref[i] for g in groups for i in g}
    out = {}
    ref.eval()
    for g in groups:
        with lora.disabled(ref):
            lp = sequence_logps(ref, [s for i in g for s in ds.seqs(i)], layout).cpu()
        k = len(ds.seqs(g[0])) if g else 0
        out |= {i: lp[j * k : (j + 1) * k] for j, i in enumerate(g)}
    return out


def batches(n: int, size: int) -> list[list[int]]:
    """0..n-1 in batches of `size`; a last one too small to give every rank an example joins the one before."""
    out = [list(range(s, min(n, s + size))) for s in range(0, n, size)]
    if len(out) > 1 and len(out[-1]) < dist.get_world_size():
        out[-2] += out.pop()
    return out


def precompute_reference(
    ref: torch.nn.Module, ds: PreferenceDataset, cfg: DPODataConfig, layout: actor.Layout
) -> torch.Tensor:
    """The reference logprobs of every example's sequences, [n, k], on every rank (each computes a share)."""
    table = torch.zeros(len(ds), len(ds.seqs(0)), dtype=torch.float64)
    for idx in batches(len(ds), cfg.train_batch_size):
        for i, lp in reference_logps(ref, ds, share(ds, idx, cfg), layout).items():
            table[i] = lp.double()
    table = table.to(fsdp.comm_device())
    dist.all_reduce(table)  # each example was computed on one rank, zeros elsewhere
    return table.float().cpu()


SUMS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "n_chosen",
    "n_rejected",
)
"""What run_batch adds up over micro-batches and ranks, in the order of its one all-reduce."""


def loss_terms(
    logps: torch.Tensor, ref_logps: torch.Tensor | None, labels: list, kl: float, alg: DPOAlgorithmConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed loss of a micro-batch's pairs (KTO: rows) and its metric sums (SUMS, detached).

    logps, ref_logps: [S] sequence logprobs, chosen and rejected interleaved (KTO: one a row); labels: KTO's."""
    if alg.loss_type == "kto":
        desirable = torch.tensor(labels, device=logps.device)  # [B]
        loss = losses.kto_loss(
            logps, ref_logps, desirable, kl, alg.beta, alg.desirable_weight, alg.undesirable_weight
        )
        rewards = alg.beta * (logps - ref_logps).detach()  # [B]
        good, bad = desirable.float(), (~desirable).float()
        sums = {
            "rewards/chosen": (rewards * good).sum(),
            "rewards/rejected": (rewards * bad).sum(),
            "logps/chosen": (logps.detach() * good).sum(),
            "logps/rejected": (logps.detach() * bad).sum(),
            "n_chosen": good.sum(),
            "n_rejected": bad.sum(),
            "rewards/accuracies": torch.zeros(()),  # unpaired: no accuracy; the margin is taken of the means
            "rewards/margins": torch.zeros(()),
        }
        return loss.sum(), sums | {"loss": loss.detach().sum()}
    chosen, rejected = logps[0::2], logps[1::2]  # [P]
    if alg.loss_type == "simpo":
        loss = losses.simpo_loss(chosen, rejected, alg.beta, alg.simpo_gamma, alg.label_smoothing)
        r_chosen, r_rejected = alg.beta * chosen.detach(), alg.beta * rejected.detach()
    else:
        ref_chosen, ref_rejected = ref_logps[0::2], ref_logps[1::2]
        if alg.loss_type == "ipo":
            loss = losses.ipo_loss(chosen, rejected, ref_chosen, ref_rejected, alg.beta)
        else:
            loss = losses.dpo_sigmoid_loss(
                chosen, rejected, ref_chosen, ref_rejected, alg.beta, alg.label_smoothing
            )
        r_chosen = alg.beta * (chosen - ref_chosen).detach()  # [P]
        r_rejected = alg.beta * (rejected - ref_rejected).detach()
    sums = {
        "loss": loss.detach().sum(),
        "rewards/chosen": r_chosen.sum(),
        "rewards/rejected": r_rejected.sum(),
        "rewards/accuracies": (r_chosen > r_rejected).float().sum(),
        "rewards/margins": (r_chosen - r_rejected).sum(),
        "logps/chosen": chosen.detach().sum(),
        "logps/rejected": rejected.detach().sum(),
        "n_chosen": torch.tensor(float(len(chosen))),
        "n_rejected": torch.tensor(float(len(rejected))),
    }
    return loss.sum(), sums


def run_batch(
    model: torch.nn.Module,
    ref: torch.Tensor | torch.nn.Module | None,
    ds: PreferenceDataset,
    indices: list[int],
    cfg: DPOConfig,
    layout: actor.Layout,
    train: bool,
) -> dict[str, float]:
    """One global batch on every rank: reference logprobs, KTO's KL estimate, then each micro-batch's loss
    (with `train`, its backward: the gradient of the batch's mean loss). Returns the batch's metrics, global means.

    ref: a precomputed table [n, k], the reference model, or None (SimPO)."""
    alg, world, n = cfg.algorithm, dist.get_world_size(), len(indices)
    kto = alg.loss_type == "kto"
    groups = share(ds, indices, cfg.data)
    refs = reference_logps(ref, ds, groups, layout) if ref is not None else {}
    kl = 0.0
    if kto:  # z0 = max(0, the batch mean of log pi(y'|x) - log pi_ref(y'|x)) over the mismatched pairs
        model.eval()
        kl_sum = 0.0
        for g in groups:
            with torch.no_grad():
                lp = sequence_logps(model, [ds.seqs(i)[1] for i in g], layout).cpu()  # [B]
            kl_sum += float((lp - torch.stack([refs[i][1] for i in g])).sum()) if g else 0.0
        kl = max(0.0, fsdp.all_reduce(kl_sum) / n)
    model.train(train)
    sums = torch.zeros(len(SUMS), dtype=torch.float64)
    for k, g in enumerate(groups):
        if train:
            model.set_requires_gradient_sync(k == len(groups) - 1)  # reduce-scatter once per step
        seqs = [s for i in g for s in ds.seqs(i)[: 1 if kto else 2]]
        with torch.set_grad_enabled(train):
            logps = sequence_logps(model, seqs, layout)  # [S]
            if not g:  # this rank has no example left: an empty pass keeps FSDP's collectives paired
                if train:
                    logps.sum().backward()
                continue
            lengths = torch.tensor([float(len(c)) for _, c in seqs], device=logps.device)  # [S]
            norm = lengths if alg.loss_type in ("ipo", "simpo") else 1.0  # TRL's per-token mean for these
            ref_logps = None
            if refs:
                ref_logps = torch.cat([refs[i][: len(seqs) // len(g)] for i in g]).to(logps.device) / norm
            loss_sum, terms = loss_terms(
                logps / norm, ref_logps, [ds.examples[i]["label"] for i in g], kl, alg
            )
            if train:  # this micro-batch's share of the global mean; FSDP averages gradients over the ranks
                (loss_sum * world / n).backward()
        sums += torch.stack([terms[name].double().cpu() for name in SUMS])
    model.eval()
    total = sums.to(fsdp.comm_device())
    dist.all_reduce(total)
    got = dict(zip(SUMS, total.tolist(), strict=True))
    out = {"loss": got["loss"] / n}
    for side in ("chosen", "rejected"):
        for what in ("rewards", "logps"):
            out[f"{what}/{side}"] = got[f"{what}/{side}"] / max(got[f"n_{side}"], 1.0)
    if kto:  # unpaired rows: no accuracy; the margin of the means
        return out | {"rewards/margins": out["rewards/chosen"] - out["rewards/rejected"], "kl": kl}
    return out | {
        "rewards/accuracies": got["rewards/accuracies"] / n,
        "rewards/margins": got["rewards/margins"] / n,
    }


def validate(
    model: torch.nn.Module, ref, ds: PreferenceDataset, cfg: DPOConfig, layout: actor.Layout
) -> dict[str, float]:
    """run_batch's metrics over the whole validation set (`batches` of data.train_batch_size, weighted by size)."""
    out: dict[str, float] = {}
    for idx in batches(len(ds), cfg.data.train_batch_size):
        for k, v in run_batch(model, ref, ds, idx, cfg, layout, train=False).items():
            out[k] = out.get(k, 0.0) + v * len(idx) / len(ds)
    return {f"val/{k}": v for k, v in out.items()}


def memory_settings(cfg: DPOConfig) -> dict[str, object]:
    """The flags that decide training memory, with their values, for fsdp.explain_oom's message."""
    batch = (
        {"data.max_token_len_per_gpu": cfg.data.max_token_len_per_gpu}
        if cfg.data.use_dynamic_bsz
        else {"data.micro_batch_size_per_gpu": cfg.data.micro_batch_size_per_gpu}
    )
    return batch | {
        "data.max_length": cfg.data.max_length,
        "model.enable_gradient_checkpointing": cfg.model.enable_gradient_checkpointing,
        "algorithm.precompute_ref_logprobs": cfg.algorithm.precompute_ref_logprobs,
    }


def main(cfg: DPOConfig) -> dict[str, float]:
    """Trains; returns the final metrics (train/loss, val/loss_before, val/rewards/accuracies, ...)."""
    from transformers import AutoTokenizer

    if cfg.model.fsdp_config.ulysses_sequence_parallel_size > 1:
        raise SystemExit(
            "error: model.fsdp_config.ulysses_sequence_parallel_size="
            f"{cfg.model.fsdp_config.ulysses_sequence_parallel_size}: dpo.py has no sequence parallelism yet; set 1"
        )
    # a flatrl checkpoint (an SFT run's RUN/global_step_N) is loaded from its exported Hugging Face folder
    cfg = replace(cfg, model=replace(cfg.model, path=checkpoint.as_hf_model(cfg.model.path)))
    d = fsdp.init_distributed(cfg.trainer.timeout_s)
    fsdp.seed_everything(cfg.trainer.seed)
    run_dir = Path(cfg.trainer.default_local_dir).expanduser()
    path = os.path.expanduser(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    kto = cfg.algorithm.loss_type == "kto"
    train_ds = PreferenceDataset(cfg.data.train_files, tokenizer, cfg.data, kto)
    val_ds = PreferenceDataset(cfg.data.val_files, tokenizer, cfg.data, kto) if cfg.data.val_files else None
    for name, ds in (("training", train_ds), ("validation", val_ds)):
        if ds is not None and (ds.skipped or ds.truncated):
            fsdp.print0(f"{name} rows: skipped {ds.skipped}, truncated {ds.truncated}")
    layout = actor.Layout(cfg.model.use_remove_padding, train_ds.pad_id, d.device)

    model, hf_files = actor.load(cfg.model, d.device)
    hf_files["tokenizer"] = tokenizer
    # The reference: none (SimPO); tables from the starting weights, computed before any checkpoint loads; the
    # policy with its adapters off (LoRA); or a second frozen copy (full fine-tuning).
    ref = val_ref = None
    if cfg.algorithm.loss_type != "simpo":
        if cfg.algorithm.precompute_ref_logprobs:
            t0 = time.perf_counter()
            ref = precompute_reference(model, train_ds, cfg.data, layout)
            val_ref = precompute_reference(model, val_ds, cfg.data, layout) if val_ds is not None else None
            fsdp.print0(f"reference logprobs of {len(train_ds)} examples in {time.perf_counter() - t0:.1f} s")
        else:
            ref = val_ref = actor.load_reference(cfg.model, model, d.device)
    sampler = data.EpochSampler(len(train_ds), cfg.data.train_batch_size, seed=cfg.trainer.seed)
    total_steps = cfg.trainer.total_training_steps
    if total_steps is None:
        total_steps = cfg.trainer.total_epochs * sampler.steps_per_epoch
    optimizer, scheduler = optim.build(model.parameters(), cfg.optim, total_steps)
    guard = optim.SkipGuard(cfg.trainer.max_consecutive_skips)

    step, results = 0, {}
    resume = checkpoint.resolve_resume(run_dir, cfg.trainer.resume_mode)
    if resume is not None:
        checkpoint.check_resume_config(resume, config.to_dict(cfg), cfg.trainer.resume_allow_changes)
        state = checkpoint.load_checkpoint(resume, model, optimizer)
        step, results = checkpoint.restore_trainer_state(state, sampler, scheduler, guard)
        fsdp.print0(f"resumed from {resume} at step {step}")

    logger = log.Logger(
        run_dir,
        cfg.trainer.logger,
        rank=d.rank,
        total_steps=total_steps,
        project=cfg.trainer.project_name,
        experiment=cfg.trainer.experiment_name,
        config=config.to_dict(cfg),
        keep_until_step=step if resume is not None else -1,
    )
    if d.is_main:
        log.write_run_files(run_dir, config.to_yaml(cfg))
    if val_ds is not None and step == 0:
        before = validate(model, val_ref, val_ds, cfg, layout)
        results |= {k.replace("val/", "val_before/"): v for k, v in before.items()}
        logger.log(before, step=0)

    def save() -> None:
        state = checkpoint.trainer_state(cfg, sampler, scheduler, guard, results)
        checkpoint.save_checkpoint(
            run_dir, step, model, optimizer, state, hf_files, keep_last=cfg.trainer.max_ckpt_to_keep
        )

    it = iter(sampler)
    while step < total_steps:
        t0 = time.perf_counter()
        try:
            indices = next(it)
        except StopIteration:  # the sampler moved on to the next epoch
            it = iter(sampler)
            indices = next(it)
        with fsdp.explain_oom(f"dpo step {step + 1}", memory_settings(cfg)):
            # reference logprobs (a pass, or the table), KTO's KL estimate, then forward + backward per micro-batch
            batch = run_batch(model, ref, train_ds, indices, cfg, layout, train=True)
            grad_norm = fsdp.grad_norm_and_clip(model, cfg.optim.clip_grad)
            lr = scheduler.get_last_lr()[0]
            if guard.take_step(batch["loss"], grad_norm):  # both are global: every rank decides the same
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        if cfg.trainer.debug:
            fsdp.print0(f"debug step {step}: loss {batch['loss']:.4f}, grad_norm {grad_norm:.4f}")
        elapsed = time.perf_counter() - t0
        seen = fsdp.all_reduce(sum(train_ds.tokens(i) for i in indices)) / d.world_size
        metrics = {f"train/{k}": v for k, v in batch.items()} | {
            "train/grad_norm": grad_norm,
            "train/skipped_steps": guard.skipped,
            "train/lr": lr,
            "train/epoch": sampler.state_dict()["epoch"],
            "perf/tokens_per_s": seen / elapsed,
            "timing_s/step": elapsed,
        }
        if torch.cuda.is_available():
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        last = step == total_steps
        if val_ds is not None and (last or (cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0)):
            metrics |= validate(model, val_ref, val_ds, cfg, layout)
        logger.log(metrics, step=step)
        results.update({k: v for k, v in metrics.items() if k.startswith("val/") or k == "train/loss"})
        if guard.stop or last or (cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0):
            save()
        if guard.stop:
            logger.close()
            raise RuntimeError(
                f"step {step}: the loss or gradient norm was NaN/inf in the last {guard.consecutive} steps in a "
                f"row (trainer.max_consecutive_skips={cfg.trainer.max_consecutive_skips}); none of them updated "
                f"the weights. Look at the data of those steps or lower optim.lr, then resume from {run_dir}."
            )
    logger.close()
    results["global_step"] = step
    log.write_report(run_dir, config.to_yaml(cfg), results, rank=d.rank)  # RUN/report.md, rank 0
    return results


if __name__ == "__main__":
    fsdp.run_main(main, config.parse(DPOConfig))
