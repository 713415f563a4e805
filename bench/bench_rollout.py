"""Rollout throughput: flatrl's `rollout.VLLMEngine.generate` against a bare `vllm.LLM.generate`, one engine.

Both run on the same vLLM engine, started by flatrl with its defaults (so the engine settings are identical by
construction; they are printed under `engine`): "bare" calls `engine.llm.generate` directly with plain
`SamplingParams(n, temperature=1, max_tokens, ignore_eos=True, detokenize=False)`, as a user of vLLM would;
"flatrl" calls `engine.generate` as rl.generate does, which adds what training needs (the push check's probes: one
short request with the engine's logprobs for each of `rollout.logprob_check_prompts` prompts; a seed; Completion
objects). Fixed lengths (`ignore_eos`), random token prompts, the prefix cache reset before every run.

Runs (generated tokens / wall seconds of one generate call):
    bare_n1           P prompts, n=1, no logprobs   the issue's reference: flatrl n=8 should reach 0.9 of it
    bare_n8           P prompts, n=8, no logprobs   flatrl n=8 should reach 0.95 of it
    bare_n8_lp        bare_n8 asking logprobs=0 of every request, as flatrl did before logprob_check_prompts
                      (the engine's logprobs_mode is raw_logprobs; flat_logprobs where vLLM has it): vLLM's own
                      cost of the logprobs, so flatrl_n8_all / bare_n8_lp is flatrl's own work
    flatrl_n8_call    flatrl's defaults: --logprob-check-prompts probes of rollout.logprob_check_tokens tokens
                      with logprobs, the call's seed seeds vLLM's generator (rollout.per_request_seeds=False),
                      torch's intra-op threads at rollout.generate_threads during the call (CUDA)
    flatrl_n8_all     flatrl_n8_call with logprobs for every prompt (rollout.logprob_check_prompts=-1)
    flatrl_n8_onrollouts flatrl_n8_call with the logprobs on the checked prompts' rollouts instead of probes
                      (rollout.logprob_check_tokens=0, the default before 2026-12-07); by name only
    flatrl_n8_request flatrl_n8_call with one seeded generator per request (rollout.per_request_seeds=True);
                      not in the default --runs (it adds ~40 s on the H200), ask for it by name
    flatrl_n8_checkK  flatrl_n8_call with logprob_check_prompts=K (e.g. flatrl_n8_check2): the push check's
                      cost by its size; by name only
    bare_n8_lpK       bare_n8 asking logprobs=0 of the K prompts flatrl checks (rollout.check_prompt_indices, one
                      SamplingParams per prompt), e.g. bare_n8_lp8: vLLM's own cost of flatrl_n8_call's logprobs,
                      so flatrl_n8_call / bare_n8_lp8 is flatrl's own work at its defaults; by name only
    bare_n8_probeK    bare_n8 plus K short requests (copies of those K prompts, n=1, 32 tokens) that alone ask
                      logprobs=0: what a push check on short probe requests would cost vLLM, where the rollout's
                      own requests ask none (vLLM computes the batch's logprobs only while a request wanting them
                      runs: 32 of 512 steps); by name only
    flatrl_n8_woken   flatrl_n8_call on an engine just put to sleep (level 1: the weights kept in host memory) and
                      woken, untimed, as grpo.py's generation phase finds it after the push (the wake empties
                      torch's cache and switches expandable segments off, as there): whether a woken engine
                      decodes slower (the phase took 1.09x this call alone at 6e02cb0, 135M); by name only (where
                      the engine has no sleep mode, the CPU, it is flatrl_n8_call)
    flatrl_n8_threadsall flatrl_n8_call with the process's intra-op threads during the call
                      (rollout.generate_threads=0, the default before 2026-12-07): vLLM's GPU worker sets 1 and
                      rollout.make_engine restores the process's count (note 4 of rollout.py), so vLLM's host-side
                      tensor work ran with every core's OpenMP threads (at 75f1f3f, as flatrl_n8_threads1: 1.05x
                      the call's speed with 1 thread, SmolLM2-135M, H100); by name only

A name may end in `#k` (`bare_n8#2`): the same run again, under that name, so runs can be interleaved (ABAB) where
one after another on one engine drift (2026-12-06, 01e8306: three calls in a row on the H100 each slower than
the one before, 5.40, 5.54, 6.02 s at 0.5B).

Each run's entry: sequences, tokens, seconds, tok_per_s, `host` (this process's CPU seconds, the machine's steal
seconds and torch.compile's compiling seconds during the run, rollout.host_seconds), and `logprobs` (bare: the
SamplingParams.logprobs asked; flatrl: the logprob_check_prompts used, `samples_with_logprobs`, the rollouts that
came back with them, and the check's `probes` and their `probe_tokens`), and `gpu`: the device's SM clock, temperature, power and the share of NVML samples slowed by
the power limit or by heat during the run (common.clock_summary; None off CUDA or without NVML). `ratios` divides
tok_per_s of two runs of this one engine, each with its `#k` repeats (their tokens over their seconds; None when
one of them did not run).

    python bench/bench_rollout.py --model 0.5b --out $OUT/rollout_0.5b.json      # H200: ~3.5 min
    python bench/bench_rollout.py --toy --out /tmp/rollout_toy.json               # CPU: ~30 s
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tempfile
import time
from typing import Any

import common
import gen_profile
from common import Clock
from transformers import AutoConfig

import rollout


def run_bare(
    engine: rollout.VLLMEngine,
    prompts: list[list[int]],
    n: int,
    max_tokens: int,
    logprob_prompts: int,
    probes: int = 0,
) -> dict:
    """One bare vllm.LLM.generate call; logprob_prompts: how many prompts ask logprobs=0 (0 none, -1 every one,
    else those rollout.check_prompt_indices picks, as flatrl's call); its tokens, seconds, tok/s. probes: that
    many extra requests (copies of the prompts check_prompt_indices picks, n=1, PROBE_TOKENS tokens) ask the
    logprobs instead, so vLLM computes them only while those short requests run; their tokens are not counted."""
    from vllm import SamplingParams

    extra: dict = {}
    if logprob_prompts:  # what flatrl's engine.generate asks for a checked prompt
        extra["logprobs"] = 0
        if "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ()):  # newer vLLMs only
            extra["flat_logprobs"] = True
    kwargs = dict(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    params: Any = SamplingParams(**kwargs, **extra)
    if logprob_prompts > 0:  # one SamplingParams per prompt, as flatrl's call passes them
        checked = set(rollout.check_prompt_indices(len(prompts), logprob_prompts))
        off = SamplingParams(**kwargs)
        params = [params if i in checked else off for i in range(len(prompts))]
    requests = list(prompts)
    if probes:
        short = dict(kwargs, n=1, max_tokens=min(PROBE_TOKENS, max_tokens))
        probe = SamplingParams(**short, logprobs=0)
        picked = rollout.check_prompt_indices(len(prompts), probes)
        params = (params if isinstance(params, list) else [params] * len(prompts)) + [probe] * len(picked)
        requests += [prompts[i] for i in picked]
    engine.llm.reset_prefix_cache()
    with Clock() as c:
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in requests], params, use_tqdm=False)
    tokens = sum(len(o.token_ids) for out in outs[: len(prompts)] for o in out.outputs)
    logprobs = (extra | {"prompts": logprob_prompts}) if extra else None
    if probes:
        with_lp = sum(o.logprobs is not None for out in outs[len(prompts) :] for o in out.outputs)
        logprobs = {
            "probes": len(picked),
            "probe_tokens": short["max_tokens"],
            "probes_with_logprobs": with_lp,
        }
    return dict(
        sequences=len(prompts) * n, tokens=tokens, seconds=round(c.s, 3), tok_per_s=tokens / c.s,
        logprobs=logprobs,
    )  # fmt: skip


# the runs of the module docstring; K a count of prompts (1 or more), `#k` a repeat
RUN_FORMS = (
    "bare_n1, bare_n8, bare_n8_lp, bare_n8_lpK, bare_n8_probeK, "
    "flatrl_n8_{call,all,request,woken,onrollouts,threadsall,checkK}"
)
RUN_NAME = re.compile(
    r"(bare_n1|bare_n8|bare_n8_lp([1-9]\d*)?|bare_n8_probe[1-9]\d*"
    r"|flatrl_n8_(call|all|request|woken|onrollouts|threadsall|check[1-9]\d*))(#\d+)?"
)

# bare_n8_probeK's short requests: as many tokens as flatrl's probes
PROBE_TOKENS = rollout.RolloutConfig.logprob_check_tokens


def run_flatrl(
    engine: rollout.VLLMEngine,
    prompts: list[list[int]],
    n: int,
    max_tokens: int,
    per_request: bool,
    logprob_check_prompts: int,
    **cfg: Any,
) -> dict:
    """One flatrl engine.generate call (seeded and with probes, as rl.generate calls it), `cfg` replacing
    RolloutConfig fields for it. Tokens count the rollouts' (the probes are the check's, reported apart)."""
    base = engine.cfg
    engine.cfg = dataclasses.replace(
        base, per_request_seeds=per_request, logprob_check_prompts=logprob_check_prompts, **cfg
    )
    engine.llm.reset_prefix_cache()
    try:
        with Clock() as c:
            out = engine.generate(prompts, rollout.SamplingConfig(n=n), max_tokens, seed=1234, probes=True)
    finally:
        engine.cfg = base
    samples = [s for s in out if not s.probe]
    tokens = sum(len(s.response_ids) for s in samples)
    return dict(
        sequences=len(samples), tokens=tokens, seconds=round(c.s, 3), tok_per_s=tokens / c.s,
        logprobs=dict(
            logprob_check_prompts=logprob_check_prompts,
            samples_with_logprobs=sum(s.logprobs is not None for s in samples),
            probes=sum(s.probe for s in out),
            probe_tokens=sum(len(s.response_ids) for s in out if s.probe),
        ),
        **({"cfg": cfg} if cfg else {}),
    )  # fmt: skip


def main(args: argparse.Namespace) -> dict:
    """Builds the model, starts one engine, runs the selected runs; returns the result dict."""
    work = args.workdir or tempfile.mkdtemp(prefix="flatrl-bench-")
    path = args.model_path or common.build_model(args.model, f"{work}/{args.model}")
    cfg = rollout.RolloutConfig(
        ignore_eos=True, gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        enforce_eager=args.toy, cpu_kvcache_space_gb=1,
    )  # fmt: skip
    with Clock() as start:
        engine = rollout.make_engine(cfg, str(path), max_model_len=args.prompt_len + args.response_len)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = common.random_prompts(args.num_prompts, args.prompt_len, vocab)
    # Warm-up, untimed: one short call (both parameter paths: a checked and an unchecked prompt), then one call of
    # the runs' full size, so first-call costs stay out of the figures. With the short call alone the first timed
    # call still paid them: bare_n8 took 6.52 s, then 4.94 at #2, at a lower power draw (228 W against 284; the host
    # busy, the GPU waiting), while flatrl's calls between took 5.11 and 5.13 (H100, SmolLM2-135M, 428ed92; 8.60
    # then 6.74 at 0.5B, 71b1a5f), and the mean of the two bare calls flattered flatrl's ratio.
    run_flatrl(engine, prompts[:2], 2, 8, False, 1)
    run_bare(engine, prompts, args.n, args.response_len, 0)
    runs = {}
    # --profile-gen: each vLLM call's sampled stacks from here on
    calls = gen_profile.install() if args.profile_gen else None
    with common.ClockWatch() as clocks, common.HostWatch() as host_speed:
        for name in args.runs.split(","):
            base = name.partition("#")[0]  # `bare_n8#2`: bare_n8 again, kept under its own name
            first_call = len(calls) if calls is not None else 0
            host0 = rollout.host_seconds()
            t0 = time.perf_counter()
            if base in ("bare_n1", "bare_n8") or base.startswith("bare_n8_lp"):
                n = 1 if base == "bare_n1" else args.n
                lp = int(base.removeprefix("bare_n8_lp") or -1) if base.startswith("bare_n8_lp") else 0
                runs[name] = run_bare(engine, prompts, n, args.response_len, lp)
            elif base.startswith("bare_n8_probe"):
                probes = int(base.removeprefix("bare_n8_probe"))
                runs[name] = run_bare(engine, prompts, args.n, args.response_len, 0, probes)
            elif base in ("flatrl_n8_threadsall", "flatrl_n8_onrollouts"):  # one default as before 2026-12-07
                was = (
                    dict(generate_threads=0)
                    if base == "flatrl_n8_threadsall"
                    else dict(logprob_check_tokens=0)
                )
                k = args.logprob_check_prompts
                runs[name] = run_flatrl(engine, prompts, args.n, args.response_len, False, k, **was)
            elif base == "flatrl_n8_woken":  # the call on a freshly woken engine, the wake untimed
                level = engine.cfg.sleep_level
                engine.cfg = dataclasses.replace(engine.cfg, sleep_level=1)  # weights kept: no push needed
                engine.sleep()
                engine.wake_up()
                engine.cfg = dataclasses.replace(engine.cfg, sleep_level=level)
                k = args.logprob_check_prompts
                runs[name] = run_flatrl(engine, prompts, args.n, args.response_len, False, k)
                runs[name]["woken"] = engine.sleep_enabled
            elif base in ("flatrl_n8_call", "flatrl_n8_all", "flatrl_n8_request") or base.startswith(
                "flatrl_n8_check"
            ):
                k = -1 if base == "flatrl_n8_all" else args.logprob_check_prompts
                if base.startswith("flatrl_n8_check"):  # flatrl_n8_call with logprob_check_prompts=K
                    k = int(base.removeprefix("flatrl_n8_check"))
                per_request = base == "flatrl_n8_request"
                runs[name] = run_flatrl(engine, prompts, args.n, args.response_len, per_request, k)
            else:
                raise ValueError(f"unknown run {name!r}")
            # the device's SM clock, heat and power during the run (None off CUDA or without NVML)
            runs[name]["gpu"] = common.clock_summary(clocks.samples, t0, time.perf_counter())
            # this process's CPU, the host's steal and torch.compile's seconds during the run: more work, a slower
            # host, or compiling
            cpu, steal, compiling = (
                end - start for start, end in zip(host0, rollout.host_seconds(), strict=True)
            )
            runs[name]["host"] = {
                "cpu_s": round(cpu, 3),
                "steal_s": round(steal, 3),
                "compile_s": round(compiling, 3),
                # a fixed Python loop's ms, timed in another process during the run (None: no sample in it)
                "loop_ms": host_speed.mean(t0, time.perf_counter()),
            }
            # the run's one vLLM call (bench_e2e.profile_split sets it beside grpo.py's)
            if calls is not None:
                runs[name]["profile"] = calls[-1] if len(calls) == first_call + 1 else None
            print(name, runs[name], flush=True)
    engine.shutdown()

    def tok_per_s(a: str) -> float | None:  # a run and its `#k` repeats together
        each = [r for name, r in runs.items() if name.partition("#")[0] == a]
        return sum(r["tokens"] for r in each) / sum(r["seconds"] for r in each) if each else None

    def ratio(a: str, b: str) -> float | None:
        x, y = tok_per_s(a), tok_per_s(b)
        return x / y if x and y else None

    k = args.logprob_check_prompts

    result = {
        "bench": "rollout",
        "model": args.model,
        "settings": dict(
            num_prompts=args.num_prompts,
            prompt_len=args.prompt_len,
            response_len=args.response_len,
            n=args.n,
            logprob_check_prompts=args.logprob_check_prompts,
        ),
        "engine": {k: v for k, v in engine.llm_kwargs.items() if k != "model"},
        "engine_start_s": round(start.s, 1),
        "runs": runs,
        "ratios": {
            "flatrl_n8_call_vs_bare_n8": ratio("flatrl_n8_call", "bare_n8"),
            "flatrl_n8_call_vs_bare_n1": ratio("flatrl_n8_call", "bare_n1"),
            "flatrl_n8_all_vs_bare_n8": ratio("flatrl_n8_all", "bare_n8"),  # flatrl before the subset
            "bare_n8_lp_vs_bare_n8": ratio("bare_n8_lp", "bare_n8"),  # vLLM's own logprob cost
            # vLLM's own cost of the default check's logprobs, and flatrl's work on top of it
            f"bare_n8_lp{k}_vs_bare_n8": ratio(f"bare_n8_lp{k}", "bare_n8"),
            f"flatrl_n8_call_vs_bare_n8_lp{k}": ratio("flatrl_n8_call", f"bare_n8_lp{k}"),
            f"bare_n8_probe{k}_vs_bare_n8": ratio(f"bare_n8_probe{k}", "bare_n8"),  # a check on short probes
            "flatrl_n8_woken_vs_flatrl_n8_call": ratio("flatrl_n8_woken", "flatrl_n8_call"),  # a woken engine
            # the defaults of 2026-12-07 against those before: probes; 1 thread in the call
            "flatrl_n8_call_vs_flatrl_n8_onrollouts": ratio("flatrl_n8_call", "flatrl_n8_onrollouts"),
            "flatrl_n8_call_vs_flatrl_n8_threadsall": ratio("flatrl_n8_call", "flatrl_n8_threadsall"),
            "flatrl_n8_all_vs_bare_n8_lp": ratio("flatrl_n8_all", "bare_n8_lp"),  # flatrl's own work
            "flatrl_n8_call_vs_flatrl_n8_all": ratio("flatrl_n8_call", "flatrl_n8_all"),  # the subset's gain
            "flatrl_n8_request_vs_bare_n8": ratio("flatrl_n8_request", "bare_n8"),
            "flatrl_n8_request_vs_bare_n1": ratio("flatrl_n8_request", "bare_n1"),
            "bare_n8_vs_bare_n1": ratio("bare_n8", "bare_n1"),
        },
        "default": "flatrl_n8_call" if not rollout.RolloutConfig.per_request_seeds else "flatrl_n8_request",
        "targets": {"default_vs_bare_n8": 0.95, "default_vs_bare_n1": 0.9},
        "hardware": common.hardware(),
    }
    return common.emit(result, args.out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b", choices=["toy", "0.5b", "1.5b", "smollm2"])
    p.add_argument(
        "--model-path", default=None,
        help="a model folder instead of building --model's (smollm2 needs it: the real SmolLM2-135M-Instruct)",
    )  # fmt: skip
    p.add_argument(
        "--toy",
        action="store_true",
        help="CPU smoke run: toy model; the shape flags below then default to 4 prompts x 2 of 16 + 16 tokens, 16 "
        "sequences, 2 checked prompts",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="256 x n=8: 2048 sequences, four batches of 512 (toy: 4)",
    )
    p.add_argument("--prompt-len", type=int, default=None, help="tokens: 256 (toy: 16)")
    p.add_argument(
        "--response-len", type=int, default=None, help="tokens, every response (ignore_eos): 512 (toy: 16)"
    )
    p.add_argument("--n", type=int, default=None, help="samples per prompt of the n=8 runs: 8 (toy: 2)")
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help=f"{rollout.RolloutConfig.max_num_seqs} (toy: 16)"
    )
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=rollout.RolloutConfig.gpu_memory_utilization
    )
    p.add_argument(
        "--logprob-check-prompts", type=int, default=None,
        help=f"flatrl_n8_call's rollout.logprob_check_prompts: {rollout.RolloutConfig.logprob_check_prompts} (toy: 2, "
        "so that the subset path runs)",
    )  # fmt: skip
    p.add_argument(
        "--profile-gen", action="store_true",
        help="each run's vLLM call with its Python stack sampled (bench/gen_profile.py): the run's `profile`",
    )  # fmt: skip
    p.add_argument("--runs", default="bare_n1,bare_n8,bare_n8_lp,flatrl_n8_call,flatrl_n8_all")
    p.add_argument("--workdir", default=None, help="where the model is built (reused); default a temp dir")
    p.add_argument("--out", default=None, help="also write the JSON line to this file")
    args = p.parse_args(argv)
    if bad := [r for r in args.runs.split(",") if not RUN_NAME.fullmatch(r)]:  # before the engine's minutes
        p.error(f"--runs: unknown run(s) {bad}; allowed (each may end in #k): {RUN_FORMS}")
    if args.model == "smollm2" and not args.model_path:
        p.error("--model smollm2 needs --model-path DIR (the real model's folder: scripts/get_smollm2.py)")
    defaults = dict(
        num_prompts=256, prompt_len=256, response_len=512, n=8, max_num_seqs=rollout.RolloutConfig.max_num_seqs,
        logprob_check_prompts=rollout.RolloutConfig.logprob_check_prompts,
    )  # fmt: skip
    if args.toy:  # a flag given is honoured
        args.model = "toy"
        defaults |= dict(
            num_prompts=4, prompt_len=16, response_len=16, n=2, max_num_seqs=16, logprob_check_prompts=2
        )
    for key, value in defaults.items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    return args


if __name__ == "__main__":
    main(parse())
