#!/usr/bin/env bash
# One short GPU window, as one command: `make bench` first (by default its training part: issue #59
# puts training before anything else), then `make test-gpu` cut at TEST_S seconds (0: none), then
# benchmarks/import_time.py and benchmarks/cudnn_search.py. Logs, the report, the GPU's name and the
# profiles of slow tests go to OUT.
# For a lent machine that has torch but not cloudseg's other packages: wheels in .whl/ (from
# ../shared/tools/device-wheels.sh) are installed first, and make's install step is skipped (STAMP=).
# `make bench` gets LIMIT_S less TEST_S less what setting up took, less 20 s for the end.
# TESTS, a pytest -k expression, picks the GPU tests (those a window never reached, BENCHMARKS.md);
# PARTS, `make bench`'s parts in the order run ("none": no make bench); STUDIES, which of the import and cuDNN studies to run
# (imports, cudnn; "none": neither); FIRST, a command run before everything else (the open issue's
# measurement, its output in OUT/first.log), within LIMIT_S.
#   usage: OUT=dir [FIRST="command"] bash benchmarks/gpu_window.sh [LIMIT_S=570] [TEST_S=0] [TESTS] [PARTS] [STUDIES]
set -u
LIMIT_S=${1:-570}
TEST_S=${2:-0}
TESTS=${3:-}
PARTS=${4:-training}
STUDIES=${5:-none}
mkdir -p "${OUT:=bench/window}" bench && OUT=$(cd "$OUT" && pwd)
start=$SECONDS
if compgen -G ".whl/*.whl" >/dev/null; then
  # compiled at install (pip's default), as a user's are: each new process of the fixed-cost and import rows
  # would otherwise compile them again where Python may not write its bytecode cache
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTEST_ADDOPTS="--ignore tests/test_notebooks.py"  # nbformat may be absent
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$OUT/gpu.txt" 2>&1
# A user's install compiles bytecode (pip's default, make install's --compile-bytecode); a preinstalled torch
# without it would add compiling its sources to every new process's imports, where Python may not write
# them (PYTHONDONTWRITEBYTECODE): counted, timed, then every installed package that `import cloudseg.segment`
# loads compiled where writable, and timed again, so the import and fixed-cost rows are a user's. The first
# import, untimed, reads the libraries from disk: both timed ones find them in the page cache.
imports() { local TIMEFORMAT="import cloudseg.segment $1: %R s"; { time python3 -c "import cloudseg.segment"; } 2>&1; }
bytecode() { python3 -c "from benchmarks.import_time import bytecode_state; print(bytecode_state())"; }
bytecode >>"$OUT/gpu.txt" 2>&1
python3 -c "import cloudseg.segment" >/dev/null 2>&1
imports "before compileall" >>"$OUT/gpu.txt"
places=$(python3 - <<'PY'
import os, pathlib, sys, sysconfig, cloudseg.segment
stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
for name in sorted({name.partition(".")[0] for name in sys.modules} - {"cloudseg"}):
    file = getattr(sys.modules.get(name), "__file__", None)
    if file and file.endswith(".py"):
        path = pathlib.Path(file)
        path = path.parent if path.name == "__init__.py" else path  # a package's folder, or the module
        installed = not path.is_relative_to(stdlib) or {"site-packages", "dist-packages"} & set(path.parts)
        if installed and os.access(path if path.is_dir() else path.parent, os.W_OK):  # where __pycache__ goes
            print(path)
PY
)
[ -n "$places" ] && timeout 120 python3 -m compileall -q -j 0 $places >/dev/null 2>&1
imports "after compileall" >>"$OUT/gpu.txt"
bytecode >>"$OUT/gpu.txt" 2>&1
python3 -c "import torch, segmentation_models_pytorch as smp; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'smp', smp.__version__)" >>"$OUT/gpu.txt" 2>&1

if [ -n "${FIRST:-}" ]; then
  timeout -k 5 $((LIMIT_S - 60)) bash -c "$FIRST" >"$OUT/first.log" 2>&1
  echo "first: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/first.log"
fi

budget=$((LIMIT_S - TEST_S - (SECONDS - start) - 20))
if [ "$PARTS" != "none" ]; then
  make bench PY=python3 STAMP= BENCH_ARGS="--budget-s $budget --parts $PARTS" >"$OUT/bench.log" 2>&1
  echo "make bench: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/bench.log"
fi

# Tests slower than 20 s leave their profile in OUT/profiles (tests/report_now.py --profile-slow),
# the one the time limit cuts too; profiled, the tests' times are somewhat longer than without.
if [ "$TEST_S" -gt 0 ]; then
  PYTEST_ADDOPTS="$PYTEST_ADDOPTS --profile-slow $OUT/profiles${TESTS:+ -k '$TESTS'}" \
    timeout -k 5 "$TEST_S" make test-gpu PY=python3 STAMP= >"$OUT/test-gpu.log" 2>&1
  echo "make test-gpu: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/test-gpu.log"
fi

# Where a command's import time goes on this machine (the fixed cost of a one-scene segment call).
if [[ " $STUDIES " == *" imports "* ]]; then
  timeout -k 5 120 python3 benchmarks/import_time.py --repeat 1 >"$OUT/imports.log" 2>&1
  echo "import_time: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/imports.log"
fi
# Whether cuDNN's search pays for prediction on this GPU (prediction leaves it off: an H200 said no).
if [[ " $STUDIES " == *" cudnn "* ]]; then
  timeout -k 5 120 python3 benchmarks/cudnn_search.py --repeat 1 >"$OUT/cudnn.log" 2>&1
  echo "cudnn_search: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/cudnn.log"
fi

cp bench/report.md "$OUT/" 2>/dev/null
(cd bench/work 2>/dev/null && tar czf "$OUT/part-logs.tgz" ./*.log ./*.json 2>/dev/null)
tail -n 25 "$OUT/test-gpu.log" 2>/dev/null
grep -E "^\*\*cloudseg compiled against|^  measured |^  warmed|^warmed in" bench/report.md "$OUT/bench.log" 2>/dev/null | head -60
tail -n 45 "$OUT/first.log" 2>/dev/null
