# The two commands of the README. Each works on a fresh machine (python3 + g++ + PyPI).
.PHONY: demo test setup bench clean

setup:
	bash scripts/setup.sh

# Main job: 2-rank DDP training on myccl next to gloo, loss and throughput side by side.
demo: setup
	.venv/bin/torchrun --nproc-per-node 2 examples/train.py

# Whole test suite (multi-process tests have their own timeouts; pytest-timeout backs them up).
test: setup
	.venv/bin/python -m pytest -n 2 tests

bench: setup
	.venv/bin/python benchmarks/collbench.py --world-size 2

clean:
	rm -rf build *.egg-info c10d_ext/_C*.so c10d_ext/_build_info.py
