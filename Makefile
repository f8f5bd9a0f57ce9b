# Two entry points: `make demo` and `make test`. Both create .venv and install what they need.
# `make bench` runs every CPU benchmark in bench/ (see bench/README.md).
VENV   := .venv
PYTHON := $(VENV)/bin/python
PIP    := $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: demo test bench clean

# The demo needs the project; the tests also its test tools (browser driver, fuzzer).
$(VENV)/.demo-stamp: pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test-stamp: pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PIP) -e '.[test]'
	touch $@

demo: $(VENV)/.demo-stamp
	$(PYTHON) -m service.demo

# Real programs some tests drive, from Debian's packages: Chromium for the dashboard page (never
# `playwright install`'s download), nginx for downloads behind the shipped proxy config, bubblewrap
# for the sandbox every attempt runs in (workers/sandbox.py).
CHROMIUM := /usr/bin/chromium
NGINX    := /usr/sbin/nginx
BWRAP    := /usr/bin/bwrap

test: $(VENV)/.test-stamp $(CHROMIUM) $(NGINX) $(BWRAP)
	$(PYTHON) -m pytest

# Each prints one JSON line with its peer's figure and the ratio; none asserts a time. About 5
# minutes on 2 cores, against PostgreSQL and Redis as the tests use them. A failing one stops the run.
BENCHMARKS := throughput job_start dispatch_latency scheduler_placement metric_ingest metrics_query dashboard_page \
              download_throughput checkpoint_stall checkpoint_ingest

bench: $(VENV)/.test-stamp $(NGINX) $(BWRAP)
	@for name in $(BENCHMARKS); do \
	  echo "bench/$$name.py" >&2; PYTHONPATH=$(CURDIR) $(PYTHON) bench/$$name.py || exit 1; \
	done

$(CHROMIUM):
	$(call apt_install,chromium)

$(NGINX):
	$(call apt_install,nginx-light)

$(BWRAP):
	$(call apt_install,bubblewrap)

define apt_install
	apt-get install -y -q $(1) >/dev/null 2>&1 || sudo -n apt-get install -y -q $(1) >/dev/null 2>&1 \
	  || (apt-get update -q && apt-get install -y -q $(1)) || echo "could not install $(1): the tests that need it will say so"
endef

clean:
	rm -rf $(VENV) .trainyard .trainyard-demo .pytest_cache
