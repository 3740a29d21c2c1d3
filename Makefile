# Two commands on a fresh machine:  `make demo` (runs the engine on the default model) and `make test`.
# Every pip call goes through constraints.txt (CPU torch 2.13.0 from disk, triton 3.8.0).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1
JOBS ?= 2

.PHONY: setup assets demo lab test test-fast lint figures clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e ".[book,dev,assets]"
	touch $@

assets: setup
	$(PY) -m nanoengine assets

demo: assets
	$(PY) -m nanoengine demo

lab: assets
	$(VENV)/bin/jupyter lab book/

test: assets
	$(PY) -m pytest -n $(JOBS) --dist loadgroup tests

test-fast: setup
	$(PY) -m pytest -n $(JOBS) -m "not slow and not notebooks" tests

lint: setup
	$(VENV)/bin/ruff check nanoengine tests solutions

figures: assets
	MPLBACKEND=Agg $(PY) figures/make_figures.py

clean:
	rm -rf $(VENV) .pytest_cache
