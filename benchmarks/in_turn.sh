#!/usr/bin/env bash
# benchmarks/segment_speed.py with two versions of the code in turn, each run in a process of its own:
# BASE's, then this tree's, N times. The lent GPU machines drift more between two runs of the same code than
# most changes move them (BENCHMARKS.md, 2026-11-27 and 28), so only runs made in turn compare.
#   BASE: a folder holding the other version's cloudseg/, benchmarks/ and configs/, made before the call
#   (the device's copy of the tree has no git history; bench/ is git-ignored, so carry it):
#     mkdir -p bench/base && git archive COMMIT cloudseg benchmarks configs | tar -x -C bench/base
#   The rest: segment_speed.py's options, the same for both. Logs go to OUT (default bench/in-turn); the
#   table last: each run's rows with megapixels/s, cores busy and the stage that bounds it.
#   usage: [OUT=dir] bash benchmarks/in_turn.sh BASE N --device cuda --rows f --scenes 4 ...
set -u
[ $# -ge 2 ] && [ -d "$1/cloudseg" ] || { echo "usage: [OUT=dir] bash benchmarks/in_turn.sh BASE N [segment_speed.py options]" \
  "(BASE: a folder with cloudseg/ of the other version)" >&2; exit 2; }
BASE=$(cd "$1" && pwd) RUNS=$2; shift 2
mkdir -p "${OUT:=bench/in-turn}" && OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/*-base.log "$OUT"/*-this.log "$OUT/exits.txt"  # an earlier call's runs are not this one's
PY=${PY:-python3} SITE=
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the same one from BASE
if ! $PY -c "import segmentation_models_pytorch, rasterio, tifffile, zstandard" 2>/dev/null; then
  # a lent machine with torch but not the other packages: the wheels of ../shared/tools/device-wheels.sh
  $PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  SITE=:/tmp/site
fi
for run in $(seq "$RUNS"); do
  for version in base this; do
    root=$([ $version = base ] && echo "$BASE" || pwd)
    # the script's own folder first on sys.path: each version's benchmark imports its own cloudseg
    (cd "$root" && PYTHONPATH=$root$SITE PYTHONUNBUFFERED=1 $PY benchmarks/segment_speed.py "$@") \
      >"$OUT/$run-$version.log" 2>&1
    echo "run $run, $version: exit $?" >>"$OUT/exits.txt"
  done
done
echo "| run | code | row | megapixels/s | cores busy | bound by |"
echo "| --- | --- | --- | ---: | ---: | --- |"
for log in $(ls "$OUT"/*-base.log "$OUT"/*-this.log | sort -V); do
  name=$(basename "$log" .log)
  sed -n 's/^  measured \([a-i]\)\. [^:]*: .*, \([0-9.]*\) megapixels\/s.*bound by: \([^;]*\);.* \([0-9.]*\) cores busy.*/\1 \2 \4 \3/p' "$log" |
    while read -r row rate cores bound; do echo "| ${name%-*} | ${name#*-} | $row | $rate | $cores | $bound |"; done
done
cat "$OUT/exits.txt"
