#!/usr/bin/env bash
# Creates .venv with the pinned torch and builds c10d_ext into it. Idempotent: a second run
# only rebuilds what changed. Needs nothing but python3 (3.10+), g++ and network access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
# nccl.h needs CUDA headers; these small wheels carry them (CUDA 13.0, as torch 2.14.1 uses).
CUDA_HEADER_WHEELS=${CUDA_HEADER_WHEELS:-"nvidia-cuda-crt==13.0.* nvidia-cuda-cccl==13.0.*"}
export MYCCL_WITH_NCCL=${MYCCL_WITH_NCCL:-1}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, pytest, xdist, pytest_timeout, numpy" 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q "$TORCH_SPEC" $CUDA_HEADER_WHEELS \
    "setuptools>=70.1" wheel ninja numpy pytest pytest-xdist pytest-timeout matplotlib
fi
# The extension: torch's BuildExtension with ninja, against the torch just installed.
MAX_JOBS=${MAX_JOBS:-$(nproc)} .venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .
.venv/bin/python -c "import c10d_ext, json; print('c10d_ext built:', json.dumps(c10d_ext.build_info()))"
