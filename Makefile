# Two entry points: `make demo` and `make test`. Both create .venv and install what they need.
# `make bench` runs every CPU benchmark in bench/ (see bench/README.md).
VENV   := .venv
PYTHON := $(VENV)/bin/python
PIP    := $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: demo test test-quick bench clean server-binaries

# The demo needs the project; the tests also its test tools (browser driver, fuzzer).
$(VENV)/.demo-stamp: pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test-stamp: pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PIP) -e '.[test]'
	touch $@

# DEMO_ARGS passes options to stack/demo.py: make demo DEMO_ARGS='--max-steps 200' for a quick run.
DEMO_ARGS ?=

demo: $(VENV)/.demo-stamp
	$(PYTHON) -m stack.demo $(DEMO_ARGS)

# Real programs some tests drive, from Debian's packages: Chromium for the dashboard page (never
# `playwright install`'s download), nginx for downloads behind the shipped proxy config, bubblewrap
# for the sandbox every attempt runs in (workers/sandbox.py), nftables for the control plane's ports
# closed to multi-node jobs (workers/egress.py).
CHROMIUM := /usr/bin/chromium
NGINX    := /usr/sbin/nginx
BWRAP    := /usr/bin/bwrap
NFT      := /usr/sbin/nft
SLURMCTLD := /usr/sbin/slurmctld
SLURMRESTD := /usr/sbin/slurmrestd

# The tests use PostgreSQL at 127.0.0.1:5432 and Redis at :6379 (TRAINYARD_TEST_POSTGRES_URL and _REDIS_URL
# name others) when they answer; else tests/private_services.py starts private ones for the run and stops them
# after. PYTEST_ARGS narrows the run: make test PYTEST_ARGS='tests/unit -k spec'. TEST_WORKERS pytest
# processes share the files (pytest-xdist, a file to a process: its module's stack is made once); the
# end-to-end tests mostly wait on processes they started, so two overlap on 2 cores. Three were no
# faster for certain (33:41 and 35:39, against 37:20 for two before this session's cuts) and made
# two Slurm tests miss their deadlines. TEST_WORKERS=0: one.
PYTEST_ARGS  ?=
TEST_WORKERS ?= 2

test: $(VENV)/.test-stamp $(CHROMIUM) $(NGINX) $(BWRAP) $(NFT) $(SLURMCTLD) $(SLURMRESTD) server-binaries
	$(PYTHON) -m tests.private_services -- $(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

# The inner loop's tier: unit, service and client tests on SQLite alone (no PostgreSQL, Redis or browser
# needed), about 2 minutes on 2 cores. `make test` stays the whole suite, and what CI runs.
test-quick: $(VENV)/.test-stamp
	TRAINYARD_TEST_BACKENDS=sqlite $(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=10 tests/unit tests/service tests/client $(PYTEST_ARGS)

# Each prints one JSON line with its peer's figure and the ratio; none asserts a time. About 11
# minutes on 2 cores, against PostgreSQL and Redis as the tests use them. A failing one stops the run.
BENCHMARKS := throughput job_start dispatch_latency scheduler_placement metric_ingest metrics_query dashboard_page \
              download_throughput checkpoint_stall checkpoint_ingest checkpoint_upload environment fair_share guard

$(VENV)/.bench-stamp: $(VENV)/.test-stamp
	$(PIP) -e '.[test,bench]'
	touch $@

bench: $(VENV)/.bench-stamp $(NGINX) $(BWRAP)
	@for name in $(BENCHMARKS); do \
	  echo "bench/$$name.py" >&2; PYTHONPATH=$(CURDIR) $(PYTHON) bench/$$name.py || exit 1; \
	done

$(CHROMIUM):
	$(call apt_install,chromium)

$(NGINX):
	$(call apt_install,nginx-light)

$(BWRAP):
	$(call apt_install,bubblewrap)

$(NFT):
	$(call apt_install,nftables)

# A throwaway Slurm cluster for the Slurm pool's tests (tests/slurm_cluster.py starts its own daemons),
# and its REST API (slurmrestd, a package of its own).
$(SLURMCTLD):
	$(call apt_install,slurm-wlm munge)

$(SLURMRESTD):
	$(call apt_install,slurmrestd)

# PostgreSQL's and Redis's server programs: for the private servers above and the restart tests' own.
# Debian keeps initdb off PATH, in /usr/lib/postgresql/<version>/bin.
server-binaries:
	@command -v redis-server >/dev/null || $(call apt_install,redis-server)
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || $(call apt_install,postgresql)

define apt_install
	apt-get -o DPkg::Lock::Timeout=300 install -y -q $(1) >/dev/null 2>&1 || sudo -n apt-get -o DPkg::Lock::Timeout=300 install -y -q $(1) >/dev/null 2>&1 \
	  || (apt-get update -q && apt-get -o DPkg::Lock::Timeout=300 install -y -q $(1)) || echo "could not install $(1): the tests that need it will say so"
endef

clean:
	rm -rf $(VENV) .trainyard .trainyard-demo .pytest_cache
