# `make run` and `make test` set up .venv on first use (a few minutes), then do nothing more for it.
PY      := .venv/bin/python
STAMP   := .venv/.installed
CONFIG  ?= configs/tiny.yaml
EXTRAS  ?= dev,browser,environments
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1

.PHONY: run test lint setup bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

run: $(STAMP)
	.venv/bin/gptforge run -c $(CONFIG)

lint: $(STAMP)
	.venv/bin/ruff check .

test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --junitxml=.pytest/junit.xml

bench: $(STAMP)
	$(PY) bench/tokenize_bench.py

clean:
	rm -rf runs .pytest_cache
