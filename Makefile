# Set-up and entry points. `make test` and `make demo` work from a fresh clone: each builds .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build of torch installs here from local disk; on a CUDA machine override, e.g. TORCH_SPEC="torch==2.13.0".
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,demo

.PHONY: venv browser test demo bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

# The browser test (tests/test_app_browser.py) drives Debian's chromium; install it when missing. CI runs as root
# with apt access; KIMI_VL_SKIP_BROWSER_TEST=1 skips both this step and that test on a developer machine. A failed
# install does not stop `make test`: the other tests still run, and the browser test fails saying what is missing.
browser:
	-@test -n "$(KIMI_VL_SKIP_BROWSER_TEST)" || test -x /usr/bin/chromium || { \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; }

test: venv browser
	$(PY) -m pytest -q

# e.g. `make demo DEMO_ARGS="--model tiny"`; `python app.py --help` lists the options.
demo: venv
	$(PY) app.py $(DEMO_ARGS)

# The CPU benchmarks; each prints a table and writes JSON (with the machine) to benchmarks/results/.
# On one GPU: `bash benchmarks/gpu_check.sh`.
bench: venv
	$(PY) benchmarks/bench_vision.py
	$(PY) benchmarks/bench_image_processor.py
	$(PY) benchmarks/bench_generate.py
	$(VENV)/bin/torchrun --nproc_per_node 2 benchmarks/bench_parallel_vision.py
	$(PY) benchmarks/bench_hub_export_memory.py

clean:
	rm -rf $(VENV) build *.egg-info
