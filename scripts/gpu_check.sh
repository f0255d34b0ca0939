#!/usr/bin/env bash
# `make gpu-check`: everything worth knowing about myccl on a CUDA machine, in one command, on a
# machine that has torch (a CUDA build) and its NCCL but no network: builds c10d_ext with the NCCL
# engine from wheelhouse/ (scripts/gpu_wheelhouse.sh fills it elsewhere), runs the CUDA tests,
# collbench against torch's nccl and a DDP training over myccl against nccl, and writes one
# report (markdown + JSON) with every step's log. A failed step does not stop the later ones;
# the exit status is 1 if any failed.
#
#   OUT                  where the report goes (default bench_out/gpu_check)
#   GPU_CHECK_STEPS      comma-separated subset of env,build,hostcost,test,test-multi,bench,ddp,hvd (default all);
#                        a step that needs the venv or the build runs env/build first if they are
#                        not there yet. Results of earlier calls on this machine stay in the report.
#   GPU_CHECK_BUDGET_S   seconds for the whole call (default 1140); a step gets what is left at most
#   GPU_CHECK_PYTHON     the interpreter that has torch (default: python3, python3.12 or python)
#   GPU_CHECK_VENV       the venv (default .venv-gpu, made with --system-site-packages so that it
#                        sees the machine's torch); "none": install into GPU_CHECK_PYTHON's own
#   GPU_CHECK_DRY_RUN=1  no GPU needed: the plan, the python and the wheelhouse checked, the venv
#                        made and filled, the build configured (GPU_CHECK_DRY_RUN_BUILD=1: built),
#                        the tests collected, the benchmarks' refusal without a GPU; a report too
#   GPU_CHECK_FRESH=1    forget results of earlier calls
#   GPU_CHECK_LIMITS     other per-step limits in seconds, e.g. "test=600,bench=400"
#   GPU_CHECK_BENCH_SIZES  collbench's sizes (default 8,1M,4M,16M,64M,256M,1G)
#   GPU_CHECK_PREBUILT   a prebuilt extension (default prebuilt/, from scripts/gpu_prebuild.sh)
#   WHEELHOUSE, MAX_JOBS (default nproc), GPU_CHECK_TEST_JOBS (pytest -n, default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

export GC_STATE=${GC_STATE:-$ROOT/bench_out/gpu_check/.state}
export GC_OUT=${OUT:-$ROOT/bench_out/gpu_check}
export WHEELHOUSE=${WHEELHOUSE:-$ROOT/wheelhouse}
export GC_DRY=${GPU_CHECK_DRY_RUN:-0}
export GC_VENV=${GPU_CHECK_VENV:-$ROOT/.venv-gpu}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export GC_TEST_JOBS=${GPU_CHECK_TEST_JOBS:-2}
# no venv: pip installs into the interpreter's own environment, even one marked externally managed
[ "$GC_VENV" = none ] && export PIP_BREAK_SYSTEM_PACKAGES=1
# torch's BuildExtension compiles with $CXX, else c++
if [ -z "${CXX:-}" ] && ! command -v c++ >/dev/null && command -v g++ >/dev/null; then export CXX=g++; fi
ALL_STEPS=(env build hostcost test test-multi bench ddp hvd)
# Each step's own limit (seconds); the whole call is held to GPU_CHECK_BUDGET_S besides.
declare -A LIMIT=([env]=120 [build]=360 [hostcost]=240 [test]=420 [test-multi]=300 [bench]=300 [ddp]=180 [hvd]=240)
# ... and what each should take on one H100 with 16 cores (for the plan printed at the start)
declare -A EXPECT=([env]=30 [build]=180 [hostcost]=120 [test]=300 [test-multi]=0 [bench]=240 [ddp]=60 [hvd]=90)
IFS=, read -r -a _limits <<< "${GPU_CHECK_LIMITS:-}"
for _kv in "${_limits[@]}"; do
  [[ "$_kv" =~ ^([a-z-]+)=([0-9]+)$ ]] && [ -n "${LIMIT[${BASH_REMATCH[1]}]:-}" ] \
    || { echo "gpu-check: GPU_CHECK_LIMITS: bad entry '$_kv'" >&2; exit 2; }
  LIMIT[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
done
BUDGET=${GPU_CHECK_BUDGET_S:-1140}
REPORT_RESERVE=20
T0=$(date +%s)

log() { echo "gpu-check: $*"; }

# The interpreter the env step found (kept for the later steps and later calls) and the venv's.
load_python() {
  if [ -f "$GC_STATE/python.env" ]; then
    # shellcheck disable=SC1091
    source "$GC_STATE/python.env"
  fi
  if [ "$GC_VENV" != none ]; then VPY=$GC_VENV/bin/python; fi
  export PYBASE=${PYBASE:-} VPY=${VPY:-}
  if [ -n "$VPY" ] && [ "$GC_VENV" != none ]; then
    PATH="$(dirname "$VPY"):$PATH"  # ninja from the wheelhouse
    export PATH
  fi
}

# The python that has torch: GPU_CHECK_PYTHON, else the first candidate whose torch sees a GPU,
# else (dry run) the first with torch at all.
find_python() {
  local cands=() c first=""
  if [ -n "${GPU_CHECK_PYTHON:-}" ]; then cands=("$GPU_CHECK_PYTHON"); else cands=(python3 python3.12 python); fi
  for c in "${cands[@]}"; do
    command -v "$c" >/dev/null 2>&1 || continue
    local gpu
    gpu=$("$c" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null) || continue
    [ -z "$first" ] && first=$(command -v "$c")
    if [ "$gpu" = 1 ]; then command -v "$c"; return 0; fi
  done
  [ -n "$first" ] && echo "$first"
}

cuda_reqs() {  # the CUDA header wheels at torch's CUDA version (none for a CPU-only torch)
  local cuda
  cuda=$("$1" -c "import torch; print(torch.version.cuda or '')")
  [ -n "$cuda" ] && echo "nvidia-cuda-crt==$cuda.* nvidia-cuda-cccl==$cuda.*"
  return 0
}

tool_reqs() { grep -v '^\s*#' "$ROOT/scripts/gpu_requirements.txt" | grep -v '^\s*$'; }

# Offline pip: the wheelhouse only, without this machine's pip configuration, files or PIP_*
# variables (find-links of its own would hide a wheel missing from the wheelhouse).
opip() {
  local drop=() v
  for v in $(compgen -e | grep '^PIP_' || true); do
    [ "$v" = PIP_BREAK_SYSTEM_PACKAGES ] || drop+=(-u "$v")
  done
  env "${drop[@]}" PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 "$@"
}

ngpus() { "$VPY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0; }

# ---- the steps (each runs as `gpu_check.sh --step NAME` under `timeout`) ---------------------

step_env() {
  PYBASE=$(find_python) || true
  if [ -z "$PYBASE" ]; then
    echo "no python with torch found (tried ${GPU_CHECK_PYTHON:-python3 python3.12 python}); set GPU_CHECK_PYTHON"
    return 1
  fi
  echo "python with torch: $PYBASE"
  "$PYBASE" "$ROOT/scripts/gpu_report.py" --probe > "$GC_STATE/raw/machine.json"
  cat "$GC_STATE/raw/machine.json"
  if [ "$GC_DRY" != 1 ] && ! "$PYBASE" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "torch at $PYBASE sees no CUDA GPU"
    return 1
  fi
  # a compiler and Python's headers cannot come from the wheelhouse: say so at once if missing
  command -v "${CXX:-c++}" >/dev/null || { echo "no C++ compiler (${CXX:-c++}, g++) on this machine"; return 1; }
  "$PYBASE" -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
    || { echo "Python.h missing for $PYBASE (its -dev package): the extension cannot be built"; return 1; }
  if ls "$WHEELHOUSE"/*.whl >/dev/null 2>&1; then
    echo "wheelhouse: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1); $(head -1 "$WHEELHOUSE/MANIFEST.txt" 2>/dev/null)"
  else
    # enough if the machine has every requirement already; otherwise pip says which is missing
    echo "WARNING: no wheels in $WHEELHOUSE (scripts/gpu_wheelhouse.sh makes them; the device tool needs carry: [\"wheelhouse\"])"
  fi

  if [ "$GC_DRY" = 1 ]; then
    # Would the wheelhouse do for the machine it was made for (not necessarily this one)?
    local pyv cuda
    pyv=$(sed -n 's/.*CPython \([0-9.]*\),.*/\1/p' "$WHEELHOUSE/MANIFEST.txt" 2>/dev/null | head -1)
    cuda=$(sed -n 's/.*CUDA \([0-9.]*\).*/\1/p' "$WHEELHOUSE/MANIFEST.txt" 2>/dev/null | head -1)
    echo "dry run: resolving every requirement offline for CPython ${pyv:-3.12}, CUDA ${cuda:-13.0} headers"
    # shellcheck disable=SC2046
    opip "$PYBASE" -m pip install --dry-run --ignore-installed --no-index --find-links "$WHEELHOUSE" \
      --only-binary=:all: --python-version "${pyv:-3.12}" --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --target "$GC_STATE/dry-target" $(tool_reqs) "nvidia-cuda-crt==${cuda:-13.0}.*" "nvidia-cuda-cccl==${cuda:-13.0}.*"
  fi

  if [ "$GC_VENV" = none ]; then
    VPY=$PYBASE
  else
    VPY=$GC_VENV/bin/python
    if [ ! -x "$VPY" ]; then
      echo "venv: $GC_VENV (--system-site-packages, from $PYBASE)"
      if ! "$PYBASE" -m venv --system-site-packages "$GC_VENV"; then
        # a python whose venv module lacks ensurepip: pip from the wheelhouse instead
        rm -rf "$GC_VENV"
        "$PYBASE" -m venv --system-site-packages --without-pip "$GC_VENV"
        opip "$VPY" "$(ls "$WHEELHOUSE"/pip-*.whl | head -1)/pip" install -q --no-index --find-links "$WHEELHOUSE" pip
      fi
      # If PYBASE is itself a venv, --system-site-packages shows its base interpreter's
      # packages, not its own (torch): a .pth adds its site dirs, .pth files included.
      "$PYBASE" - "$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_gpu_check_base.pth" <<'PY'
import site, sys
if sys.prefix != sys.base_prefix:
    dirs = [d for d in site.getsitepackages() if d.startswith(sys.prefix)]
    with open(sys.argv[1], "w") as f:
        f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
PY
    fi
  fi
  printf 'PYBASE=%q\nVPY=%q\n' "$PYBASE" "$VPY" > "$GC_STATE/python.env"
  "$VPY" -c "import torch; print('venv python', __import__('sys').version.split()[0], 'sees torch', torch.__version__, 'at', torch.__file__)"

  # Only what is missing: pip leaves every requirement that is already satisfied alone.
  # shellcheck disable=SC2046
  opip "$VPY" -m pip install -q --no-index --find-links "$WHEELHOUSE" $(tool_reqs) $(cuda_reqs "$VPY")
  "$VPY" "$ROOT/scripts/gpu_report.py" --packages > "$GC_STATE/raw/packages.json"
  cat "$GC_STATE/raw/packages.json"
}

# GPU time is scarce and a build costs minutes of it: scripts/gpu_prebuild.sh builds the extension
# elsewhere against the same torch and Python into prebuilt/. It is used when its torch is this
# machine's and it imports; anything else (another torch, a glibc too old for it) builds here.
use_prebuilt() {
  local pre=${GPU_CHECK_PREBUILT:-$ROOT/prebuilt}
  local so
  so=$(ls "$pre"/c10d_ext/_C.*.so 2>/dev/null | head -1) || true
  [ -n "$so" ] && [ -f "$pre/c10d_ext/_build_info.py" ] || return 1
  echo "prebuilt extension: $so"
  cp "$so" "$pre/c10d_ext/_build_info.py" "$ROOT/c10d_ext/"
  # the tree itself on the venv's path, as an editable install would put it
  local site
  site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$ROOT" > "$site/c10d_ext_prebuilt.pth"
  if (cd / && "$VPY" -c "import torch, c10d_ext, sys
b = c10d_ext.build_info()
print('prebuilt for torch', b['torch_version'], 'python', b['python'], 'nccl', b['nccl_build_header'])
sys.exit(not (b['with_nccl'] and b['torch_version'] == torch.__version__))"); then
    (cd / && "$VPY" -c "import c10d_ext, json; print(json.dumps(c10d_ext.build_info()))") > "$GC_STATE/raw/build_info.json"
    echo "using the prebuilt extension (no compile here)"
    return 0
  fi
  echo "the prebuilt extension does not fit this machine: building here"
  rm -f "$ROOT/c10d_ext/$(basename "$so")" "$ROOT/c10d_ext/_build_info.py" "$site/c10d_ext_prebuilt.pth"
  return 1
}

step_build() {
  load_python
  export MYCCL_WITH_NCCL=1
  if [ "$GC_DRY" = 1 ] && [ "${GPU_CHECK_DRY_RUN_BUILD:-0}" != 1 ]; then
    echo "dry run: how setup.py would build (GPU_CHECK_DRY_RUN_BUILD=1 builds for real)"
    "$VPY" "$ROOT/scripts/gpu_report.py" --setup-config "$ROOT"
    return
  fi
  rm -f "$GC_STATE/raw/build_info.json"
  if use_prebuilt; then return 0; fi
  # ninja compiles MAX_JOBS files at once; without it torch falls back to one at a time. The
  # wheel's binary may sit in a bin/ that is not on PATH (a base venv's).
  local nbin
  nbin=$("$VPY" -c "import importlib.metadata as m, os; d = m.distribution('ninja')
print(next(os.path.dirname(os.path.abspath(d.locate_file(f))) for f in d.files if f.name == 'ninja' and f.parent.name == 'bin'))" 2>/dev/null) \
    && PATH="$nbin:$PATH"
  echo "ninja: $(command -v ninja || echo 'NOT FOUND: the build will be slow') $(ninja --version 2>/dev/null || true)"
  echo "building with MAX_JOBS=$MAX_JOBS: MYCCL_WITH_NCCL=1 pip install --no-build-isolation --no-deps -e ."
  opip "$VPY" -m pip install --no-index --no-build-isolation --no-deps -e "$ROOT"
  (cd "$ROOT" && "$VPY" -c "import c10d_ext, json; print(json.dumps(c10d_ext.build_info()))") > "$GC_STATE/raw/build_info.json"
  cat "$GC_STATE/raw/build_info.json"
  "$VPY" -c "import json, sys; sys.exit(not json.load(open(sys.argv[1]))['with_nccl'])" "$GC_STATE/raw/build_info.json" \
    || { echo "built without the NCCL engine"; return 1; }
}

step_test() {
  load_python
  cd "$ROOT"
  if [ "$GC_DRY" = 1 ]; then
    echo "dry run: collecting (would run: pytest -m cuda tests -n $GC_TEST_JOBS)"
    "$VPY" -m pytest -q --collect-only -m cuda tests | tail -30
    return
  fi
  # every test marked cuda: tests/cuda/test_cuda.py's, and the few in other files
  local rc=0
  rm -f "$GC_STATE/raw/test.xml"
  "$VPY" -m pytest -m cuda tests -n "$GC_TEST_JOBS" --junitxml="$GC_STATE/raw/test.xml" || rc=$?
  # everything skipped (torch saw no GPU after all) must not pass
  "$VPY" "$ROOT/scripts/gpu_report.py" --junit "$GC_STATE/raw/test.xml" || rc=$((rc ? rc : 1))
  return "$rc"
}

step_test_multi() {
  load_python
  cd "$ROOT"
  local n
  n=$(ngpus)
  if [ "$GC_DRY" = 1 ]; then
    echo "dry run: $n GPU(s); with N >= 2 would run: MYCCL_TEST_CUDA_WORLD=N pytest -m cuda tests/cuda/test_cuda.py -k world_n"
    MYCCL_TEST_CUDA_WORLD=2 "$VPY" -m pytest -q --collect-only -m cuda tests/cuda/test_cuda.py -k world_n | tail -10
    return
  fi
  if [ "$n" -lt 2 ]; then
    echo "skipped: $n GPU (world size N on N GPUs needs several)"
    return 3
  fi
  local rc=0
  rm -f "$GC_STATE/raw/test-multi.xml"
  MYCCL_TEST_CUDA_WORLD=$n "$VPY" -m pytest -m cuda tests/cuda/test_cuda.py -k world_n -n "$GC_TEST_JOBS" \
    --junitxml="$GC_STATE/raw/test-multi.xml" || rc=$?
  "$VPY" "$ROOT/scripts/gpu_report.py" --junit "$GC_STATE/raw/test-multi.xml" || rc=$((rc ? rc : 1))
  return "$rc"
}

bench_world() { local n; n=$(ngpus); [ "$n" -ge 2 ] && echo "$n" || echo 2; }

# Host cost per op against nccl (benchmarks/cuda_host_cost.py --device cuda), then a DDP step on
# a model of many small parameters in small buckets, where per-op host cost shows.
step_hostcost() {
  load_python
  cd "$ROOT"
  local cmd=("$VPY" benchmarks/cuda_host_cost.py --device cuda --world-size "$(bench_world)" --rounds 5 --reps 64
             --out "$GC_STATE/raw/cuda_host_cost.json")
  local ddp=("$VPY" benchmarks/ddp_cuda.py --world-size "$(bench_world)" --layers 128 --width 64 --batch 32
             --bucket-cap-mb 0.1 --steps 30 --out "$GC_STATE/raw/ddp_small.json")
  if [ "$GC_DRY" = 1 ]; then
    echo "dry run: would run: ${cmd[*]}"
    echo "dry run: would run: ${ddp[*]}"
    if "${cmd[@]}"; then return 1; fi
    if "${ddp[@]}"; then return 1; fi
    echo "(refused without a GPU, as they must)"
    return 0
  fi
  rm -f "$GC_STATE/raw/cuda_host_cost.json" "$GC_STATE/raw/ddp_small.json"
  local rc=0
  "${cmd[@]}" || rc=1
  "${ddp[@]}" || rc=1
  return $rc
}

# Runs a benchmark that writes $GC_STATE/raw/$1 (the rest: its command); in a dry run, checks
# that it refuses to run without a GPU, as it must.
gpu_bench() {
  local json=$1
  shift
  load_python
  cd "$ROOT"
  if [ "$GC_DRY" = 1 ]; then
    echo "dry run: would run: $*"
    if "$@"; then return 1; fi
    echo "(refused without a GPU, as it must)"
    return 0
  fi
  rm -f "$GC_STATE/raw/$json"
  "$@"
}

step_bench() {
  load_python
  gpu_bench collbench_cuda.json "$VPY" benchmarks/collbench.py --device cuda --world-size "$(bench_world)" \
    --ops "all_reduce,all_gather,reduce_scatter,broadcast,all_to_all,send_recv" \
    --sizes "${GPU_CHECK_BENCH_SIZES:-8,1M,4M,16M,64M,256M,1G}" --trials 3 --budget 0.2 --check \
    --out "$GC_STATE/raw/collbench_cuda.json"
}

step_ddp() {
  load_python
  gpu_bench ddp_cuda.json "$VPY" benchmarks/ddp_cuda.py --world-size "$(bench_world)" --out "$GC_STATE/raw/ddp_cuda.json"
}

step_hvd() {
  load_python
  gpu_bench hvd_synthetic.json "$VPY" benchmarks/hvd_synthetic.py --device cuda --world-size "$(bench_world)" \
    --out "$GC_STATE/raw/hvd_synthetic.json"
}

if [ "${1:-}" = --step ]; then
  fn="step_${2//-/_}"
  "$fn"
  exit $?
fi

# ---- the driver --------------------------------------------------------------------------

# Results of a dry run and of a real one never share a report.
if [ "${GPU_CHECK_FRESH:-0}" = 1 ] || [ "$(cat "$GC_STATE/mode" 2>/dev/null)" != "dry=$GC_DRY" ]; then
  rm -rf "$GC_STATE/steps" "$GC_STATE/logs" "$GC_STATE/raw"
fi
mkdir -p "$GC_STATE/steps" "$GC_STATE/logs" "$GC_STATE/raw" "$GC_OUT"
echo "dry=$GC_DRY" > "$GC_STATE/mode"
CALL_ID=$(date -u +%Y%m%dT%H%M%SZ)

IFS=, read -r -a STEPS <<< "${GPU_CHECK_STEPS:-$(IFS=,; echo "${ALL_STEPS[*]}")}"
for s in "${STEPS[@]}"; do
  [[ " ${ALL_STEPS[*]} " == *" $s "* ]] || { log "unknown step '$s' (known: ${ALL_STEPS[*]})"; exit 2; }
done
want() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

# Steps that need the build get it first when an earlier call did not leave one here.
load_python
if ! want build && { want test || want test-multi || want bench || want ddp || want hvd; }; then
  if [ "$GC_DRY" != 1 ] && ! (cd "$ROOT" && [ -n "$VPY" ] && "$VPY" -c "import c10d_ext, pytest, xdist, pytest_timeout, sys
sys.exit(not c10d_ext.build_info().get('with_nccl'))" >/dev/null 2>&1); then
    log "no working build here yet: running env and build first"
    STEPS=(env build "${STEPS[@]}")
  fi
fi
if ! want env && want build && { [ -z "$VPY" ] || [ ! -x "$VPY" ]; }; then
  STEPS=(env "${STEPS[@]}")
fi
# in the order of ALL_STEPS
ORDERED=()
expect=0 most=0
for s in "${ALL_STEPS[@]}"; do
  if want "$s"; then ORDERED+=("$s"); expect=$((expect + EXPECT[$s])); most=$((most + LIMIT[$s])); fi
done
(( most > BUDGET )) && most=$BUDGET

cat <<EOF
gpu-check: c10d_ext (myccl) on this machine's CUDA GPU(s), each figure next to torch's nccl.
  Steps: ${ORDERED[*]}; about $(( (expect + 59) / 60 )) minutes on one H100 with 16 cores (test-multi only
  with several GPUs), never more than $(( (most + REPORT_RESERVE + 59) / 60 )) (step limits, GPU_CHECK_BUDGET_S=$BUDGET).
  A failed step does not stop the others.$([ "$GC_DRY" = 1 ] && echo "
  DRY RUN: no GPU needed; checks what can be checked without one.")
  env         ~0.5 min  python with torch, venv $(basename "$GC_VENV") (--system-site-packages), wheels from $(basename "$WHEELHOUSE")/
  build       ~1-4 min  MYCCL_WITH_NCCL=1 pip install --no-build-isolation -e . (MAX_JOBS=$MAX_JOBS)
  hostcost    ~2 min    host time per op vs nccl (every op, 8 B and 1 MiB, sync and async); DDP, many small params
  test        ~5 min    pytest -m cuda tests: tests/cuda/test_cuda.py at world sizes 1 and 2 on one GPU vs nccl; whole memory, the GNN example, Horovod, DDP
  test-multi  ~3 min    world size N on N GPUs (only with several GPUs)
  bench       ~4 min    collbench --device cuda vs nccl: 8 B overhead, busbw 1 MiB-1 GiB, 6 ops
  ddp         ~1 min    DDP over myccl and c10d_ext's DDP vs DDP over nccl: losses, parameters, step time
  hvd         ~1.5 min  Horovod's synthetic benchmark on c10d_ext.horovod vs torch DDP over nccl; NCCL/compute overlap
  report      $GC_OUT/report.md (+ gpu_check.json, logs/)
EOF

# Writes (and re-writes after every step, so that a run cut short still leaves one) the report.
report() {
  local py=${VPY:-}
  [ -n "$py" ] && [ -x "$py" ] || py=${PYBASE:-python3}
  "$py" "$ROOT/scripts/gpu_report.py" --report "$GC_STATE" "$GC_OUT" --dry "$GC_DRY" >/dev/null 2>"$GC_STATE/report.err" \
    || python3 "$ROOT/scripts/gpu_report.py" --report "$GC_STATE" "$GC_OUT" --dry "$GC_DRY" >/dev/null \
    || { log "could not write the report:"; cat "$GC_STATE/report.err"; }
}

FAILED=0
for s in "${ORDERED[@]}"; do
  left=$((BUDGET - ($(date +%s) - T0) - REPORT_RESERVE))
  limit=${LIMIT[$s]}
  (( limit > left )) && limit=$left
  started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  if (( limit < 30 )); then
    log "[$s] not run: the call's time budget is spent"
    printf 'not run\t\t0\t0\t%s\t%s\ttime budget (GPU_CHECK_BUDGET_S=%s) spent\n' "$started" "$CALL_ID" "$BUDGET" > "$GC_STATE/steps/$s.tsv"
    FAILED=1
    continue
  fi
  log "[$s] starting (limit ${limit} s)"
  t=$(date +%s)
  set +e
  timeout --kill-after=15 "$limit" bash "$0" --step "$s" > "$GC_STATE/logs/$s.log" 2>&1
  rc=$?
  set -e
  secs=$(($(date +%s) - t))
  case $rc in
    0) status=pass; note="" ;;
    3) status=skipped; note=$(tail -1 "$GC_STATE/logs/$s.log") ;;
    124|137) status=timeout; note="killed after its ${limit} s limit"; FAILED=1 ;;
    *) status=fail; note="exit status $rc"; FAILED=1 ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$status" "$rc" "$secs" "$limit" "$started" "$CALL_ID" "$note" > "$GC_STATE/steps/$s.tsv"
  log "[$s] $status in ${secs} s${note:+ ($note)}; log: logs/$s.log"
  if [ "$status" != pass ] && [ "$status" != skipped ]; then
    tail -n 25 "$GC_STATE/logs/$s.log" | sed 's/^/    | /'
  fi
  load_python
  report
done

report
# the tables, for whoever reads the terminal
for f in "$GC_STATE/logs/bench.log" "$GC_STATE/logs/ddp.log" "$GC_STATE/logs/hvd.log"; do
  if want "$(basename "$f" .log)" && [ -f "$f" ]; then
    sed -n '/^collbench: world size\|^DDP on CUDA\|^Horovod.s synthetic/,/^json:/p' "$f" | grep -v '^json:' || true
  fi
done
log "report: $GC_OUT/report.md (JSON: $GC_OUT/gpu_check.json, logs: $GC_OUT/logs/)"
if [ "$FAILED" != 0 ]; then
  log "some steps failed (see the report)"
  exit 1
fi
log "all steps passed"
