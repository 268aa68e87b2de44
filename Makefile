# Two entry points: `make demo` shows flexgen working, `make test` runs the CPU suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q torch
	$(PY) -m pip install -q -e ".[test,cuda13]"
	touch $(STAMP)

.PHONY: install demo test gpu-test
install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests || [ $$? -eq 5 ]

gpu-test: $(STAMP)
	$(PY) -m pytest -q -m gpu tests
