# Two commands on a fresh machine: `make demo` and `make test`. Both create (or reuse) .venv and install
# what they need. torch is pinned to 2.13.0 first: on these machines that pin is a local CPU wheel, while
# any other spec may pull a multi-GB CUDA build. The package itself only asks for torch>=2.4.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 || \
		$(PY) -m pip install --quiet 'torch>=2.4' --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/refbus up

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) -m bench.bus

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis
