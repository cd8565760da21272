# The two commands a user needs: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: venv demo test clean proto

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/ftjax demo

test: venv
	$(VENV)/bin/python -m pytest -q

proto: venv
	$(VENV)/bin/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) runs build *.egg-info
