# The two commands a user needs: `make demo` and `make test`. Both set up .venv on first use.
# `make slurm-test`: the cluster path on this one machine (a local Slurm cluster, as root).
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-unit lint docs docs-serve slurm-test clean proto

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/ftjax demo

# Everything: tests/unit, tests/integration, tests/cluster (ruff check and format among the unit tests),
# a test file at a time on each of TEST_WORKERS workers (pytest-xdist; TEST_WORKERS=0: one process).
TEST_WORKERS ?= 3
test: venv
	$(VENV)/bin/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The fast loop: pure functions and fakes, no process (under a minute).
test-unit: venv
	$(VENV)/bin/python -m pytest -q tests/unit

# ruff, then mypy on ftjax/ (configured in pyproject.toml; tests/unit/test_types.py runs it too).
lint: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

# A Slurm cluster of 4 nodes on this machine (scripts/local_slurm.sh: installs slurm and munge with
# apt when missing), the job `ftjax launch --emit slurm` writes run on it with a host lost mid-run
# (at reduced degree) and a requeue (tests/cluster/test_slurm.py), and the cluster taken down again,
# whatever the outcome.
slurm-test: venv
	bash scripts/local_slurm.sh up && FTJAX_SLURM_TEST=1 $(VENV)/bin/python -m pytest -q tests/cluster/test_slurm.py; \
	  code=$$?; bash scripts/local_slurm.sh down; exit $$code

# The docs site (mkdocs.yml): built into site/ with --strict (a broken link fails it); served on localhost:8000.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

proto: venv
	$(VENV)/bin/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) runs build site *.egg-info
