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

test: $(STAMP)
	$(PYTHON) -m pytest

clean:
	rm -rf $(VENV) .trainyard .trainyard-demo .pytest_cache
