#!/usr/bin/env bash
# Where do RoPE models of the `pe` sweep's shape form attention sinks? One `poslens train` per line of a grid file
# (NAME FLAGS...), JOBS at once, each followed by its sink measurement (benchmarks/sweep.py --measure: alpha_0 per
# head over 64 held-out BOS-led sequences of 64 tokens; sink rate = share of heads above 0.3). Results are appended
# line by line to OUT_DIR/sinks.txt, so a run stopped by a time limit keeps every finished model. Run by hand.
# Usage: bash benchmarks/sink_grid.sh GRID_FILE OUT_DIR TOKENS_DIR   (JOBS from the environment, default 4; EXTRA:
# flags added to every line, e.g. EXTRA="--device cpu" with OMP_NUM_THREADS=1 for one core per model)
set -uo pipefail
grid=${1:?usage: sink_grid.sh GRID_FILE OUT_DIR TOKENS_DIR}; out=${2:?}; tokens=${3:?}
PY=${PY:-python3}
mkdir -p "$out"
one() {  # NAME FLAGS...: train, then measure
  local name=$1; shift
  local t0=$SECONDS
  "$PY" -m poslens train --preset tiny --hidden 64 --heads 4 --kv-heads 2 --intermediate 256 --bos --pe rope \
    --eval-batches 16 --save-every 0 --tokens "$tokens" --quiet --out "$out/models/$name" "$@" ${EXTRA:-} >"$out/$name.log" 2>&1 \
    || { echo "$name: training failed (see $name.log)" >>"$out/sinks.txt"; return; }
  local took=$((SECONDS - t0))
  "$PY" benchmarks/sweep.py --measure "$out/models/$name" 2>/dev/null | grep -v "Loading weights" \
    | sed "s|^|$name ($*; ${took} s): |" >>"$out/sinks.txt"
}
export -f one; export PY out tokens EXTRA
grep -v '^\s*\(#\|$\)' "$grid" | xargs -P "${JOBS:-4}" -L 1 bash -c 'one "$@"' _
