"""The same GRPO run as grpo.py, trained by TRL's GRPOTrainer instead: the learning-parity peer of issue 17.

    torchrun --nproc_per_node 1 scripts/trl_grpo.py --config configs/grpo_arith_words_smollm2.yaml --model.path runs/real/model \
        --trainer.default_local_dir runs/real/seed0/trl --trainer.seed 0

It takes grpo.py's own command line (config.parse on grpo.GRPOConfig), so both frameworks read one config, and
turns it into a GRPOConfig of TRL (`trl_args`). A setting TRL has no equivalent for stops the run with one line
naming the key, unless it is at grpo.py's default; nothing is dropped silently. The mapping:
    data.train_batch_size x rollout.n     samples per optimizer step (TRL's generation batch, one step of it)
    rollout.n / temperature / top_p / top_k   num_generations / temperature / top_p / top_k (-1 -> 0: off)
    data.max_response_length             max_completion_length
    actor.optim lr, betas, weight_decay, lr_scheduler, warmup_steps_ratio (as steps), actor.grad_clip: the same
    actor.clip_ratio_low / clip_ratio_high   epsilon / epsilon_high
    actor.loss_agg_mode token-mean       loss_type "dapo" (token sum over the whole batch / its token count);
                         seq-mean-token-mean "grpo"; seq-mean-token-sum-norm "dr_grpo"
    algorithm.norm_adv_by_std_in_grpo    scale_rewards "group" / "none"
    actor.use_kl_loss + kl_loss_coef     beta (TRL's KL is k3, verl's low_var_kl)
    actor.ppo_epochs                     num_iterations
    model.enable_gradient_checkpointing  gradient_checkpointing
    rollout.gpu_memory_utilization       vllm_gpu_memory_utilization (colocated vLLM)
    algorithm.rollout_is                 vllm_importance_sampling_correction (TRL's default is on; flatrl's off)
    trainer.seed / total_training_steps  seed / max_steps
Precision as grpo.py: fp32 master weights, bf16 autocast. The reward is flatrl's reward.default_compute_score on
the same verl-schema rows and the same chat template (the tokenizer's), so only the trainer differs.

Writes to trainer.default_local_dir: metrics.jsonl (per step: train reward mean, response length, step seconds,
in flatrl's metric names where one exists, and every number TRL logged under trl/), model/ (the trained weights as a HF folder, for
`grpo.py --trainer.val_only --model.path .../model`, the same greedy evaluation as flatrl's), wall_s.json.
Needs trl (1.16), datasets, multiprocess, and vLLM with a GPU: bench/build_trl_payload.sh carries them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import config  # noqa: E402
import grpo  # noqa: E402
import reward  # noqa: E402


def refuse(key: str, value, why: str) -> None:
    raise SystemExit(f"error: {key}={value!r} has no TRL equivalent in scripts/trl_grpo.py: {why}")


def trl_args(cfg: grpo.GRPOConfig, per_device_batch: int) -> dict:
    """GRPOConfig keyword arguments of TRL for grpo.py's resolved config (see the module docstring)."""
    a, r, opt = cfg.actor, cfg.rollout, cfg.actor.optim
    samples = cfg.data.train_batch_size * r.n
    if samples % per_device_batch:
        refuse("--per-device-batch", per_device_batch, f"must divide train_batch_size x n = {samples}")
    if a.ppo_mini_batch_size != cfg.data.train_batch_size:
        refuse(
            "actor.ppo_mini_batch_size", a.ppo_mini_batch_size, "only one optimizer step per batch is mapped"
        )
    if cfg.algorithm.adv_estimator != "grpo":
        refuse("algorithm.adv_estimator", cfg.algorithm.adv_estimator, "TRL's GRPOTrainer is GRPO only")
    if a.entropy_coeff:
        refuse("actor.entropy_coeff", a.entropy_coeff, "TRL has no entropy bonus")
    if cfg.model.lora_rank:
        refuse("model.lora_rank", cfg.model.lora_rank, "LoRA is not mapped (TRL would need peft)")
    if a.use_kl_loss and a.kl_loss_type != "low_var_kl":
        refuse("actor.kl_loss_type", a.kl_loss_type, "TRL's KL estimator is k3 (low_var_kl)")
    if a.policy_loss.loss_mode != "vanilla":
        refuse("actor.policy_loss.loss_mode", a.policy_loss.loss_mode, "only PPO-clip is mapped")
    loss_type = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
    if a.loss_agg_mode not in loss_type:
        refuse("actor.loss_agg_mode", a.loss_agg_mode, f"mapped: {sorted(loss_type)}")
    if cfg.algorithm.rollout_is and cfg.algorithm.rollout_is_threshold is None:
        refuse("algorithm.rollout_is", True, "needs algorithm.rollout_is_threshold")
    if cfg.trainer.total_training_steps is None:
        refuse("trainer.total_training_steps", None, "give the number of steps")
    scheduler = "constant" if opt.lr_scheduler == "constant" else "cosine"
    return dict(
        output_dir=cfg.trainer.default_local_dir,
        per_device_train_batch_size=per_device_batch,
        gradient_accumulation_steps=samples // per_device_batch,
        num_generations=r.n,
        max_completion_length=cfg.data.max_response_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=max(r.top_k, 0),
        learning_rate=opt.lr,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        weight_decay=opt.weight_decay,
        lr_scheduler_type=scheduler,
        warmup_steps=round(opt.warmup_steps_ratio * cfg.trainer.total_training_steps),
        max_grad_norm=a.grad_clip,
        epsilon=a.clip_ratio_low,
        epsilon_high=a.clip_ratio_high,
        loss_type=loss_type[a.loss_agg_mode],
        scale_rewards="group" if cfg.algorithm.norm_adv_by_std_in_grpo else "none",
        beta=a.kl_loss_coef if a.use_kl_loss else 0.0,
        num_iterations=a.ppo_epochs,
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=r.gpu_memory_utilization,
        vllm_max_model_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
        vllm_importance_sampling_correction=cfg.algorithm.rollout_is,
        vllm_importance_sampling_cap=cfg.algorithm.rollout_is_threshold,
        bf16=True,
        model_init_kwargs={"dtype": "float32"},
        seed=cfg.trainer.seed,
        max_steps=cfg.trainer.total_training_steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )


def rows(path: str) -> list[dict]:
    """verl-schema parquet rows as TRL's conversational prompts plus the reward's columns."""
    import pyarrow.parquet as pq

    out = []
    for i, row in enumerate(pq.read_table(path).to_pylist()):
        prompt = row["prompt"]
        if not isinstance(prompt, list):
            raise SystemExit(
                f"error: {path} row {i}: prompt must be a list of chat messages, got {type(prompt)}"
            )
        out.append(
            {
                "prompt": [{"role": m["role"], "content": m["content"]} for m in prompt],
                "data_source": row["data_source"],
                "ground_truth": str(row["reward_model"]["ground_truth"]),
            }
        )
    return out


def score(completions, data_source, ground_truth, **_) -> list[float]:
    """TRL reward function: flatrl's own scorer on the assistant's text."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [
        float(reward.default_compute_score(d, t, g))
        for d, t, g in zip(data_source, texts, ground_truth, strict=True)
    ]


def main(argv: list[str]) -> None:
    per_device_batch, hf_generate = 64, "--hf-generate" in argv  # CPU smoke: transformers' generate, no vLLM
    argv = [a for a in argv if a != "--hf-generate"]
    if "--per-device-batch" in argv:
        i = argv.index("--per-device-batch")
        per_device_batch = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2 :]
    cfg = config.parse(grpo.GRPOConfig, argv)
    kwargs = trl_args(cfg, per_device_batch)
    print(
        "scripts/trl_grpo.py: TRL draws the data order and the sampling from trainer.seed; data.seed, rollout.seed,"
        " the logger, validation and checkpoint keys are grpo.py's and are not used here",
        file=sys.stderr,
    )
    if hf_generate:
        kwargs |= {"use_vllm": False, "bf16": False, "use_cpu": True}
    if not cfg.data.apply_chat_template:
        refuse("data.apply_chat_template", False, "TRL applies the chat template to conversational prompts")

    import dataclasses

    import datasets
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    missing = sorted(k for k in kwargs if k not in known)
    if missing:
        raise SystemExit(f"error: this TRL ({GRPOConfig.__module__}) lacks GRPOConfig fields {missing}")
    kwargs["model_init_kwargs"] = {"dtype": torch.float32}
    out = Path(cfg.trainer.default_local_dir)
    out.mkdir(parents=True, exist_ok=True)

    class Watch(TrainerCallback):
        """Step-end clock and TRL's logged metrics, one metrics.jsonl line per step."""

        def __init__(self) -> None:
            self.last = time.perf_counter()
            self.file = (out / "metrics.jsonl").open("w")

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            now = time.perf_counter()
            row = {
                "step": state.global_step,
                "reward/mean": logs.get("reward"),
                "reward/std": logs.get("reward_std"),
                "response_length/mean": logs.get("completions/mean_length"),
                "response_length/clip_ratio": logs.get("completions/clipped_ratio"),
                "actor/lr": logs.get("learning_rate"),
                "actor/grad_norm": logs.get("grad_norm"),
                "actor/entropy": logs.get("entropy"),
                "timing_s/step": now - self.last,
            } | {f"trl/{k}": v for k, v in logs.items() if isinstance(v, int | float)}  # TRL's own, as logged
            self.last = now
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    files = cfg.data.train_files if isinstance(cfg.data.train_files, list) else [cfg.data.train_files]
    train = datasets.Dataset.from_list([r for f in files for r in rows(f)])
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=cfg.model.path,
        reward_funcs=[score],
        train_dataset=train,
        args=GRPOConfig(**kwargs),
        processing_class=tokenizer,
    )
    watch = Watch()
    trainer.add_callback(watch)
    t1 = time.perf_counter()
    trainer.train()
    t2 = time.perf_counter()
    trainer.save_model(str(out / "model"))
    tokenizer.save_pretrained(str(out / "model"))
    clocks = {
        "constructor_s": round(t1 - t0, 1),
        "train_s": round(t2 - t1, 1),
        "save_s": round(time.perf_counter() - t2, 1),
    }
    (out / "wall_s.json").write_text(
        json.dumps(clocks | {"trl_args": {k: str(v) for k, v in kwargs.items()}}, indent=1)
    )
    print("trl_grpo:", json.dumps(clocks), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
