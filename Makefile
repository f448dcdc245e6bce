# Two entry points, each enough on a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: serve test lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

serve: $(BIN)/.installed
	$(BIN)/qosgate serve $(ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

bench: $(BIN)/.installed
	$(BIN)/python bench/core_ops.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
