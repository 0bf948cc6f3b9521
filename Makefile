# Two commands on a fresh machine: `make demo` and `make test`. Both create (or reuse) .venv and install
# what they need. torch is pinned to 2.13.0 first: on these machines that pin is a local CPU wheel, while
# any other spec may pull a multi-GB CUDA build. The package itself only asks for torch>=2.4.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: demo test slurm-test lint bench scale soak soak-slow clean prometheus iproute2 slurm

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 || \
		$(PY) -m pip install --quiet 'torch>=2.4' --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install --quiet -e '.[test,plot]'
	$(PY) -m pip install --quiet --no-deps nixl-cu12==1.5.1 || \
		echo "nixl-cu12 is not installable here: the NIXL tests will skip"  # the `nixl` extra, without CUDA deps
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/refbus up

# tests/test_observability.py evaluates every dashboard query on a real Prometheus server: Debian's package
# (pip has none). Installed when missing and this user may (root, or sudo without a password); otherwise
# that one test skips and says why. A no-op once it is installed.
prometheus:
	@command -v prometheus >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; \
		else echo "prometheus is missing and cannot be installed here: its test will skip"; exit 0; fi; \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq --no-install-recommends prometheus; }

# The cross-host tests build hosts from network namespaces (bench/hosts.py): root and iproute2's `ip`.
# Installed when missing and this user is root; elsewhere those tests skip and say why (a failure under
# REFBUS_REQUIRE_NETNS=1, which .ci/run sets).
iproute2:
	@command -v ip >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends iproute2; \
		else echo "iproute2 is missing and cannot be installed here: the namespace-host tests will skip"; fi; }

test: $(STAMP) prometheus iproute2
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The README's SLURM script, submitted to a Slurm cluster built on namespace hosts (tests/test_slurm.py):
# Debian's slurm-wlm and munge, installed when missing and this user is root; elsewhere the test skips and
# says why (a failure under REFBUS_REQUIRE_NETNS=1, which .ci/run sets).
slurm:
	@{ command -v slurmctld && command -v munged; } >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; \
		else echo "slurm-wlm and munge are missing and cannot be installed here: the SLURM test will skip"; fi; }

slurm-test: $(STAMP) iproute2 slurm
	REFBUS_SLURM=1 $(VENV)/bin/pytest $(PYTEST_ARGS) tests/test_slurm.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) -m bench.bus
	$(PY) -m bench.payload
	$(PY) -m bench.ps
	$(PY) -m bench.curve
	$(PY) -m bench.store

# The control plane at a large run's rates (not in `make test`): broker CPU, latency, headroom at 64/256 nodes.
scale: $(STAMP)
	$(PY) -m bench.scale

# A long run (not in `make test`): does every node's memory level off? SOAK_STEPS overrides the length.
SOAK_STEPS ?= 1000
soak: $(STAMP)
	$(PY) -m bench.soak --steps $(SOAK_STEPS)

# Trainers 4x slower than configured and small env-server budgets: backpressure bounds the work in flight.
soak-slow: $(STAMP)
	$(PY) -m bench.soak --steps 300 --slow-trainer 4 -- --env-server-budget-bytes 32768

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis
