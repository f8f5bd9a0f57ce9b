# Two entry points: `make demo` and `make test`. Both create .venv and install what they need.
VENV   := .venv
PYTHON := $(VENV)/bin/python
PIP    := $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: demo test clean

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
	$(PYTHON) -m trainyard.demo

# The dashboard test drives Debian's Chromium (never `playwright install`'s download).
CHROMIUM := /usr/bin/chromium

test: $(VENV)/.test-stamp $(CHROMIUM)
	$(PYTHON) -m pytest

$(CHROMIUM):
	apt-get install -y -q chromium >/dev/null 2>&1 || sudo -n apt-get install -y -q chromium >/dev/null 2>&1 \
	  || (apt-get update -q && apt-get install -y -q chromium) || echo "could not install chromium: the dashboard test will say so"

clean:
	rm -rf $(VENV) .trainyard .trainyard-demo .pytest_cache
