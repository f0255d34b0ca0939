#!/usr/bin/env bash
# Creates the venv with the torch you ask for and builds c10d_ext into it. Idempotent: a second
# run installs nothing and recompiles only what changed; asking for another torch replaces the
# venv's torch and rebuilds against it. Needs nothing but python3 (3.10+), g++ and PyPI.
#
#   TORCH_SPEC   pip requirement for torch (default: requirements-torch.txt); any release 2.11-2.15
#   PYTHON       interpreter for a new venv (default python3)
#   VENV         the venv (default .venv)
#   MYCCL_WITH_NCCL  0: no NCCL engine; 1: require it; unset: build it when torch is a CUDA build
#   MYCCL_BUILD_TESTS  1 (default here): also build c10d_ext._test_double, the CUDA test double
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-$(grep -v '^#' requirements-torch.txt | head -1)}
VPY="$VENV/bin/python"

if [ ! -x "$VPY" ]; then
  "$PY" -m venv "$VENV"
fi

# Is the venv's torch the one asked for? (`==2.14.1` also matches 2.14.1+cu130, as in pip.)
torch_ok() {
  "$VPY" - "$TORCH_SPEC" <<'EOF' 2>/dev/null
import sys
from packaging.requirements import Requirement
import torch, pytest, xdist, pytest_timeout, numpy  # noqa: F401  (the test tools too)
req = Requirement(sys.argv[1])
sys.exit(0 if req.name == "torch" and req.specifier.contains(torch.__version__.split("+")[0], prereleases=True) else 1)
EOF
}

t_install=$SECONDS
if ! torch_ok; then
  echo "setup: installing $TORCH_SPEC into $VENV"
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q "$TORCH_SPEC" packaging "setuptools>=70.1" wheel ninja numpy \
    pytest pytest-xdist pytest-timeout matplotlib
fi

# nccl.h includes the CUDA runtime headers, which torch's wheels do not ship: two small wheels at
# torch's own CUDA version carry them (CUDA_HEADER_WHEELS overrides the choice).
CUDA_VERSION=$("$VPY" -c "import torch; print(torch.version.cuda or '')")
if [ -n "$CUDA_VERSION" ] && [ "${MYCCL_WITH_NCCL:-auto}" != 0 ]; then
  CUDA_HEADER_WHEELS=${CUDA_HEADER_WHEELS:-"nvidia-cuda-crt==$CUDA_VERSION.* nvidia-cuda-cccl==$CUDA_VERSION.*"}
  if ! "$VPY" -c "import importlib.metadata as m, sys
sys.exit(not all(m.version(p).startswith('$CUDA_VERSION.') for p in ('nvidia-cuda-crt', 'nvidia-cuda-cccl')))" 2>/dev/null; then
    # shellcheck disable=SC2086
    "$VPY" -m pip install -q $CUDA_HEADER_WHEELS
  fi
fi

echo "setup: install took $(( SECONDS - t_install )) s"

# The extension: torch's BuildExtension with ninja, against the venv's torch (objects are kept
# per torch version under build/, so switching back and forth recompiles nothing).
t_build=$SECONDS
MYCCL_BUILD_TESTS=${MYCCL_BUILD_TESTS:-1} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$VPY" -m pip install -q --no-build-isolation --no-deps -e .
echo "setup: build took $(( SECONDS - t_build )) s"
"$VPY" -c "import c10d_ext, json; print('c10d_ext built:', json.dumps(c10d_ext.build_info()))"
