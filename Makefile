# Two commands on a fresh machine:  `make demo` (runs the engine on the default model) and `make test`.
# Every pip call goes through constraints.txt (CPU torch 2.13.0 from disk; it also pins triton for later).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1
JOBS ?= 2

.PHONY: setup assets demo lab test test-fast lint figures book-html clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "nanoengine needs Python 3.11+, but $(PYTHON) is " + sys.version.split()[0] + "; run make PYTHON=python3.11 ...")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e ".[book,dev,assets]"
	touch $@

assets: setup
	$(PY) -m nanoengine assets
	$(PY) -m nanoengine.kernels

demo: assets
	$(PY) -m nanoengine demo

lab: assets
	$(VENV)/bin/jupyter lab book/

# The exercise tests run against the reference solutions here; a learner runs them against exercises/:
#   .venv/bin/pytest tests/exercises/test_ch03_paged_kv.py
# One OpenMP thread per process: two xdist workers (and the notebook kernels and subprocesses they start)
# share two cores, and a 2-thread torch process next to a busy core runs ~40x slower.
TEST_ENV := OMP_NUM_THREADS=1 NANOENGINE_IMPL=solutions
test: assets
	$(TEST_ENV) $(PY) -m pytest -n $(JOBS) --dist loadgroup --durations=25 tests

test-fast: assets
	$(TEST_ENV) $(PY) -m pytest -n $(JOBS) --dist loadgroup -m "not slow and not notebooks" tests

lint: setup
	$(VENV)/bin/ruff check nanoengine tests solutions scripts figures
	$(PY) scripts/make_exercises.py --check

figures: assets
	MPLBACKEND=Agg $(PY) figures/make_figures.py

# The book as HTML to read without a kernel (widgets embedded as they were after the run): build/book/
book-html: assets
	$(TEST_ENV) $(PY) scripts/book_html.py

clean:
	rm -rf $(VENV) .pytest_cache
