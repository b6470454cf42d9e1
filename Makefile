# Two entry points on a fresh machine: `make demo` (build ResNet-152, serve it, classify) and `make test`;
# `make docs` builds the documentation site into docs/_build/html.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
FLOOR := .venv310

.PHONY: setup demo test docs clean

setup: $(VENV)/.installed $(FLOOR)/.installed

# Python 3.10, pyproject's floor, where one is found (PATH, $PYTHON310, pyenv): .venv310 without torch, for
# tests/test_python_floor.py; the whole project resolved for 3.10 first, so a pin that left 3.10 fails here.
# Without a 3.10 it makes nothing, says so, and runs again (a moment) at the next make setup.
$(FLOOR)/.installed: $(VENV)/.installed pyproject.toml tools/floor_env.py
	$(BIN)/python tools/floor_env.py --venv $(FLOOR)

# --isolated: ignore the machine's pip config, whose find-links hold a CPU-only torch that
# torchvision cannot load against; the registry's default torch works on CPU and GPU. The project itself is installed
# by uv (pinned, from the registry), which reads no pip config either and resolves the same 157 packages: 5-25 s
# where pip took 161 s (it unpacks and byte-compiles ~4 GB of torch and CUDA wheels every time; uv links them from
# its cache and compiles a module when it is first imported).
UV := uv==0.13.9
$(VENV)/.installed: pyproject.toml tools/install_perf_analyzer.sh tools/install_proxy.sh tools/install_java.sh \
		tools/gpu_carry.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --isolated --quiet --upgrade pip '$(UV)'
	$(BIN)/uv pip install --python $(BIN)/python --quiet -e '.[test]'
	tools/install_perf_analyzer.sh $(VENV)
	tools/install_proxy.sh
	tools/install_java.sh
	# The GPU round's dry run in the GPU machine's environment (perf.gpu.standin, tests/test_gpu_round.py): what a
	# device call carries, built for this Python, and the NumPy 2 that machine's Python has.
	tools/gpu_carry.sh --python-version $$($(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
		--out $(VENV)/gpu-carry --no-pack
	$(BIN)/python -m pip download --isolated --quiet --no-deps --only-binary=:all: -d $(VENV)/gpu-image 'numpy>=2,<3'
	touch $@

demo: setup
	$(BIN)/python -m clients.demo

# TEST_WORKERS=N (N > 0): each test file on one of N pytest-xdist workers (--dist loadfile), then the files marked
# serial, alone. 2 by default on the 2-core machine (3 kept both cores busy and went slower: at 20 min it had done a
# fifth of the tests; see docs/contributing.md); TEST_WORKERS=0 runs everything in one process, in pytest's order.
TEST_WORKERS ?= 2
test: setup
ifeq ($(TEST_WORKERS),0)
	$(BIN)/python -m pytest -q
else
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -q -m serial
endif

# Strict: any warning (a broken reference, a page missing from the toctree) fails the build.
docs: setup
	$(BIN)/python -m sphinx -W --keep-going -n -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

clean:
	rm -rf $(VENV) $(FLOOR) model_repository/*/
