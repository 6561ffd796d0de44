# Set-up and entry points. `make test` and `make demo` work from a fresh clone: each builds .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The torch to install first (then nothing in pyproject.toml pulls another). On this project's CI machines the pinned
# release comes as a CPU build from local wheels; from PyPI on Linux it is the CUDA build (several GB). For a CPU-only
# machine elsewhere: TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC ?= torch==2.13.0
CHROMIUM ?= $(or $(KIMI_VL_CHROMIUM),/usr/bin/chromium)
EXTRAS ?= test,demo,train,lint
# Where `make tiny` writes the tiny Kimi-VL (ignored by git).
TINY_DIR ?= tiny-kimi-vl

.PHONY: venv browser test lint demo tiny bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || { echo "creating $(VENV) failed: install Python's venv module (Debian: apt-get install python3-venv)" >&2; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

# The browser test (tests/test_app_browser.py) drives Debian's chromium; install it when missing. CI runs as root
# with apt access; KIMI_VL_SKIP_BROWSER_TEST=1 skips both this step and that test on a developer machine. A failed
# install does not stop `make test`: the other tests still run, and the browser test fails saying what is missing.
browser:
	-@test -n "$(KIMI_VL_SKIP_BROWSER_TEST)" || test -x $(CHROMIUM) || { \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } || \
		echo "could not install chromium (needs root and Debian's apt); the browser test will fail" >&2

# Format and lint check (ruff, configured in pyproject.toml); `$(VENV)/bin/ruff format .` applies the formatting.
lint: venv
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: venv browser
	$(PY) -m pytest -q

# e.g. `make demo DEMO_ARGS="--model tiny"`; `python app.py --help` lists the options.
demo: venv
	$(PY) app.py $(DEMO_ARGS)

# A complete tiny Kimi-VL in the original hub layout (random weights, so random answers) for trying every entry point
# without the 32 GB model; rebuilt when what it is made from changes. Only a folder holding a tiny Kimi-VL is removed
# for the rebuild: any other TINY_DIR that holds files is left alone, and the writer refuses it.
# Removes $(TINY_DIR) only if it holds a tiny Kimi-VL: any other folder given as TINY_DIR is left alone.
REMOVE_TINY = $(PY) -c 'import shutil, sys; from modeling_kimi_vl.tiny_checkpoint import is_tiny_kimi_vl as tiny; \
	tiny(sys.argv[1]) and shutil.rmtree(sys.argv[1])' "$(TINY_DIR)"

tiny: $(TINY_DIR)/config.json

$(TINY_DIR)/config.json: $(VENV)/.installed modeling_kimi_vl/tiny_checkpoint.py image_processing/tiny_tokenizer.py \
		image_processing/chat_template.jinja $(wildcard tests/fixtures/reference_tiny/tiny_ref/*)
	$(REMOVE_TINY)
	$(PY) -m modeling_kimi_vl.tiny_checkpoint "$(TINY_DIR)"

# The CPU benchmarks; each prints a table and writes JSON (with the machine) to benchmarks/results/.
# On one GPU: `bash benchmarks/gpu_check.sh`.
bench: venv
	$(PY) -m benchmarks.bench_vision
	$(PY) -m benchmarks.bench_image_processor
	$(PY) -m benchmarks.bench_generate
	$(PY) -m benchmarks.bench_long_context --crossover
	$(PY) -m benchmarks.bench_long_context
	$(VENV)/bin/torchrun --nproc_per_node 2 -m benchmarks.bench_parallel_vision
	$(PY) -m benchmarks.bench_hub_export_memory
	$(PY) -m benchmarks.bench_demo_memory
	$(PY) -m benchmarks.bench_quantization

clean:
	-test ! -x $(PY) || $(REMOVE_TINY)
	rm -rf $(VENV) build *.egg-info
