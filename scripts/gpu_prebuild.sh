#!/usr/bin/env bash
# Run here, before a GPU visit: builds c10d_ext._C with the NCCL engine against the GPU machine's
# torch and Python (torch 2.11.0+cu130, CPython 3.12) into prebuilt/ (git-ignored), so that
# `make gpu-check` there spends no GPU time compiling. The device tool carries it when the run
# names it in `carry`; gpu_check.sh uses it only if its torch is that machine's and it imports,
# and builds there otherwise.
#
#   GPU_PREBUILD_PYTHON  an interpreter whose torch is the GPU machine's (required), with the CUDA
#                        header wheels (nvidia-cuda-crt, nvidia-cuda-cccl at torch's CUDA version),
#                        setuptools >= 70.1 and ninja installed
#   GPU_PREBUILD_DIR     where the tree is copied and built (default /tmp/c10d_ext-prebuild; kept,
#                        so a second run compiles only what changed)
#   MAX_JOBS             parallel compiles (default nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${GPU_PREBUILD_PYTHON:?set GPU_PREBUILD_PYTHON to a python with the GPU machine\'s torch}
WORK=${GPU_PREBUILD_DIR:-/tmp/c10d_ext-prebuild}
export MAX_JOBS=${MAX_JOBS:-$(nproc)} MYCCL_WITH_NCCL=1

"$PY" -c "import torch, sys; print('prebuild: torch', torch.__version__, 'CUDA', torch.version.cuda, 'python', sys.version.split()[0])"
mkdir -p "$WORK"
# the tree as it is now (committed or not, what the device tool would send), times kept for ninja
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$WORK"
(cd "$WORK" && "$PY" setup.py -q build_ext --inplace)
rm -rf prebuilt/c10d_ext
mkdir -p prebuilt/c10d_ext
cp "$WORK"/c10d_ext/_C.*.so "$WORK"/c10d_ext/_build_info.py prebuilt/c10d_ext/
(cd "$WORK" && "$PY" -c "import c10d_ext; print('prebuild:', c10d_ext.build_info())")
du -sh prebuilt/c10d_ext/_C.*.so
echo "prebuild: carry [\"wheelhouse\", \"prebuilt\"] on the GPU run"
