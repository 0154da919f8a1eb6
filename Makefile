# Fresh-machine entry points: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memfit-installed

.PHONY: install demo test bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the pinned CPU wheel, so nothing pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/memfit demo

test: $(STAMP)
	$(VENV)/bin/ruff check memfit bench tests
	$(PY) -m pytest

bench: $(STAMP)
	PYTHONPATH=. $(PY) bench/plan_speed.py

clean:
	rm -rf $(VENV) .pytest_cache
