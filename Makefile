# Two entry points: `make demo` and `make test`. Both create .venv and install what they need.
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test clean

$(STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m trainyard.demo

# The dashboard test drives Debian's Chromium (never `playwright install`'s download).
CHROMIUM := /usr/bin/chromium

test: $(STAMP) $(CHROMIUM)
	$(PYTHON) -m pytest

$(CHROMIUM):
	apt-get install -y -q chromium >/dev/null 2>&1 || sudo -n apt-get install -y -q chromium >/dev/null 2>&1 \
	  || (apt-get update -q && apt-get install -y -q chromium) || echo "could not install chromium: the dashboard test will say so"

clean:
	rm -rf $(VENV) .trainyard .trainyard-demo .pytest_cache
