"""Data for flatrl: rows from files, token ids and loss masks, batches, and the model's input tensors.

sft.py uses SFTDataset, grpo.py / ppo.py RLDataset; all use EpochSampler, split_for_rank, micro_batches and
one of the two collation layouts.

1. `load_rows`: parquet or JSON lines, files concatenated, `~` expanded; each `Row` (a dict) keeps `.origin`
   ("FILE row I (line L)"), which starts every error about it. Missing/unreadable/empty files are errors.
2. `SFTDataset`: prompt/response rows or `messages` chat rows -> {"input_ids", "loss_mask", "origin"}, where
   loss_mask[t] == 1 marks input_ids[t] as a target predicted from positions < t (`shift_labels`). Targets are
   each assistant turn's content plus its eos (Qwen's <|im_end|>); the turn header and the template's text
   after eos are context. Boundaries come from rendering prefixes of the conversation and tokenising each
   rendered segment on its own; a template whose prefix rendering is not a prefix of the next is an error.
   verl's nested layout works too: `prompt_key=extra_info, prompt_dict_keys=[question]` reads
   row["extra_info"]["question"] (verl's GSM8K SFT examples).
3. `RLDataset`: verl's RL schema (`data_source`, `prompt` as chat messages or a string column,
   `reward_model: {style, ground_truth}`, `extra_info`) -> {"prompt_ids", "raw_prompt", "data_source",
   "ground_truth", "extra_info", "origin"}. With a custom reward function (`custom_reward=True`) data_source
   and reward_model.ground_truth may be missing: the example then carries None for them.
4. `EpochSampler`: a seeded permutation per epoch cut into global batches, resumable from {epoch, batch};
   `split_for_rank` gives each rank its share; `micro_batches` cuts a share by count or by token budget.
5. `pad_batch`: right-padded [B, T]. `pack_batch`: padding-free [1, N] with position ids restarting per
   sequence and a 4-D block-diagonal causal mask [1, 1, N, N], which transformers 5.19 uses as given
   (masking_utils._preprocess_mask_arguments): bool (True = attend) for attn_implementation="sdpa", the float
   additive form (mask_dtype=torch.float32) for "eager", which adds the mask to the scores (a bool mask there
   is silently wrong: 0.28 max logprob error on the test model). The N x N mask is the portable path: O(N^2)
   memory (64 MiB as bool at N = 8192) and no kernel skips masked blocks. Measured on the test model, packed
   and padded logprobs agree exactly (sdpa bool, eager float). Position ids alone (attention_mask=None) are
   0.30 off under the default use_cache=True (transformers skips its packed-sequence detection when a cache
   exists) and exact with use_cache=False.
   `pack_batch(mask_dtype=None)` is the GPU layout: no N x N mask, only `cu_seqlens` and `max_seqlen`;
   `model_inputs` turns it into flash-attention-style keyword arguments (`cu_seq_lens_q`, ...), which
   attention.py's `VARLEN` attention feeds to torch's variable-length flash kernel (O(N) memory, masked blocks
   skipped). Any other attention implementation still gets it right from the restarting position ids.

Deviations from verl:
1. verl's SFT loss mask is aligned with the logits (position t predicts t + 1); ours with the tokens.
2. verl masks whole assistant messages in multi-turn SFT; we mask content + eos, not the header or the "\\n"
   after eos: exactly what the policy generates at RL time. Context after the last target is dropped.
3. verl left-pads RL prompts in the dataset; we keep id lists (vLLM takes lists) and filter or reject
   overlong prompts, never truncate them.
4. verl shuffles with one torch.Generator across epochs and resumes a stateful dataloader; we reseed with
   seed + epoch, so {epoch, batch} is the whole resume state.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
import torch

_PARQUET = (".parquet", ".pq")
_JSONL = (".jsonl", ".json", ".jsonlines", ".json-lines", ".ndjson")


class Row(dict):
    """A data row (a dict of columns) that remembers where it came from, for error messages."""

    origin: str = "<unknown>"


class BadRow(ValueError):
    """A row that cannot be used; `reason` is what SFTDataset.skipped counts."""

    def __init__(self, row: Row, key: str, reason: str, detail: str):
        super().__init__(f"{row.origin}: key {key!r}: {reason}: {detail}")
        self.reason = reason


def _check_unicode(row: Row, value: object = None, key: str = "") -> None:
    """BadRow (reason bad_text) naming the key of the first string holding a lone surrogate, such as JSON's
    "\\ud800": valid JSON, but not Unicode text, and the tokenizer fails on it with a TypeError naming nothing."""
    value = row if value is None and not key else value
    if isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(row, v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_unicode(row, v, f"{key}[{i}]")
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = value[e.start].encode("unicode_escape").decode()
            raise BadRow(row, key, "bad_text", f"a lone surrogate {bad} at character {e.start}") from None


def _read_jsonl(path: Path) -> list[tuple[int, object]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text, so not JSON lines ({e})") from e
    out = []
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: bad JSON on line {lineno}: {e.msg}") from e
    return out


def load_rows(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Row]:
    """Read parquet / JSON-lines files into one list of rows, in file order.

    Args:
        paths: one path or several; `~` is expanded; the format follows the extension.
    Returns:
        rows; row.origin is "FILE row I" (I counts from 0 within the file), plus "(line L)" for JSON lines.
    Raises:
        ValueError naming the file (and row or line): missing file, unknown extension, unreadable parquet,
        bad JSON, a line that is not an object, a file with no rows.
    """
    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not paths:
        raise ValueError("no data files given")
    rows: list[Row] = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file():
            raise ValueError(f"data file {path} does not exist (or is not a file)")
        if path.suffix.lower() in _PARQUET:
            try:
                items = [(None, r) for r in pq.read_table(path).to_pylist()]
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{path}: not a readable parquet file ({e})") from e
        elif path.suffix.lower() in _JSONL:
            items = _read_jsonl(path)
        else:
            raise ValueError(f"{path}: unknown data file extension {path.suffix!r} (want .parquet or .jsonl)")
        if not items:
            raise ValueError(f"{path}: no rows (empty data file)")
        for i, (lineno, obj) in enumerate(items):
            row = Row(obj) if isinstance(obj, dict) else None
            where = f"{path} row {i}" + ("" if lineno is None else f" (line {lineno})")
            if row is None:
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            row.origin = where
            rows.append(row)
    return rows


def _render(
    tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: Mapping | None = None
) -> str:
    """The chat template's text; `template_kwargs` reach the template (verl's data.apply_chat_template_kwargs,
    such as Qwen3's enable_thinking)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
    )


def unread_template_kwargs(tokenizer, template_kwargs: Mapping | None) -> list[str]:
    """One note per key of `template_kwargs` whose name the tokenizer's chat template never mentions: passing it
    changes nothing (Jinja ignores unknown variables), so the scripts say so rather than drop it silently."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates ({"default": ..., "tool_use": ...})
        template = "\n".join(str(t) for t in template.values())
    text = template if isinstance(template, str) else ""
    where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    return [
        f"note: data.apply_chat_template_kwargs.{k} is ignored: the chat template of {where} never reads {k}"
        for k in (template_kwargs or {})
        if not re.search(rf"\b{re.escape(str(k))}\b", text)
    ]


def _encode(tokenizer, text: str) -> list[int]:
    # add_special_tokens=False: the chat template already wrote any BOS / special tokens into the text.
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _check_messages(row: Row, key: str) -> list[dict]:
    msgs = row[key]
    if not isinstance(msgs, list) or not msgs:
        raise BadRow(row, key, "bad_messages", f"want a list of {{role, content}}, got {msgs!r:.60}")
    for j, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRow(row, key, "bad_messages", f"message {j} is not {{role, content}}: {m!r:.60}")
        if m["role"] == "assistant" and not m["content"]:
            raise BadRow(row, key, "empty_response", f"assistant message {j} is empty")
    if not any(m["role"] == "assistant" for m in msgs):
        raise BadRow(row, key, "no_assistant_turn", "no message with role 'assistant'")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def conversation_tokens(
    tokenizer, messages: list[dict], row: Row, key: str, template_kwargs: Mapping | None = None
) -> tuple[list[int], list[int]]:
    """Token ids and target mask of a chat, rendered turn by turn with the tokenizer's chat template (and
    `template_kwargs`).

    Targets (1): each assistant turn's tokens up to and including the last eos in its segment (the whole
    segment if it has no eos). Everything else is context (0); context after the last target is dropped.
    Returns:
        (input_ids, loss_mask), equal-length lists.
    """
    ids: list[int] = []
    mask: list[int] = []
    prev = ""
    for i, m in enumerate(messages):
        text = _render(tokenizer, messages[: i + 1], False, template_kwargs)
        head = _render(tokenizer, messages[:i], True, template_kwargs) if m["role"] == "assistant" else text
        if not (head.startswith(prev) and text.startswith(head)):
            raise BadRow(
                row, key, "template_not_prefix", f"rendering turns 0..{i} does not extend 0..{i - 1}"
            )
        ctx = _encode(tokenizer, head[len(prev) :])
        seg = _encode(tokenizer, text[len(head) :])  # assistant content + end of turn; empty for other roles
        n_target = max((j + 1 for j, t in enumerate(seg) if t == tokenizer.eos_token_id), default=len(seg))
        ids += ctx + seg
        mask += [0] * len(ctx) + [1] * n_target + [0] * (len(seg) - n_target)
        prev = text
    end = max(t for t, v in enumerate(mask) if v) + 1
    return ids[:end], mask[:end]


class _Examples:
    examples: list[dict]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        return self.examples[i]


class SFTDataset(_Examples):
    """Supervised fine-tuning examples, tokenised up front.

    Args:
        paths: data files (see load_rows).
        tokenizer: a Hugging Face tokenizer with an eos token (and a chat template if apply_chat_template).
        prompt_key, response_key: string columns of prompt/response rows.
        prompt_dict_keys, response_dict_keys: keys to follow inside those columns (verl's layout): with
            prompt_key="extra_info" and prompt_dict_keys=["question"] the prompt is row["extra_info"]["question"].
        messages_key: column of [{role, content}, ...]; a row where it is non-null is a chat row.
        apply_chat_template: render a prompt row as one user turn and one assistant turn; without it the text
            is prompt + response + eos. Chat rows need the template.
        max_length: tokens per example after truncation.
        truncation: "right" cuts the end, "left" the beginning, "error" rejects an overlong row.
        chat_template_kwargs: passed to the chat template (verl's data.apply_chat_template_kwargs).
        skip_bad_rows: skip and count unusable rows (missing key, empty or non-string prompt or response, bad
            messages, too long under truncation="error") instead of raising.
    Attributes:
        examples: [{"input_ids": list[int], "loss_mask": list[int], "origin": str}]; lengths: tokens of each.
        skipped: {reason: count}; truncated: how many examples were cut to max_length; pad_id: for pad_batch.
    """

    def __init__(
        self,
        paths: str | Sequence[str],
        tokenizer,
        prompt_key: str = "prompt",
        response_key: str = "response",
        prompt_dict_keys: Sequence[str] | None = None,
        response_dict_keys: Sequence[str] | None = None,
        messages_key: str | None = "messages",
        apply_chat_template: bool = True,
        max_length: int = 1024,
        truncation: Literal["left", "right", "error"] = "error",
        skip_bad_rows: bool = False,
        chat_template_kwargs: Mapping | None = None,
    ):
        if truncation not in ("left", "right", "error"):
            raise ValueError(f"truncation must be 'left', 'right' or 'error', got {truncation!r}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; SFT targets end with eos")
        self.tok, self.prompt_key, self.response_key = tokenizer, prompt_key, response_key
        self.prompt_path, self.response_path = list(prompt_dict_keys or []), list(response_dict_keys or [])
        # Any id works for padding (attention and loss masks exclude it); eos when the tokenizer has no pad.
        self.pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self.messages_key, self.apply_chat_template = messages_key, apply_chat_template
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.max_length, self.truncation = max_length, truncation
        self.skipped: dict[str, int] = {}
        self.truncated = 0
        self.examples = []
        for row in load_rows(paths):
            try:
                _check_unicode(row)
                self.examples.append(self._example(row))
            except BadRow as e:
                if not skip_bad_rows:
                    raise
                self.skipped[e.reason] = self.skipped.get(e.reason, 0) + 1
        if not self.examples:
            raise ValueError(f"{paths}: no usable rows (skipped: {self.skipped})")
        self.lengths = [len(e["input_ids"]) for e in self.examples]

    def _string(self, row: Row, key: str, path: list[str]) -> tuple[str, str]:
        """The text at row[key][path[0]][path[1]]..., and the dotted name of where it was read."""
        if row.get(key) is None:
            raise BadRow(row, key, "missing_key", f"row has columns {sorted(row)}")
        value, name = row[key], key
        for k in path:
            if not isinstance(value, dict) or value.get(k) is None:
                have = sorted(value) if isinstance(value, dict) else type(value).__name__
                raise BadRow(row, f"{name}.{k}", "missing_key", f"{name} has {have}")
            value, name = value[k], f"{name}.{k}"
        if not isinstance(value, str):
            raise BadRow(row, name, "not_a_string", f"got {type(value).__name__}")
        return value, name

    def _example(self, row: Row) -> dict:
        if self.messages_key is not None and row.get(self.messages_key) is not None:
            key = self.messages_key
            if not self.apply_chat_template:
                raise ValueError(f"{row.origin}: chat rows ({key!r}) need apply_chat_template=True")
            ids, mask = conversation_tokens(
                self.tok, _check_messages(row, key), row, key, self.template_kwargs
            )
        else:
            prompt, prompt_name = self._string(row, self.prompt_key, self.prompt_path)
            response, key = self._string(row, self.response_key, self.response_path)
            if not prompt.strip():
                raise BadRow(row, prompt_name, "empty_prompt", f"prompt is {prompt!r}")
            if not response.strip():
                raise BadRow(row, key, "empty_response", f"response is {response!r}")
            if self.apply_chat_template:
                chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
                ids, mask = conversation_tokens(self.tok, chat, row, key, self.template_kwargs)
            else:
                p, r = _encode(self.tok, prompt), _encode(self.tok, response) + [self.tok.eos_token_id]
                ids, mask = p + r, [0] * len(p) + [1] * len(r)
        if len(ids) > self.max_length:
            if self.truncation == "error":
                raise BadRow(row, key, "too_long", f"{len(ids)} tokens > max_length {self.max_length}")
            L = self.max_length
            ids, mask = (ids[:L], mask[:L]) if self.truncation == "right" else (ids[-L:], mask[-L:])
            self.truncated += 1
        if not any(mask[1:]):  # token 0 has no context, so it is never predicted
            raise BadRow(row, key, "truncated_away", f"no target left after {self.truncation} truncation")
        return {"input_ids": ids, "loss_mask": mask, "origin": row.origin}


class RLDataset(_Examples):
    """RL prompts in verl's schema.

    Args:
        paths: data files (see load_rows).
        tokenizer: a Hugging Face tokenizer (with a chat template if apply_chat_template).
        prompt_key: a column of chat messages (verl) or of strings (e.g. GSM8K's "question": one user turn).
        max_prompt_length: tokens; a longer prompt is dropped (filter_overlong_prompts), else cut as
            `truncation` says: "left" keeps its end, "right" its start, "middle" both ends (verl's), "error" stops.
        apply_chat_template: render with add_generation_prompt=True; without it a string prompt is used as is.
        skip_bad_rows: skip and count unusable rows instead of raising (see `skipped`).
        custom_reward: a custom reward function scores the responses (custom_reward_function.path): rows may
            lack data_source and reward_model.ground_truth, and their examples carry None for them.
        chat_template_kwargs: passed to the chat template (verl's data.apply_chat_template_kwargs).
    Attributes:
        examples: [{"prompt_ids", "raw_prompt", "data_source", "ground_truth", "extra_info", "origin"}].
        dropped_overlong: prompts dropped for length; truncated: prompts cut to it.
        skipped: {reason: count} of rows skipped with skip_bad_rows: missing_key (the prompt, data_source or
            reward_model.ground_truth), bad_prompt (wrong type, malformed messages), empty_prompt, too_long.
    Raises:
        data.BadRow (a ValueError) "FILE row I: key 'K': reason: detail" for the first unusable row.
    """

    def __init__(
        self,
        paths: str | Sequence[str],
        tokenizer,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        apply_chat_template: bool = True,
        filter_overlong_prompts: bool = True,
        skip_bad_rows: bool = False,
        custom_reward: bool = False,
        truncation: Literal["error", "left", "right", "middle"] = "error",
        chat_template_kwargs: Mapping | None = None,
    ):
        if truncation not in ("error", "left", "right", "middle"):
            raise ValueError(f"truncation must be 'error', 'left', 'right' or 'middle', got {truncation!r}")
        self.tok, self.prompt_key, self.max_prompt_length = tokenizer, prompt_key, max_prompt_length
        self.truncation, self.truncated = truncation, 0
        self.custom_reward = custom_reward
        self.apply_chat_template, self.filter_overlong_prompts = apply_chat_template, filter_overlong_prompts
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.dropped_overlong = 0
        self.skipped: dict[str, int] = {}
        self.examples = []
        for row in load_rows(paths):
            try:
                _check_unicode(row)
                ex = self._example(row)
            except BadRow as e:
                if not skip_bad_rows:
                    raise
                self.skipped[e.reason] = self.skipped.get(e.reason, 0) + 1
                continue
            if ex is not None:
                self.examples.append(ex)
        if not self.examples:
            raise ValueError(
                f"{paths}: no prompts left ({self.dropped_overlong} over {max_prompt_length} tokens, "
                f"skipped: {self.skipped})"
            )

    def _example(self, row: Row) -> dict | None:
        """The example of one row; None when it is dropped for length."""
        key, prompt, rm = self.prompt_key, row.get(self.prompt_key), row.get("reward_model")
        if prompt is None:
            raise BadRow(row, key, "missing_key", f"row has columns {sorted(row)}")
        if isinstance(prompt, str):
            chat = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt and self.apply_chat_template:
            chat = _check_prompt_messages(row, key)
        else:
            what = "chat messages (with apply_chat_template)" if self.apply_chat_template else "a string"
            raise BadRow(row, key, "bad_prompt", f"want {what}, got {prompt!r:.60}")
        if not any(m["content"].strip() for m in chat):
            raise BadRow(row, key, "empty_prompt", f"no text in {prompt!r:.60}")
        ground_truth = rm.get("ground_truth") if isinstance(rm, dict) else None
        if ground_truth is None and not self.custom_reward:
            raise BadRow(row, "reward_model.ground_truth", "missing_key", f"reward_model is {rm!r:.60}")
        if row.get("data_source") is None and not self.custom_reward:
            raise BadRow(
                row,
                "data_source",
                "missing_key",
                "rewards dispatch on it (or give custom_reward_function.path)",
            )
        raw = _render(self.tok, chat, True, self.template_kwargs) if self.apply_chat_template else prompt
        ids = _encode(self.tok, raw)
        L = self.max_prompt_length
        if len(ids) > L:
            if self.filter_overlong_prompts:
                self.dropped_overlong += 1
                return None
            if self.truncation == "error":
                raise BadRow(row, key, "too_long", f"{len(ids)} tokens > max_prompt_length {L}")
            self.truncated += 1  # the raw prompt (the reward function's) stays whole, as verl's does
            cut = {
                "left": ids[-L:],
                "right": ids[:L],
                "middle": ids[: L // 2] + ids[len(ids) - (L - L // 2) :],
            }
            ids = cut[self.truncation]
        return dict(
            prompt_ids=ids,
            raw_prompt=raw,
            data_source=row.get("data_source"),
            ground_truth=ground_truth,
            extra_info=row.get("extra_info") or {},
            origin=row.origin,
        )


def _check_prompt_messages(row: Row, key: str) -> list[dict]:
    msgs = row[key]
    for j, m in enumerate(msgs):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRow(row, key, "bad_prompt", f"message {j} is not {{role, content}}: {m!r:.60}")
    return msgs  # as given: a template may use other keys of a message


class EpochSampler:
    """Global batches of dataset indices, one seeded permutation per epoch, resumable.

    Epoch e's order is torch.randperm(n) under torch.Generator().manual_seed(seed + e): independent of the
    global RNG and of the world size; with shuffle=False it is the rows' own order, 0..n-1, every epoch.
    `for batch in sampler` yields the rest of the current epoch and leaves the sampler at the next one; the state
    advances as each batch is handed out, so state_dict() after k batches resumes with batch k.
    """

    def __init__(self, n: int, batch_size: int, seed: int, drop_last: bool = True, shuffle: bool = True):
        if batch_size < 1 or n < (batch_size if drop_last else 1):
            raise ValueError(f"cannot draw batches of {batch_size} from {n} examples (drop_last={drop_last})")
        self.n, self.batch_size, self.seed, self.drop_last = n, batch_size, seed, drop_last
        self.shuffle = shuffle
        self.epoch, self.batch = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.batch_size if self.drop_last else math.ceil(self.n / self.batch_size)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All batches of one epoch, in order."""
        if self.shuffle:
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        else:
            perm = list(range(self.n))
        return [perm[i * self.batch_size : (i + 1) * self.batch_size] for i in range(self.steps_per_epoch)]

    def __iter__(self) -> Iterator[list[int]]:
        epoch, batches = self.epoch, self.epoch_batches(self.epoch)
        for i in range(self.batch, len(batches)):
            self.epoch, self.batch = (epoch, i + 1) if i + 1 < len(batches) else (epoch + 1, 0)
            yield batches[i]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not 0 <= state["batch"] < self.steps_per_epoch:
            raise ValueError(f"sampler state {state} out of range ({self.steps_per_epoch} batches per epoch)")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])


def _greedy(
    lengths: Sequence[int], k: int, sizes: list[int] | None = None, budget: int | None = None
) -> list[list[int]] | None:
    """Longest first into k bins: the least-loaded bin with room (under `sizes`), or with a budget the first
    bin it fits in (first-fit decreasing, which packs tighter). Returns None when something does not fit."""
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        room = [b for b in range(k) if sizes is None or len(bins[b]) < sizes[b]]
        if budget is not None:
            room = [b for b in room if not bins[b] or loads[b] + lengths[i] <= budget][:1]
            if not room:
                return None
        b = min(room, key=lambda b: (loads[b], b))
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins


def split_for_rank(
    indices: Sequence[int], rank: int, world_size: int, lengths: Sequence[int] | None = None
) -> list[int]:
    """This rank's share of a global batch: len(indices) // world_size items or one more.

    Without lengths the shares are contiguous slices; with lengths (lengths[j] = tokens of indices[j]) they
    are balanced by token count (greedy longest-first under the same counts). Deterministic, so ranks agree
    without communicating. Returns a sublist of indices in their original order.
    """
    n = len(indices)
    if n < world_size:
        raise ValueError(f"a batch of {n} cannot give each of {world_size} ranks an item")
    bounds = [r * n // world_size for r in range(world_size + 1)]
    if lengths is None:
        return list(indices[bounds[rank] : bounds[rank + 1]])
    if len(lengths) != n:
        raise ValueError(f"{len(lengths)} lengths for {n} indices")
    sizes = [bounds[r + 1] - bounds[r] for r in range(world_size)]
    return [indices[j] for j in sorted(_greedy(lengths, world_size, sizes=sizes)[rank])]


def micro_batches(
    lengths: Sequence[int],
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    min_num: int = 1,
) -> list[list[int]]:
    """Cut one rank's batch into micro-batches: lists of positions into `lengths`.

    Args:
        lengths: tokens per sequence.
        micro_batch_size: consecutive chunks of this many (the last one smaller).
        max_token_len: a token budget per micro-batch instead: the fewest bins that greedy longest-first
            balancing (else first-fit decreasing) fills within budget; a longer sequence sits alone.
        min_num: at least this many micro-batches, e.g. the max over ranks (all-reduced) so every FSDP rank
            runs the same number of forwards. Those past len(lengths) are empty lists: the trainer must still
            run a forward for them (e.g. one pad token with mask 0) to keep the collectives paired.
    Returns:
        micro-batches, each sorted, together covering every position once. Deterministic.
    """
    if (micro_batch_size is None) == (max_token_len is None):
        raise ValueError("set exactly one of micro_batch_size and max_token_len")
    n = len(lengths)
    if micro_batch_size is not None:
        if math.ceil(n / micro_batch_size) >= min_num:
            return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]
        k = min(min_num, n)  # split further, evenly
        chunks = [list(range(b * n // k, (b + 1) * n // k)) for b in range(k)]
        return chunks + [[] for _ in range(min_num - k)]
    # Lower bound on the count: one bin per oversize sequence, the rest at a full budget each.
    over = [x for x in lengths if x > max_token_len]
    k = min(n, max(len(over) + math.ceil((sum(lengths) - sum(over)) / max_token_len), min_num))
    while True:  # terminates: at k == n every sequence sits alone
        for bins in (_greedy(lengths, k), _greedy(lengths, k, budget=max_token_len)):
            if bins and all(b and (len(b) == 1 or sum(lengths[i] for i in b) <= max_token_len) for b in bins):
                return sorted(sorted(b) for b in bins) + [[] for _ in range(min_num - k)]
        k += 1


def _check_pairs(seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]]) -> None:
    if (
        len(seqs) != len(masks)
        or not seqs
        or any(len(s) != len(m) or not s for s, m in zip(seqs, masks, strict=True))
    ):
        raise ValueError("seqs and masks must pair up, each pair non-empty and of equal length")


def pad_batch(
    seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded batch.

    Returns:
        input_ids [B, T] long (pad_id after each sequence), attention_mask [B, T] long (1 = token),
        position_ids [B, T] long (0..len-1, 0 on padding), loss_mask [B, T] float32 (0 on padding).
    """
    _check_pairs(seqs, masks)
    B, T = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros(B, T, dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros(B, T, dtype=torch.float32)  # [B, T]
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
        loss_mask[i, : len(s)] = torch.tensor(m, dtype=torch.float32)
    position_ids = (torch.arange(T)[None] * attention_mask).long()  # [B, T]
    return dict(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, loss_mask=loss_mask
    )


def packed_mask_dtype(device: torch.device) -> torch.dtype | None:
    """pack_batch's mask_dtype for training on `device`: None on CUDA (no N x N mask; attention.VARLEN runs torch's
    varlen kernel over cu_seqlens), torch.bool elsewhere (sdpa with the block-diagonal mask). A dense mask on CUDA
    makes attention quadratic in the whole packed row."""
    return None if device.type == "cuda" else torch.bool


def pack_batch(
    seqs: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
    mask_dtype: torch.dtype | None = torch.bool,
) -> dict[str, torch.Tensor]:
    """Padding-free batch: the S sequences concatenated into one row of N tokens.

    Args:
        mask_dtype: torch.bool (True = attend) for sdpa; a float dtype gives the additive form (0, or the
            dtype's min where masked) that eager attention needs; None builds no N x N mask at all (the
            variable-length attention layout for GPUs: see `model_inputs`).
    Returns:
        input_ids [1, N] long, position_ids [1, N] long (restarting at 0 per sequence), loss_mask [1, N] float32,
        cu_seqlens [S + 1] int32 (sequence starts, then N), max_seqlen [] long (the longest sequence), and
        unless mask_dtype is None attention_mask [1, 1, N, N] block-diagonal causal.
    """
    _check_pairs(seqs, masks)
    lens = torch.tensor([len(s) for s in seqs])  # [S]
    n = int(lens.sum())
    seq_id = torch.repeat_interleave(torch.arange(len(seqs)), lens)  # [N]
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lens, 0).int()])  # [S + 1]
    out = {
        "input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.long)[None],  # [1, N]
        "position_ids": (torch.arange(n) - cu_seqlens[:-1].long()[seq_id])[None],  # [1, N]
        "loss_mask": torch.tensor([v for m in masks for v in m], dtype=torch.float32)[None],  # [1, N]
        "cu_seqlens": cu_seqlens,
        "max_seqlen": lens.max(),  # [], a tensor so that collating moves it with the rest
    }
    if mask_dtype is None:
        return out
    allowed = (seq_id[:, None] == seq_id[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()  # [N, N]
    if mask_dtype != torch.bool:
        allowed = torch.zeros(n, n, dtype=mask_dtype).masked_fill(~allowed, torch.finfo(mask_dtype).min)
    return out | {"attention_mask": allowed[None, None]}  # [1, 1, N, N]


def model_inputs(batch: dict[str, torch.Tensor]) -> dict:
    """Keyword arguments for a Hugging Face model's forward on a batch of either layout.

    Padded or packed with its N x N mask: input_ids, attention_mask, position_ids. Packed without the mask
    (pack_batch(mask_dtype=None)): attention_mask=None plus transformers' flash-attention keyword arguments
    cu_seq_lens_q/k [S + 1] int32 and max_length_q/k (ints: a max_seqlen on the device costs a sync per call,
    so actor.collate leaves it on the host).
    """
    if "attention_mask" in batch:
        return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    cu, longest = batch["cu_seqlens"], int(batch["max_seqlen"])
    return dict(
        input_ids=batch["input_ids"], attention_mask=None, position_ids=batch["position_ids"],
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest,
    )  # fmt: skip


def shift_labels(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets for either layout: logits[:, t] scores labels[:, t] = input_ids[:, t + 1].

    label_mask[:, t] = loss_mask[:, t + 1], zeroed where t + 1 starts a sequence (position_ids == 0) so no packed
    target is predicted across a boundary; the last column is 0.
    Returns:
        labels [B, T] long, label_mask [B, T] float32. NLL = -(logprobs.gather(labels) * label_mask).sum().
    """
    ids, loss_mask, pos = batch["input_ids"], batch["loss_mask"], batch["position_ids"]
    labels = torch.zeros_like(ids)  # [B, T]
    labels[:, :-1] = ids[:, 1:]
    label_mask = torch.zeros_like(loss_mask, dtype=torch.float32)  # [B, T]
    label_mask[:, :-1] = loss_mask[:, 1:] * (pos[:, 1:] != 0)
    return labels, label_mask


def split_sequences(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Per-sequence 1-D slices of a per-token tensor (e.g. logprobs [B, T] or [1, N]) in either layout."""
    if "cu_seqlens" in batch:
        return list(torch.split(values[0], batch["cu_seqlens"].diff().tolist()))
    return [values[i, :n] for i, n in enumerate(batch["attention_mask"].sum(-1).tolist())]
