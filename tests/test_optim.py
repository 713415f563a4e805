"""optim.init_state: AdamW's state made before the first forward trains bit for bit as a lazily made one."""

from __future__ import annotations

import copy

import torch

import fsdp
import optim


def lazy_adamw(params, cfg: optim.OptimConfig) -> torch.optim.AdamW:
    """What optim.build made before init_state: torch's AdamW, whose state appears at the first step."""
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        torch.manual_seed(100 + i)
        ids = torch.randint(0, 64, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def test_eager_state_trains_bit_identically_on_fsdp2(one_rank, tiny_qwen2):
    """build() leaves zero moments at step 0 and the weights untouched; 3 steps then match the lazy AdamW's
    weights and moments exactly, on FSDP2's DTensor shards with weight decay on."""
    cfg = optim.OptimConfig(lr=1e-2, weight_decay=0.1)
    models = [
        fsdp.shard_model(fsdp.load_model(str(tiny_qwen2)), one_rank.device, fsdp.FSDPConfig()) for _ in "ab"
    ]
    for m in models:
        m.train()
    before = {k: local(v).clone() for k, v in models[0].state_dict().items()}
    eager, _ = optim.build(models[0].parameters(), cfg, total_steps=3)
    lazy = lazy_adamw(models[1].parameters(), cfg)

    assert len(eager.state) == len(eager.param_groups[0]["params"]) > 0 and not lazy.state
    for state in eager.state.values():
        assert float(state["step"]) == 0.0
        assert not local(state["exp_avg"]).any() and not local(state["exp_avg_sq"]).any()
    assert all(torch.equal(before[k], local(v)) for k, v in models[0].state_dict().items())  # no weight moved
    assert all(p.grad is None for p in models[0].parameters())
    assert eager.param_groups[0]["lr"] == cfg.lr

    train(models[0], eager, 3)
    train(models[1], lazy, 3)
    a, b = models[0].state_dict(), models[1].state_dict()
    assert not torch.equal(local(a["model.norm.weight"]), before["model.norm.weight"])  # it trained
    assert all(torch.equal(local(a[k]), local(b[k])) for k in a)
    for pa, pb in zip(models[0].parameters(), models[1].parameters(), strict=True):
        sa, sb = eager.state[pa], lazy.state[pb]
        assert float(sa["step"]) == float(sb["step"]) == 3.0
        assert torch.equal(local(sa["exp_avg"]), local(sb["exp_avg"]))
        assert torch.equal(local(sa["exp_avg_sq"]), local(sb["exp_avg_sq"]))


def test_init_state_leaves_an_existing_state_or_gradient_alone():
    """A resumed optimizer (state present) or a pending gradient: nothing is touched."""
    model = torch.nn.Linear(4, 3)
    opt = lazy_adamw(model.parameters(), optim.OptimConfig())
    model.weight.grad = torch.ones_like(model.weight)
    weight = model.weight.detach().clone()
    optim.init_state(opt)
    assert not opt.state and torch.equal(model.weight.grad, torch.ones_like(weight))
    opt.step()
    moments = copy.deepcopy(opt.state[model.weight])
    optim.init_state(opt)
    assert float(opt.state[model.weight]["step"]) == 1.0
    assert torch.equal(opt.state[model.weight]["exp_avg"], moments["exp_avg"])


def test_warmup_steps_win_over_the_ratio():
    """optim.lr_warmup_steps (verl's actor.optim.lr_warmup_steps): that many steps of linear warm-up whatever
    warmup_steps_ratio says; -1 leaves the ratio in charge."""
    cfg = optim.OptimConfig(warmup_steps_ratio=0.5, lr_warmup_steps=10, lr_scheduler="constant")
    assert [optim.lr_factor(s, 100, cfg) for s in (0, 4, 9, 10, 60)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    ratio = optim.OptimConfig(warmup_steps_ratio=0.5, lr_scheduler="constant")
    assert optim.lr_factor(9, 100, ratio) == 0.2 and optim.lr_factor(49, 100, ratio) == 1.0


def test_fused_adamw_state_made_early_trains_as_a_lazy_fused_one_on_fsdp2(one_rank, tiny_qwen2):
    """optim.fused: build() makes the fused AdamW's state early too (its step counts are tensors on the
    parameters' device), and 3 steps then match a lazily made fused AdamW bit for bit, on FSDP2's shards."""
    cfg = optim.OptimConfig(lr=1e-2, weight_decay=0.1, fused=True)
    models = [
        fsdp.shard_model(fsdp.load_model(str(tiny_qwen2)), one_rank.device, fsdp.FSDPConfig()) for _ in "ab"
    ]
    before = local(models[0].state_dict()["model.norm.weight"]).clone()
    eager, _ = optim.build(models[0].parameters(), cfg, total_steps=3)
    lazy = torch.optim.AdamW(
        models[1].parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True
    )
    assert eager.defaults["fused"] and all(float(s["step"]) == 0.0 for s in eager.state.values())
    for m, o in zip(models, (eager, lazy), strict=True):
        m.train()
        train(m, o, 3)
    a, b = models[0].state_dict(), models[1].state_dict()
    assert all(torch.equal(local(a[k]), local(b[k])) for k in a)
    assert not torch.equal(local(a["model.norm.weight"]), before)  # it trained
    assert all(float(s["step"]) == 3.0 for s in eager.state.values())
