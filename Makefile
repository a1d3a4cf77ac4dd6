# cloudseg: `make train` then `make predict`. `make help` lists every target.
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
# uv resolves torch and torchvision as a matching pair; bootstrap it with pip when missing.
UV      := $(or $(shell command -v uv 2>/dev/null),.tools/bin/uv)
STAMP   := $(VENV)/.installed

.PHONY: help install test test-all bench lock clean

help:
	@echo "make install   create .venv (uv) with cloudseg and its dev extras"
	@echo "make test      install if needed, run the fast test suite"
	@echo "make test-all  also run the tests marked slow"
	@echo "make bench     print benchmark tables (RLE codec)"
	@echo "make lock      re-pin requirements.txt from pyproject.toml"

install: $(STAMP)

.tools/bin/uv:
	$(PYTHON) -m venv .tools
	.tools/bin/pip install -q uv

$(STAMP): pyproject.toml requirements.txt | $(UV)
	$(UV) venv -q --allow-existing --python $(PYTHON) $(VENV)
	$(UV) pip install -q --python $(PY) -r requirements.txt -e '.[dev]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest

test-all: $(STAMP)
	$(PY) -m pytest -m ''

bench: $(STAMP)
	$(PY) benchmarks/rle_speed.py

lock: | $(UV)
	$(UV) pip compile -q pyproject.toml --extra dev --python-version 3.11 -o requirements.txt

clean:
	rm -rf $(VENV) .tools .pytest_cache
