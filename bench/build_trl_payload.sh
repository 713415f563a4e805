#!/usr/bin/env bash
# The TRL peer of bench_e2e.py for the H200 (no network there): the three wheels that ran TRL 1.16's colocated
# GRPOTrainer on top of the vLLM payload, peft 0.20.0 for its LoRA (`--model smollm2`; the version the verl payload
# carries; what it requires comes with the device's accelerate and transformers), and
# tyro with its dependencies, which flatrl's scripts need and the device lacks (bench/README.md), into .gpu_trl/ (a few MB,
# git-ignored by .gitignore's /.gpu*/). Run here in the project root, then carry .gpu_trl with `bash bench/run_h200.sh 2`.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
rm -rf .gpu_trl && mkdir -p .gpu_trl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform any -d .gpu_trl trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 \
  peft==0.20.0 tyro==1.0.17 docstring-parser==0.18.0 shtab==1.13.0 typeguard==4.6.1  # the device has no tyro (config.py)
ls -la .gpu_trl
