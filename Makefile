# Two commands set up and run everything on a fresh machine: `make demo`, `make test`.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# CPU build of torch unless the machine has CUDA (then pip's default, a CUDA build).
TORCH := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: install demo test test-fast lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,hf]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	@mkdir -p out
	$(BIN)/plan mask examples/masks/mixed_modality.mask --batch examples/batches/mixed.json --width 48
	$(BIN)/plan compile --batch examples/batches/demo.json --mask examples/masks/streaming.mask \
		--devices 4 --heads 8 --kv-heads 2 --head-dim 64 --block-size 256 -o out/demo.plan
	$(BIN)/plan stats out/demo.plan
	$(BIN)/plan run out/demo.plan --check --dtype float32
	$(BIN)/plan run out/demo.plan --check --dtype bfloat16
	$(BIN)/plan run out/demo.plan --procs 4 --check

# lint + types, then every test: the fast tier and the slow one (processes, training, browser),
# on two pytest workers (TEST_WORKERS=0: in this process, one test at a time).
TEST_WORKERS ?= 2
test: lint
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -n $(TEST_WORKERS)

test-fast: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow"

# ruff, and mypy on the installed layout (the repository root is the package `attnplan`).
lint: $(STAMP)
	$(BIN)/ruff check .
	@tmp=$$(mktemp -d) && ln -s "$(CURDIR)" "$$tmp/attnplan" && cd "$$tmp" && \
		"$(CURDIR)/$(BIN)/mypy" --config-file "$(CURDIR)/pyproject.toml" --cache-dir "$(CURDIR)/$(VENV)/mypy-cache" \
		--no-namespace-packages -p attnplan; rc=$$?; rm -rf "$$tmp"; exit $$rc

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
