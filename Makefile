# Set-up and entry points. `make test` and `make demo` work from a fresh clone: each builds .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build of torch installs here from local disk; on a CUDA machine override, e.g. TORCH_SPEC="torch==2.13.0".
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,demo

.PHONY: venv test demo bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

test: venv
	$(PY) -m pytest -q

demo: venv
	$(PY) -m modeling_kimi_vl.demo

bench: venv
	$(PY) benchmarks/bench_vision.py

clean:
	rm -rf $(VENV) build *.egg-info
