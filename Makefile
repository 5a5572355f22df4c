# Each target creates .venv on first use and installs the project into it (uv, from PyPI).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-long lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check uv
	$(VENV)/bin/uv pip install --python $(PY) -e '.[dev]'
	@# DeepSpeed JIT-compiles a shared-memory comm op on first use; build it once, here,
	@# so that training ranks never compile it concurrently.
	$(PY) -m tokenloom.trainer.distributed
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tokenloom demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q

# the long end-to-end tests: the README's step-by-step block, Ray clusters, Serve services,
# killed workers (CI runs them after `test`)
test-long: $(STAMP)
	$(PY) -m pytest -q -m long

bench: $(STAMP)
	$(PY) bench/bench_ingest.py

clean:
	rm -rf $(VENV) .tokenloom .pytest_cache .ruff_cache
