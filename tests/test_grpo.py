"""grpo.py: the advantage estimators by hand and against verl's formulas; end-to-end 2-rank runs on the toy."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import grpo
import losses

torch.set_num_threads(1)


def test_grpo_advantages_by_hand():
    # group 0: scores 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3); group 1: all 1 (no signal);
    # group 2: a group of one (no baseline: 0)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.7])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    std = math.sqrt(1 / 3)
    a = 0.5 / (std + 1e-6)
    want = [a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(grpo.group_advantages(scores, groups), torch.tensor(want))
    # Dr. GRPO: no division by the std
    want = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(grpo.group_advantages(scores, groups, norm_by_std=False), torch.tensor(want))


def test_rloo_by_hand():
    # group of 3 with scores 1, 0, 0: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice)
    scores = torch.tensor([1.0, 0.0, 0.0, 5.0])
    groups = torch.tensor([3, 3, 3, 4])
    torch.testing.assert_close(grpo.rloo_advantages(scores, groups), torch.tensor([1.0, -0.5, -0.5, 0.0]))


def test_reinforce_plus_plus_whitens_over_tokens():
    # scores 1 (3 tokens) and 0 (1 token): token values 1, 1, 1, 0 -> mean 0.75, unbiased var 0.25
    adv = grpo.whiten_by_tokens(torch.tensor([1.0, 0.0]), torch.tensor([3, 1]))
    s = (0.25 + 1e-8) ** 0.5
    torch.testing.assert_close(adv, torch.tensor([0.25 / s, -0.75 / s]))


def verl_grpo(scores: torch.Tensor, index: list[int], norm: bool, eps: float = 1e-6) -> torch.Tensor:
    """verl's compute_grpo_outcome_advantage, per element (groups of >= 2)."""
    out = scores.clone()
    for i in range(len(scores)):
        same = torch.tensor([scores[j].item() for j in range(len(scores)) if index[j] == index[i]])
        out[i] = (scores[i] - same.mean()) / (same.std() + eps) if norm else scores[i] - same.mean()
    return out


def verl_rloo(scores: torch.Tensor, index: list[int]) -> torch.Tensor:
    out = scores.clone()
    for i in range(len(scores)):
        same = [scores[j].item() for j in range(len(scores)) if index[j] == index[i]]
        n = len(same)
        out[i] = scores[i] * n / (n - 1) - sum(same) / n * n / (n - 1)
    return out


def test_estimators_match_verls_formulas_on_random_groups():
    g = torch.Generator().manual_seed(0)
    index = [k for k in range(7) for _ in range(5)]  # 7 prompts x 5 responses
    scores = torch.randint(0, 3, (35,), generator=g).float() / 2  # ties and zero-variance groups occur
    groups = torch.tensor(index)
    for norm in (True, False):
        torch.testing.assert_close(
            grpo.group_advantages(scores, groups, norm_by_std=norm),
            verl_grpo(scores, index, norm),
            atol=1e-6,
            rtol=0,
        )
    torch.testing.assert_close(
        grpo.rloo_advantages(scores, groups), verl_rloo(scores, index), atol=1e-6, rtol=0
    )
    # REINFORCE++ (outcome reward, gamma 1): every token of a response carries its score, whitened over tokens
    lengths = torch.randint(1, 9, (35,), generator=g)
    T = int(lengths.max())
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    token_scores = scores[:, None] * mask
    verl = losses.masked_whiten(token_scores, mask) * mask  # verl: returns = scores on every token, whitened
    ours = grpo.whiten_by_tokens(scores, lengths)[:, None] * mask
    torch.testing.assert_close(ours, verl, atol=1e-6, rtol=0)


def test_a_lone_sample_and_an_all_equal_group_give_no_signal():
    adv = grpo.group_advantages(torch.tensor([3.0, 2.0, 2.0]), torch.tensor([0, 1, 1]))
    assert adv.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_compute_advantages_sets_one_number_per_sample(estimator):
    import actor
    import fsdp

    fsdp.init_distributed()  # a one-process group: REINFORCE++ all-reduces its token statistics
    samples = [
        actor.Sample([1], [2] * (k + 1), [0.0] * (k + 1), "stop", k // 2, score=float(k % 2))
        for k in range(4)
    ]
    grpo.compute_advantages(samples, grpo.AlgorithmConfig(adv_estimator=estimator))
    adv = [s.advantages for s in samples]
    assert all(isinstance(a, float) for a in adv)
    assert adv[1] > 0 > adv[0] and adv[3] > 0 > adv[2]  # the rewarded response of each pair is preferred


def _tiny_policy(
    path, device: torch.device, checkpointing: bool = False, lr: float = 1e-2, layers: str | int = "all"
):
    """The conftest's one-layer Qwen2 (`tiny_qwen2`) loaded as grpo.py loads a policy (FSDP2 over the one rank),
    with its AdamW and schedule."""
    import actor
    import optim

    model_cfg = actor.ModelConfig(
        path=str(path), enable_gradient_checkpointing=checkpointing, gradient_checkpointing_layers=layers
    )
    model, _ = actor.load(model_cfg, device)
    optimizer, scheduler = optim.build(model.parameters(), optim.OptimConfig(lr=lr), total_steps=4)
    return model, optimizer, scheduler


def _random_samples() -> list:
    """4 prompts x 2 responses of random lengths (tokens < 64), GRPO advantages of +-1."""
    import actor

    gen = torch.Generator().manual_seed(1)
    samples = []
    for g in range(4):
        for k in range(2):
            L = int(torch.randint(3, 9, (1,), generator=gen))
            ids = torch.randint(1, 64, (5 + L,), generator=gen).tolist()
            samples.append(actor.Sample(ids[:5], ids[5:], None, "stop", g, advantages=1.0 if k else -1.0))
    return samples


def _update(model, optimizer, samples, cfg, device, check=None, steps: int = 1) -> dict:
    """`steps` calls of grpo.py's update (actor.update with grpo.policy_loss) on the 4 prompts of _random_samples."""
    import functools

    import actor
    import optim

    layout = actor.Layout(True, 0, device)
    loss_fn = functools.partial(grpo.policy_loss, cfg=cfg, check=check)
    for _ in range(steps):
        m = actor.update(model, optimizer, optim.SkipGuard(5), samples, 4, cfg.actor, layout, loss_fn)
    return m


def _grpo_cfg(temperature: float = 1.0, **actor_kw) -> grpo.GRPOConfig:
    import actor
    import rl
    import rollout

    kw = dict(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=3) | actor_kw
    return grpo.GRPOConfig(
        data=rl.RLDataConfig(max_response_length=8),
        actor=actor.ActorConfig(**kw),
        rollout=rollout.RolloutConfig(temperature=temperature),
    )


@pytest.mark.parametrize(("mini_batch", "epochs", "expected"), [(4, 1, 3), (4, 2, 6), (2, 1, 4)])
def test_update_reports_its_micro_batches_and_its_parts(one_rank, tiny_qwen2, mini_batch, epochs, expected):
    """actor.update says how many micro-batches ran (8 samples of 4 prompts, 3 a micro-batch: 3 for one mini-batch
    of 4 prompts, 2 + 2 for two of 2, times ppo_epochs) and the seconds of their forwards and backwards and of the
    optimizer steps, for bench_e2e's update_parts_s."""
    model, optimizer, _ = _tiny_policy(tiny_qwen2, one_rank.device)
    cfg = _grpo_cfg(ppo_mini_batch_size=mini_batch, ppo_epochs=epochs)
    m = _update(model, optimizer, _random_samples(), cfg, one_rank.device)
    assert m["perf/actor_micro_batch_count"] == expected
    assert 0 < m["perf/actor_optimizer_step_s"] < 60 and 0 < m["perf/actor_micro_batches_s"] < 60


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_old_logprobs_from_the_update_match_a_separate_pass(one_rank, tiny_qwen2, temperature) -> None:
    """One optimizer step over the batch: taking the old logprobs from the update's own forward (detached, ratio
    1) moves the weights as the separate old-logprob pass does, and that forward's push check (|trainer - engine|
    at temperature 1 over the samples with the engine's logprobs) and entropy are the pass's."""
    import actor

    device = one_rank.device
    samples = _random_samples()
    for i in (0, 5):  # the push check's samples: an engine that said 0 for every token
        samples[i].rollout_logprobs = [0.0] * len(samples[i].response_ids)
    cfg = _grpo_cfg(temperature)
    assert actor.one_optimizer_step(cfg.actor, train_batch_size=4)
    weights, checks = [], []
    for from_update in (False, True):
        model, optimizer, _ = _tiny_policy(tiny_qwen2, device)
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        check = actor.PushCheck(device)
        for s in samples:
            s.old_logprobs = None
        if not from_update:
            actor.compute_logprobs(
                model, samples, cfg.actor, actor.Layout(True, 0, device), temperature, check
            )
        m = _update(model, optimizer, samples, cfg, device, check if from_update else None)
        assert m["actor/ppo_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0  # ratio 1 either way
        checks.append(check.result(tol=10.0, step=0))
        weights.append([p.detach().full_tensor() for p in model.parameters()])
    moved = max(float((a - b).abs().max()) for a, b in zip(before, weights[1], strict=True))
    same = max(float((a - b).abs().max()) for a, b in zip(weights[0], weights[1], strict=True))
    assert moved > 1e-3 and same < 1e-6
    for k in ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "actor/entropy"):
        assert checks[0][k] > 0.1 and abs(checks[0][k] - checks[1][k]) < 1e-5, (k, checks)
    with pytest.raises(RuntimeError, match="not running the trained weights"):
        check.result(tol=0.01, step=0)  # an engine that said 0 for every token is not the trainer


def test_push_check_refuses_an_unchecked_step(one_rank, tiny_qwen2) -> None:
    """No sample carries the engine's logprobs (or the pass saw none): the push would go unchecked, an error."""
    import actor

    device = one_rank.device
    model, optimizer, _ = _tiny_policy(tiny_qwen2, device)
    check = actor.PushCheck(device)
    _update(model, optimizer, _random_samples(), _grpo_cfg(), device, check)
    with pytest.raises(RuntimeError, match="cannot be checked"):
        check.result(tol=1.0, step=0)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_update_recomputes_with_checkpointing_and_leaves_eval_mode(one_rank, tiny_qwen2, checkpointing):
    """from_pretrained returns a model in eval mode, and Hugging Face decoder layers recompute only in train mode:
    actor.update trains in train mode (with checkpointing each layer runs twice per micro-batch: forward, then
    again in the backward pass), and leaves eval mode behind, also on an error; compute_logprobs runs in eval."""
    import actor

    device = one_rank.device
    model, optimizer, _ = _tiny_policy(tiny_qwen2, device, checkpointing)
    samples = _random_samples()
    cfg = _grpo_cfg()
    n_micro = len(actor.micro_batches(samples, list(range(len(samples))), cfg.actor))
    assert n_micro == 3  # 8 samples, 3 a micro-batch
    modes = []  # the layer's training flag at each call (a pre-hook: a recompute stops before the end)
    model.model.layers[0].register_forward_pre_hook(lambda m, args: modes.append(m.training))

    model.train()  # whatever mode it is left in, the logprob pass runs in eval
    actor.compute_logprobs(model, samples, cfg.actor, actor.Layout(True, 0, device), 1.0)
    assert modes == [False] * n_micro
    modes.clear()
    _update(model, optimizer, samples, cfg, device)
    assert modes == [True] * n_micro * (2 if checkpointing else 1)
    assert not any(m.training for m in model.modules())

    def fail(m, args):
        raise RuntimeError("boom")

    model.model.layers[0].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        _update(model, optimizer, samples, cfg, device)
    assert not any(m.training for m in model.modules())


def test_partial_checkpointing_recomputes_the_first_layers_and_trains_the_same(one_rank, tmp_path):
    """model.gradient_checkpointing_layers=2 of 4: the first two layers run twice per micro-batch (forward, then
    the recompute in the backward pass), the last two once, and one update moves every weight exactly as without
    checkpointing and with every layer recomputing. 'auto' left unresolved is refused at load."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import actor

    torch.manual_seed(0)
    shape = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    Qwen2ForCausalLM(shape).save_pretrained(tmp_path / "four")
    device, samples, cfg = one_rank.device, _random_samples(), _grpo_cfg()
    n_micro = len(actor.micro_batches(samples, list(range(len(samples))), cfg.actor))
    weights = {}
    for checkpointing, layers, runs in (
        (False, "all", [1] * 4),
        (True, "all", [2] * 4),
        (True, 2, [2, 2, 1, 1]),
    ):
        model, optimizer, _ = _tiny_policy(tmp_path / "four", device, checkpointing, layers=layers)
        calls = [0] * 4
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda m, args, i=i, c=calls: c.__setitem__(i, c[i] + 1))
        _update(model, optimizer, samples, cfg, device)
        assert calls == [r * n_micro for r in runs], (checkpointing, layers)
        weights[checkpointing, layers] = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    plain = weights[False, "all"]
    for key in ((True, "all"), (True, 2)):
        assert all(torch.allclose(weights[key][k], plain[k], rtol=0, atol=1e-7) for k in plain), key
    start = {k: v.full_tensor() for k, v in _tiny_policy(tmp_path / "four", device)[0].state_dict().items()}
    assert max((plain[k] - start[k]).abs().max().item() for k in plain) > 1e-4  # the update moved the weights
    with pytest.raises(ValueError, match="gradient_checkpointing_layers=auto is sized by the RL memory plan"):
        _tiny_policy(tmp_path / "four", device, True, layers="auto")


def test_gspo_surrogate_by_hand():
    """Two sequences; old logprobs 0, so the log-ratios are the logprobs. Sequence 0 (2 tokens, A = 1): mean log-ratio
    (0.1 + 0.3) / 2 = 0.2, s = e^0.2 = 1.2214 > 1 + 0.2: clipped, every token's loss -1.2. Sequence 1 (1 token,
    A = -1): s = e^-0.1 = 0.9048, inside: loss 0.9048, gradient d/dlogprob (-A s) = s."""
    import actor

    logprobs = torch.tensor([[0.1, 0.3], [-0.1, 5.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    pg, clipped = grpo.gspo_surrogate(logprobs, torch.zeros(2, 2), adv, mask, actor.ActorConfig())
    s1 = math.exp(-0.1)
    torch.testing.assert_close(pg * mask, torch.tensor([[-1.2, -1.2], [s1, 0.0]]))
    assert clipped[0].all() and not clipped[1, 0]
    loss = losses.agg_loss(pg, mask, "seq-mean-token-mean")  # (-1.2 + s1) / 2
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [s1 / 2, 0.0]]))


def test_gspo_is_a_change_to_grpo_py_alone(one_rank, tiny_qwen2) -> None:
    """actor.policy_loss.loss_mode=gspo: the same loop (actor.update) with grpo.py's other surrogate. Off policy
    (old logprobs from before two earlier updates), GSPO's clip decisions are per sequence: a sequence's tokens are
    all clipped or none is; PPO-clip's are per token, and it clips a different share. Both move the weights."""
    import actor

    device = one_rank.device
    samples = _random_samples()
    fractions = {}
    for mode in ("vanilla", "gspo"):
        cfg = _grpo_cfg(
            policy_loss=actor.PolicyLossConfig(loss_mode=mode), clip_ratio_low=0.1, clip_ratio_high=0.1
        )
        model, optimizer, _ = _tiny_policy(tiny_qwen2, device, lr=1e-3)  # log-ratios of ~0.06 a step
        actor.compute_logprobs(model, samples, cfg.actor, actor.Layout(True, 0, device), 1.0)
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        _update(model, optimizer, samples, cfg, device, steps=2)  # the second step is off policy
        after = [p.detach().full_tensor() for p in model.parameters()]
        moved = max(float((a - b).abs().max()) for a, b in zip(before, after, strict=True))
        assert moved > 1e-4, (mode, moved)
        # the clip decision per token after those steps, from the surrogate alone
        mb = actor.MicroBatch.of(samples, actor.Layout(True, 0, device))
        with torch.no_grad():
            lp, _ = actor.forward(model, mb, 1.0)
        surrogate = grpo.gspo_surrogate if mode == "gspo" else grpo.clipped_surrogate
        args = (mb.mask, cfg.actor) if mode == "gspo" else (cfg.actor,)
        clipped = surrogate(lp, mb.per_token("old_logprobs"), mb.per_token("advantages"), *args)[1].float()
        per_seq = [set(clipped[j, :L].tolist()) for j, L in enumerate(mb.lengths)]
        mixed = sum(len(v) > 1 for v in per_seq)
        fractions[mode] = float(losses.masked_mean(clipped, mb.mask))
        assert (mixed == 0) if mode == "gspo" else (mixed > 0), (mode, per_seq)
        for s in samples:
            s.old_logprobs = None
    assert 0 < fractions["gspo"] < 1 and fractions["gspo"] != fractions["vanilla"], fractions


def test_micro_batch_inputs_match_the_mask_path_and_build_without_a_device_sync() -> None:
    """actor.collate's host-built labels, label mask and response index give response_matrix what the model's
    label mask selects (both layouts); on CUDA, collate, response_matrix, mask_of, padded and the policy surrogate
    of a micro-batch run under torch.cuda.set_sync_debug_mode("error"), so none of them waits for the GPU."""
    import actor

    gen = torch.Generator().manual_seed(2)
    samples = []
    for g in range(3):
        L = int(torch.randint(1, 7, (1,), generator=gen))
        ids = torch.randint(1, 50, (4 + g + L,), generator=gen).tolist()
        samples.append(actor.Sample(ids[: 4 + g], ids[4 + g :], None, "stop", g, advantages=float(g) - 1))
        samples[-1].old_logprobs = -torch.rand(L, generator=gen)
    lens = [len(s.response_ids) for s in samples]
    for packed in (False, True):
        b = actor.collate(samples, actor.Layout(packed, 0, torch.device("cpu")))
        values = torch.randn(b["labels"].shape, generator=gen)
        want = torch.zeros(3, max(lens))
        flat = values[b["label_mask"].bool()]
        for j, L in enumerate(lens):
            want[j, :L], flat = flat[:L], flat[L:]
        assert torch.equal(actor.response_matrix(values, b["response_index"], lens), want)
        assert b["response_index"].numel() == sum(lens)

    if not torch.cuda.is_available():
        return
    device = torch.device("cuda")
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mb = actor.MicroBatch.of(
            samples, actor.Layout(True, 0, device), global_tokens=sum(lens), global_seqs=3
        )
        lp = mb.rows(torch.randn(mb.inputs["labels"].shape, device=device))
        old, adv = mb.per_token("old_logprobs"), mb.per_token("advantages")
        pg, clipped, dual = grpo.clipped_surrogate(lp, old, adv, actor.ActorConfig())
        total = losses.agg_loss(pg, mb.mask, global_tokens=mb.global_tokens) + mb.token_mean(clipped.float())
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert math.isfinite(float(total))


def test_scoring_runs_beside_the_logprob_passes(one_rank) -> None:
    """rl.score_in_background: the reward pool scores while this thread works (each side sees the other's start
    before it finishes), the scores land on the samples, and the wait returns the merged reward metrics; an error
    of the scoring is raised by the wait."""
    import concurrent.futures
    import threading
    from types import SimpleNamespace

    import actor
    import rl

    scoring, passes = threading.Event(), threading.Event()

    class Pool:  # the RewardPool interface scoring.score uses: score(items) -> (scores, metrics), last_extras
        num_workers = 2

        def score(self, items):
            scoring.set()
            saw_passes = passes.wait(timeout=30)
            self.last_extras = [{}] * len(items)
            return [len(it["response"]) + saw_passes for it in items], {"reward/errors": 0}

    class Tok:
        def batch_decode(self, ids, skip_special_tokens=True):
            return ["x" * len(one) for one in ids]

    run = SimpleNamespace(
        cfg=grpo.GRPOConfig(), pool=Pool(), tokenizer=Tok(), scorer=concurrent.futures.ThreadPoolExecutor(1)
    )
    prompts = [dict(data_source="d", raw_prompt="p", ground_truth="g", extra_info={}) for _ in range(2)]
    samples = [actor.Sample([1], [2] * (k + 1), None, "stop", k % 2) for k in range(4)]
    wait = rl.score_in_background(run, samples, prompts)
    passes.set()  # "the old-logprob pass": running while the scoring waits for it
    assert scoring.wait(timeout=30)
    metrics = wait()
    assert [s.score for s in samples] == [2.0, 3.0, 4.0, 5.0]  # len + 1: the scoring saw the passes start
    assert metrics["reward/errors"] == 0 and metrics["perf/reward_scoring_s"] >= 0

    class Broken:
        num_workers = 2

        def score(self, items):
            raise ValueError("reward function crashed")

    run.pool = Broken()
    with pytest.raises(ValueError, match="crashed"):
        rl.score_in_background(run, samples, prompts)()


def test_val_only_evaluates_without_a_training_sampler_and_keeps_the_generations(one_rank, toy_dir, tmp_path):
    """--trainer.val_only on the untrained toy model (the hf engine, in process): no training sampler is built (a
    batch larger than the training set used to stop it), and RUN/val_generations/step_0.jsonl holds every
    validation response with its score (a custom reward: the response's length in characters, mod 3), whose mean
    is the logged val/reward/mean."""
    import json

    import rl
    import rollout
    import scoring

    fn = tmp_path / "length_reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 3)\n"
    )
    run_dir = tmp_path / "val"
    cfg = grpo.GRPOConfig(
        data=rl.RLDataConfig(
            train_files=str(toy_dir / "rl/train.parquet"),
            val_files=str(toy_dir / "rl/val.parquet"),
            train_batch_size=10**6,
            max_prompt_length=32,
            max_response_length=8,
        ),
        model=grpo.actor.ModelConfig(path=str(toy_dir / "model")),
        rollout=rollout.RolloutConfig(name="hf"),
        custom_reward_function=scoring.RewardConfig(path=str(fn), num_workers=0),
        trainer=rl.RLTrainerConfig(default_local_dir=str(run_dir), val_only=True, logger=["jsonl"]),
    )
    results = grpo.main(cfg)
    rows = [json.loads(line) for line in (run_dir / "val_generations/step_0.jsonl").read_text().splitlines()]
    assert len(rows) == 200  # toy.py's n_val
    assert {"prompt", "response", "ground_truth", "score"} <= set(rows[0])
    assert all(r["score"] == len(r["response"]) % 3 for r in rows)
    mean = sum(r["score"] for r in rows) / len(rows)
    assert abs(results["val/reward/mean"] - mean) < 1e-9


def test_rollout_importance_sampling_weights_each_token_truncated(one_rank, tiny_qwen2) -> None:
    """algorithm.rollout_is_threshold 2 with rollout_is: on policy (ratio 1) each token's loss is -A times its weight
    min(pi_trainer / pi_engine, 2). An engine 3x less likely than the trainer on sample 0's tokens gives them weight
    2 (truncated), one 0.8x as likely on sample 1's gives 1.25, the others 1; without rollout_is the loss is
    plain and only the mismatch/* metrics are logged."""
    import actor

    device = one_rank.device
    model, _, _ = _tiny_policy(tiny_qwen2, device)
    samples = _random_samples()
    layout = actor.Layout(True, 0, device)
    actor.compute_logprobs(model, samples, _grpo_cfg().actor, layout, 1.0)  # the trainer's, as one_step sees
    for k, s in enumerate(samples):
        shift = {0: -math.log(3.0), 1: math.log(0.8)}.get(k, 0.0)  # log pi_engine - log pi_trainer
        s.rollout_logprobs = (s.old_logprobs + shift).tolist()
    weights = [2.0, 1.25] + [1.0] * (len(samples) - 2)
    tokens = sum(len(s.response_ids) for s in samples)
    mb = actor.MicroBatch.of(samples, layout, global_tokens=tokens, global_seqs=len(samples))
    for s in samples:
        s.old_logprobs = None  # one optimizer step: the update's own forward gives them
    algorithm = grpo.AlgorithmConfig(rollout_is_threshold=2.0, rollout_is=True)
    cfg = dataclasses.replace(_grpo_cfg(), algorithm=algorithm)
    loss, m = grpo.policy_loss(model, mb, cfg, None)
    want = (
        sum(-s.advantages * w * len(s.response_ids) for s, w in zip(samples, weights, strict=True)) / tokens
    )
    assert abs(float(loss) - want) < 1e-5, (float(loss), want)
    n0, n1 = len(samples[0].response_ids), len(samples[1].response_ids)
    assert abs(float(m["mismatch/rollout_is_ratio_fraction_high"]) - n0 / tokens) < 1e-6
    assert (
        abs(float(m["mismatch/rollout_is_mean"]) - (2.0 * n0 + 1.25 * n1 + tokens - n0 - n1) / tokens) < 1e-5
    )
    want_kl = (n0 * -math.log(3.0) + n1 * math.log(0.8)) / tokens  # mean of log pi_engine - log pi_trainer
    assert abs(float(m["mismatch/mismatch_kl"]) - want_kl) < 1e-5
    metrics_only = dataclasses.replace(cfg, algorithm=grpo.AlgorithmConfig(rollout_is_threshold=2.0))
    plain = sum(-s.advantages * len(s.response_ids) for s in samples) / tokens
    assert abs(float(grpo.policy_loss(model, mb, metrics_only, None)[0]) - plain) < 1e-5


def test_sequence_level_rollout_is_weighs_each_response_by_its_truncated_product(
    one_rank, tiny_qwen2
) -> None:
    """algorithm.rollout_is_level=sequence (verl's rollout_is=sequence): every token of a response weighs
    min(prod_t pi_trainer / pi_engine, threshold). Sample 0's engine at 0.8x the trainer per token gives
    1.25^L (truncated at 2 once L >= 4), sample 1's at 1.1x gives (1/1.1)^L, the others 1."""
    import actor

    device = one_rank.device
    model, _, _ = _tiny_policy(tiny_qwen2, device)
    samples = _random_samples()
    layout = actor.Layout(True, 0, device)
    actor.compute_logprobs(model, samples, _grpo_cfg().actor, layout, 1.0)
    for k, s in enumerate(samples):
        shift = {0: math.log(0.8), 1: math.log(1.1)}.get(k, 0.0)  # log pi_engine - log pi_trainer, per token
        s.rollout_logprobs = (s.old_logprobs + shift).tolist()
    n0, n1 = len(samples[0].response_ids), len(samples[1].response_ids)
    weights = [min(1.25**n0, 2.0), (1 / 1.1) ** n1] + [1.0] * (len(samples) - 2)
    tokens = sum(len(s.response_ids) for s in samples)
    mb = actor.MicroBatch.of(samples, layout, global_tokens=tokens, global_seqs=len(samples))
    for s in samples:
        s.old_logprobs = None
    algorithm = grpo.AlgorithmConfig(rollout_is_threshold=2.0, rollout_is=True, rollout_is_level="sequence")
    loss, m = grpo.policy_loss(model, mb, dataclasses.replace(_grpo_cfg(), algorithm=algorithm), None)
    want = (
        sum(-s.advantages * w * len(s.response_ids) for s, w in zip(samples, weights, strict=True)) / tokens
    )
    assert abs(float(loss) - want) < 1e-5, (float(loss), want)
    high = n0 if 1.25**n0 > 2.0 else 0
    assert abs(float(m["mismatch/rollout_is_ratio_fraction_high"]) - high / tokens) < 1e-6
    token_level = dataclasses.replace(algorithm, rollout_is_level="token")
    other = grpo.policy_loss(model, mb, dataclasses.replace(_grpo_cfg(), algorithm=token_level), None)[0]
    assert abs(float(other) - want) > 1e-4  # the token level weighs the same responses differently


def test_rejected_tokens_leave_the_loss_and_batch_normalisation_divides_the_weights(
    one_rank, tiny_qwen2
) -> None:
    """algorithm.rollout_rs's loss_mask: a dropped token adds nothing and leaves the token-mean's count (the update's
    global_tokens is Sample.loss_tokens); rollout_is_batch_normalize's is_mean divides every weight. On policy
    with the engine 0.8x the trainer on sample 0's tokens (weight 1.25) and the others equal (1), is_mean 1.25."""
    import actor

    device = one_rank.device
    model, _, _ = _tiny_policy(tiny_qwen2, device)
    samples = _random_samples()
    layout = actor.Layout(True, 0, device)
    actor.compute_logprobs(model, samples, _grpo_cfg().actor, layout, 1.0)
    for k, s in enumerate(samples):
        s.rollout_logprobs = (s.old_logprobs + (math.log(0.8) if k == 0 else 0.0)).tolist()
    samples[1].loss_mask = torch.tensor([0.0] + [1.0] * (len(samples[1].response_ids) - 1))
    samples[2].loss_mask = torch.zeros(len(samples[2].response_ids))
    kept = sum(s.loss_tokens for s in samples)
    mb = actor.MicroBatch.of(samples, layout, global_tokens=kept, global_seqs=len(samples))
    algorithm = grpo.AlgorithmConfig(
        rollout_is_threshold=2.0, rollout_is=True, rollout_is_batch_normalize=True
    )
    cfg = dataclasses.replace(_grpo_cfg(), algorithm=algorithm)
    loss, _ = grpo.policy_loss(model, mb, cfg, None, is_mean=1.25)
    weights = [1.25 / 1.25] + [1.0 / 1.25] * (len(samples) - 1)
    want = sum(-s.advantages * w * s.loss_tokens for s, w in zip(samples, weights, strict=True)) / kept
    assert abs(float(loss) - want) < 1e-5, (float(loss), want)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
def test_kl_in_reward(estimator):
    """algorithm.use_kl_in_reward (verl's apply_kl_penalty, its REINFORCE++ and RLOO examples): each token's reward
    is -kl_coef * (old - ref) (k1); grpo and rloo score a response by its token rewards' sum, REINFORCE++ gives each
    token its return from there on, whitened over all tokens (unbiased); the metrics are the batch's KL (the mean of
    the sequences' token means) and the coefficient, which the adaptive controller then moves."""
    import actor
    import fsdp
    import rl

    fsdp.init_distributed()
    g = torch.Generator().manual_seed(0)
    samples = []
    for k in range(6):
        n = 2 + k % 3
        s = actor.Sample([1], [2] * n, [0.0] * n, "stop", k // 3, score=float(k % 2))
        s.old_logprobs, s.ref_logprobs = -torch.rand(n, generator=g), -torch.rand(n, generator=g)
        samples.append(s)
    beta = 0.5
    kl_cfg = rl.KLControlConfig(type="adaptive", kl_coef=beta, target_kl=0.01, horizon=100)
    ctrl = rl.KLController(kl_cfg)
    cfg = grpo.AlgorithmConfig(adv_estimator=estimator, use_kl_in_reward=True, kl_ctrl=kl_cfg)
    m = grpo.compute_advantages(samples, cfg, ctrl)
    kls = [s.old_logprobs - s.ref_logprobs for s in samples]
    assert abs(m["actor/reward_kl_penalty"] - sum(float(k.mean()) for k in kls) / 6) < 1e-6
    assert m["actor/reward_kl_penalty_coeff"] == beta and ctrl.value != beta  # moved after the step
    scores = torch.tensor([s.score for s in samples])
    groups = torch.tensor([s.group for s in samples])
    if estimator == "reinforce_plus_plus":
        returns = [
            s.score - beta * torch.flip(torch.cumsum(torch.flip(k, [0]), 0), [0])
            for s, k in zip(samples, kls, strict=True)
        ]
        flat = torch.cat(returns).double()
        want = [
            ((r.double() - flat.mean()) / (flat.var(unbiased=True) + 1e-8) ** 0.5).float() for r in returns
        ]
        for s, w in zip(samples, want, strict=True):
            assert s.advantages.shape == w.shape and torch.allclose(s.advantages, w, atol=1e-5)
        return
    penalised = scores - beta * torch.stack([k.sum() for k in kls])
    want = (
        grpo.group_advantages(penalised, groups)
        if estimator == "grpo"
        else grpo.rloo_advantages(penalised, groups)
    )
    assert torch.allclose(torch.tensor([s.advantages for s in samples]), want.float(), atol=1e-5)
    plain = grpo.compute_advantages(samples, grpo.AlgorithmConfig(adv_estimator=estimator))
    assert plain == {} and not torch.allclose(
        torch.tensor([s.advantages for s in samples]), want.float(), atol=1e-3
    )


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens_over_tokens():
    """verl's reinforce_plus_plus_baseline: each score less its group's mean, then whitened over all response
    tokens (every token carries its sequence's value; unbiased variance), so unlike plain REINFORCE++ a group whose
    responses all score alike gets 0."""
    import actor
    import fsdp

    fsdp.init_distributed()
    scores, lens, groups = [1.0, 0.0, 3.0, 3.0], [2, 3, 1, 4], [0, 0, 1, 1]
    samples = [
        actor.Sample([1], [2] * n, [0.0] * n, "stop", g, score=x)
        for x, n, g in zip(scores, lens, groups, strict=True)
    ]
    grpo.compute_advantages(samples, grpo.AlgorithmConfig(adv_estimator="reinforce_plus_plus_baseline"))
    centred = [0.5, -0.5, 0.0, 0.0]
    tokens = torch.tensor(
        [c for c, n in zip(centred, lens, strict=True) for _ in range(n)], dtype=torch.float64
    )
    want = (torch.tensor(centred, dtype=torch.float64) - tokens.mean()) / (tokens.var() + 1e-8) ** 0.5
    assert torch.allclose(torch.tensor([s.advantages for s in samples], dtype=torch.float64), want, atol=1e-6)
    assert abs(samples[2].advantages - samples[3].advantages) < 1e-9 and abs(samples[2].advantages) < 0.2


def test_remax_subtracts_the_greedy_score_and_with_kl_in_reward_each_token_its_return():
    """ReMax (verl's compute_remax_outcome_advantage): a response's advantage is its score less the score of its
    prompt's greedy response, not whitened; with use_kl_in_reward each token gets its return (the score less the
    penalty from that token on) less the baseline."""
    import actor
    import fsdp
    import rl

    fsdp.init_distributed()
    samples = [
        actor.Sample([1], [2] * (k + 2), [0.0] * (k + 2), "stop", k // 2, score=float(k)) for k in range(4)
    ]
    baselines = [actor.Sample([1], [3], [0.0], "stop", g, score=b) for g, b in ((1, 0.5), (0, 2.0))]
    cfg = grpo.AlgorithmConfig(adv_estimator="remax")
    assert grpo.compute_advantages(samples, cfg, baselines=baselines) == {}
    assert [s.advantages for s in samples] == [-2.0, -1.0, 1.5, 2.5]
    with pytest.raises(ValueError, match="remax needs the greedy baselines"):
        grpo.compute_advantages(samples, cfg)

    g = torch.Generator().manual_seed(0)
    for s in samples:
        s.old_logprobs = -torch.rand(len(s.response_ids), generator=g)
        s.ref_logprobs = -torch.rand(len(s.response_ids), generator=g)
    beta = 0.3
    kl = grpo.AlgorithmConfig(
        adv_estimator="remax", use_kl_in_reward=True, kl_ctrl=rl.KLControlConfig(kl_coef=beta)
    )
    grpo.compute_advantages(samples, kl, rl.KLController(kl.kl_ctrl), baselines)
    base = {0: 2.0, 1: 0.5}
    for s in samples:
        k = s.old_logprobs - s.ref_logprobs
        want = s.score - base[s.group] - beta * torch.flip(torch.cumsum(torch.flip(k, [0]), 0), [0])
        assert s.advantages.shape == want.shape and torch.allclose(s.advantages, want.float(), atol=1e-6)


def test_remax_on_the_toy_scores_one_greedy_response_a_prompt(one_rank, toy_dir, tmp_path, monkeypatch):
    """grpo.py with adv_estimator=remax on the toy (hf engine): each step generates one greedy response to each
    prompt (the same one when generated twice), scores it, logs the baselines' mean score, and trains on each
    sample's score less its prompt's baseline; with async rollouts it stops in one line."""
    from conftest import read_metrics, toy_grpo_config

    fn = tmp_path / "length_reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 3)\n"
    )
    seen = []
    real_baselines, real_advantages = grpo.remax_baselines, grpo.compute_advantages

    def baselines(run, engine, prompts, mine, step):
        out = real_baselines(run, engine, prompts, mine, step)
        again = real_baselines(run, engine, prompts, mine, step + 7)  # another seed: greedy all the same
        assert [b.response_ids for b in out] == [b.response_ids for b in again]
        seen.append(out)
        return out

    def advantages(samples, cfg, kl_ctrl=None, baselines=None, is_mean=1.0):
        metrics = real_advantages(samples, cfg, kl_ctrl, baselines, is_mean)
        greedy = {b.group: b.score for b in baselines}
        assert sorted(greedy) == sorted({s.group for s in samples}) and len(baselines) == len(greedy)
        assert all(s.advantages == s.score - greedy[s.group] for s in samples)
        return metrics

    monkeypatch.setattr(grpo, "remax_baselines", baselines)
    monkeypatch.setattr(grpo, "compute_advantages", advantages)
    run_dir = tmp_path / "remax"
    algorithm = grpo.AlgorithmConfig(adv_estimator="remax")
    grpo.main(toy_grpo_config(toy_dir, run_dir, fn, steps=2, lr=1e-2, n=3, algorithm=algorithm))
    rows = [r for r in read_metrics(run_dir) if "timing_s/step" in r]
    assert len(rows) == len(seen) == 2 and all(len(b) == 4 for b in seen)  # 4 prompts a step
    for r, b in zip(rows, seen, strict=True):
        assert r["remax/baseline_reward_mean"] == pytest.approx(sum(x.score for x in b) / len(b))
    cfg = toy_grpo_config(
        toy_dir, tmp_path / "async", fn, steps=2, lr=1e-2, algorithm=algorithm, rollout_kw={"async_steps": 1}
    )
    with pytest.raises(
        SystemExit, match="remax needs algorithm.filter_groups.enable=false and rollout.async"
    ):
        grpo.main(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_reference_gives_the_fp32_policys_logprobs(one_rank, tiny_qwen2):
    """actor.load_reference stores the frozen copy in the compute dtype on GPU (as verl's reference): FSDP2 casts
    the fp32 policy to bf16 for every forward anyway, so the logprobs are the same bits at half the memory."""
    import actor

    cfg, device = _grpo_cfg(), one_rank.device
    mcfg = actor.ModelConfig(path=str(tiny_qwen2), enable_gradient_checkpointing=False)
    policy, _ = actor.load(mcfg, device)
    ref = actor.load_reference(mcfg, policy, device)
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    mine, theirs = _random_samples(), _random_samples()
    actor.compute_logprobs(policy, mine, cfg.actor, actor.Layout(True, 0, device), 1.0)
    actor.compute_logprobs(ref, theirs, cfg.actor, actor.Layout(True, 0, device), 1.0, ref=True)
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a.old_logprobs, b.ref_logprobs), (a.old_logprobs, b.ref_logprobs)


@pytest.mark.parametrize("test_freq, validated", [(-1, [0]), ("end", [0, 2]), (1, [0, 1, 2])])
def test_test_freq_reads_as_verls(one_rank, toy_dir, tmp_path, capfd, test_freq, validated) -> None:
    """trainer.test_freq in grpo.py: 0 or less validates only before training (verl's RL trainer, said once on
    stderr), "end" after the last step too (flatrl's default), N every N steps and after the last."""
    from conftest import read_metrics, toy_grpo_config

    fn = tmp_path / "reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    cfg = toy_grpo_config(toy_dir, tmp_path / "run", fn, steps=2, lr=1e-3, test_freq=test_freq)
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, val_files=str(toy_dir / "rl/val.parquet"))
    )
    grpo.main(cfg)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "val/reward/mean" in r] == validated
    said = "note: trainer.test_freq=-1 validates only before training" in capfd.readouterr().err
    assert said == (test_freq == -1)
