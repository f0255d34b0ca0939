#!/usr/bin/env bash
# Run here, with PyPI: fills wheelhouse/ with every wheel `make gpu-check` needs on the lent GPU
# machine, which has torch (2.11 + CUDA 13.0, Python 3.12) and NCCL but no network. The device
# tool carries wheelhouse/ there when the run names it in `carry` (64 MiB for everything carried).
#
#   GPU_PYTHON_VERSION  the GPU machine's Python (default 3.12)
#   GPU_CUDA_VERSION    its torch's CUDA version, torch.version.cuda (default 13.0)
#   WHEELHOUSE          the folder (default wheelhouse); emptied of old wheels first
#   WHEELHOUSE_MAX_MIB  refuse a wheelhouse larger than this (default 40: the tree travels too)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
PYV=${GPU_PYTHON_VERSION:-3.12}
CUDA=${GPU_CUDA_VERSION:-13.0}
WH=${WHEELHOUSE:-wheelhouse}
MAX_MIB=${WHEELHOUSE_MAX_MIB:-40}
ABI="cp${PYV/./}"

mapfile -t REQS < <(grep -v '^\s*#' scripts/gpu_requirements.txt | grep -v '^\s*$')
REQS+=("nvidia-cuda-crt==$CUDA.*" "nvidia-cuda-cccl==$CUDA.*")

mkdir -p "$WH"
rm -f "$WH"/*.whl
echo "gpu_wheelhouse: wheels for CPython $PYV ($ABI), CUDA $CUDA headers, into $WH/"
# manylinux_2_28 and 2014 (= 2_17) cover every wheel here; pure-Python wheels match any platform.
"$PY" -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp --abi "$ABI" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$WH" "${REQS[@]}"

# What is there and for what, read by gpu_check.sh (and by people).
{
  echo "# scripts/gpu_wheelhouse.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ): CPython $PYV, CUDA $CUDA"
  (cd "$WH" && ls -1 ./*.whl | sed 's|^\./||')
} > "$WH/MANIFEST.txt"

for bad in "$WH"/torch-*.whl "$WH"/nvidia_nccl*.whl; do
  if [ -e "$bad" ]; then
    echo "gpu_wheelhouse: $bad must not be here (the GPU machine has its own)" >&2
    exit 1
  fi
done

bytes=$(du -cb "$WH"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
(cd "$WH" && ls -1s --block-size=K ./*.whl | sed 's|\./||')
echo "gpu_wheelhouse: $(ls "$WH"/*.whl | wc -l) wheels, $(mib "$bytes") MiB" \
     "(+ $(mib "$tree") MiB of tracked files = $(mib $((bytes + tree))) MiB of the 64 MiB the device tool carries)"
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
  echo "gpu_wheelhouse: larger than WHEELHOUSE_MAX_MIB=$MAX_MIB" >&2
  exit 1
fi
