#!/usr/bin/env bash
# verl's config tree for the tests that compose bench/e2e_verl.py's Hydra overrides with it
# (tests/test_bench_e2e_verl.py, tests/test_bench_e2e_smollm2.py): verl 0.9.1 without its dependencies, and
# hydra-core + omegaconf (the versions of bench/build_verl_payload.sh), in .verl_config/, apart from .venv, since
# flatrl itself needs none of them. Nothing of verl runs: Hydra reads its YAML files. Idempotent. Without PyPI
# it says so and the two tests skip.
#   bash scripts/verl_config_site.sh && FLATRL_VERL_SITE=.verl_config .venv/bin/python -m pytest tests/test_bench_e2e_verl.py
set -uo pipefail
cd "$(dirname "$0")/.."
site=.verl_config
[ -f "$site/.done" ] && exit 0
rm -rf "$site.tmp"
if .venv/bin/python -m pip install -q --no-deps --target "$site.tmp" verl==0.9.1 hydra-core==1.3.8 omegaconf==2.3.0 \
  antlr4-python3-runtime==4.9.3 > /dev/null 2>&1 && [ -d "$site.tmp/verl/trainer/config" ]; then
  rm -rf "$site" && mv "$site.tmp" "$site" && touch "$site/.done"
else
  rm -rf "$site.tmp"
  echo "scripts/verl_config_site.sh: could not install verl's config tree from PyPI; its composition tests skip" >&2
fi
exit 0
