#!/usr/bin/env bash
# benchmarks/segment_speed.py with two versions of the code in turn, each run in a process of its own:
# BASE's, then this tree's, N times. The lent GPU machines drift more between two runs of the same code than
# most changes move them (BENCHMARKS.md, 2026-11-27 and 28), so only runs made in turn compare.
#   BASE: a folder holding the other version's cloudseg/, benchmarks/ and configs/, made before the call
#   (the device's copy of the tree has no git history; bench/ is git-ignored, so carry it):
#     mkdir -p bench/base && git archive COMMIT cloudseg benchmarks configs | tar -x -C bench/base
#   The rest: segment_speed.py's options, the same for both. Logs go to OUT (default bench/in-turn); the
#   table last: each run's rows with megapixels/s, cores busy and the stage that bounds it, and a line for
#   each run that failed (then the exit status is 1).
#   usage: [OUT=dir] [PY=python] bash benchmarks/in_turn.sh BASE N --device cuda --rows f --scenes 4 ...
set -u
[ $# -ge 2 ] && [ -d "$1/cloudseg" ] || { echo "usage: [OUT=dir] bash benchmarks/in_turn.sh BASE N [segment_speed.py options]" \
  "(BASE: a folder with cloudseg/ of the other version)" >&2; exit 2; }
BASE=$(cd "$1" && pwd) RUNS=$2 THIS=$(cd "$(dirname "$0")/.." && pwd); shift 2
mkdir -p "${OUT:=$THIS/bench/in-turn}" && OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/*-base.log "$OUT"/*-this.log "$OUT/exits.txt"  # an earlier call's runs are not this one's
PY=${PY:-python3} SITE=${PYTHONPATH:+:$PYTHONPATH}  # the caller's path (gpu_window.sh's wheels) after each version's
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the same one from BASE
if ! PYTHONPATH=$THIS$SITE $PY -c "import segmentation_models_pytorch, rasterio, tifffile, zstandard" 2>/dev/null; then
  # a lent machine with torch but not the other packages: the wheels of ../shared/tools/device-wheels.sh
  compgen -G "$THIS/.whl/*.whl" >/dev/null || { echo "in_turn.sh: cloudseg's packages are missing, and $THIS/.whl" \
    "holds no wheels (../shared/tools/device-wheels.sh fetches them)" >&2; exit 1; }
  $PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site "$THIS"/.whl/*.whl || exit 1
  SITE=$SITE:/tmp/site
fi
for run in $(seq "$RUNS"); do
  for version in base this; do
    root=$([ $version = base ] && echo "$BASE" || echo "$THIS")
    # each version's benchmark with its own cloudseg first on the path
    (cd "$root" && PYTHONPATH=$root$SITE PYTHONUNBUFFERED=1 $PY benchmarks/segment_speed.py "$@") \
      >"$OUT/$run-$version.log" 2>&1
    echo "$run $version $?" >>"$OUT/exits.txt"
  done
done
$PY - "$OUT" <<'TABLE'
import pathlib, re, sys
out = pathlib.Path(sys.argv[1])
print("| run | code | row | megapixels/s | cores busy | bound by |\n| --- | --- | --- | ---: | ---: | --- |")
failed = 0
for run, version, status in (line.split() for line in (out / "exits.txt").read_text().splitlines()):
    rows = re.findall(r"^  measured (\S.*?): .*?([\d.]+) megapixels/s(.*)$", (out / f"{run}-{version}.log").read_text(), re.M)
    for name, rate, rest in rows:
        bound = re.search(r"bound by: ([^;]+)", rest)
        cores = re.search(r"([\d.]+) cores busy", rest)
        print(f"| {run} | {version} | {name} | {rate} | {cores[1] if cores else '-'} | {bound[1] if bound else '-'} |")
    if status != "0" or not rows:
        failed = 1
        print(f"| {run} | {version} | failed (exit {status}; {out / f'{run}-{version}.log'}) | | | |")
sys.exit(failed)
TABLE
