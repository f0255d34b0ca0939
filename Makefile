# The two commands of the README. Each works on a fresh machine (python3 + g++ + PyPI).
# TORCH_SPEC picks the torch (default in requirements-torch.txt; any release 2.11-2.15), PYTHON the
# interpreter of a new venv, VENV the venv (default .venv): see scripts/setup.sh.
.PHONY: demo test test-compat test-matrix setup bench wheel clean gpu-check

VENV ?= .venv
export VENV
MATRIX ?=

setup:
	bash scripts/setup.sh

# Main job: 2-rank DDP training on myccl next to gloo, loss and throughput side by side.
demo: setup
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/train.py

# Whole test suite (multi-process tests have their own timeouts; pytest-timeout backs them up).
test: setup
	$(VENV)/bin/python -m pytest -n 2 tests

# What CI also runs against the oldest supported torch: the collective matrix, DDP (ours and
# torch's) and the CUDA tests, which skip without a GPU but still import and collect.
test-compat: setup
	$(VENV)/bin/python -m pytest -n 2 tests/backend/test_collectives.py $(MATRIX)
	$(VENV)/bin/python -m pytest -n 2 tests/ddp/test_ddp.py tests/ddp/test_ddp_cuda.py tests/cuda/test_cuda.py

# What CI runs against each other supported torch: the build and the collective matrix
# (MATRIX="-k '2-shm or 2-tcp'" narrows it to 2 ranks; test-compat's collectives too).
test-matrix: setup
	$(VENV)/bin/python -m pytest -n 2 tests/backend/test_collectives.py $(MATRIX)

bench: setup
	$(VENV)/bin/python benchmarks/collbench.py --world-size 2

# On a lent GPU machine, offline: builds with the NCCL engine from wheelhouse/ (filled beforehand by
# scripts/gpu_wheelhouse.sh) and runs the CUDA tests, collbench and DDP against torch's nccl into
# one report. No `setup` here: it would download torch; the machine's own torch is used.
gpu-check:
	bash scripts/gpu_check.sh

# A wheel for the venv's torch, named after it (c10d_ext-0.2.0+torch2.14-...whl) in dist/.
wheel: setup
	MYCCL_BUILD_TESTS=0 $(VENV)/bin/python -m pip wheel -q --no-build-isolation --no-deps -w dist .
	@ls -1 dist/*.whl

clean:
	rm -rf build dist *.egg-info c10d_ext/_C*.so c10d_ext/_test_double*.so c10d_ext/_build_info.py
