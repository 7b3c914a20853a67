#!/bin/bash
# c16 batching on/off, the contiguous pool (5809d70) and the paged pool (this branch), interleaved.
# Usage: run.sh CONTIGUOUS_CHECKOUT PAGED_CHECKOUT [OUT]; PY names the Python with the project's dependencies.
CONTIGUOUS_CHECKOUT=${1:?a checkout of 5809d70}
PAGED_CHECKOUT=${2:?a checkout of the paged pool}
OUT=${3:-/tmp/kv_pool_runs}
PY=${PY:-python}
mkdir -p "$OUT"
ARGS="--start-stack --concurrency 16 --modes spec --prompt-sets code --max-new-tokens 128 --duration-s 60 --repeats 1 --baseline-batching-off"
for i in 1 2; do
  (cd "$CONTIGUOUS_CHECKOUT" && $PY -m load_tests $ARGS --out "$OUT"/contiguous_$i > "$OUT"/contiguous_$i.log 2>&1)
  (cd "$PAGED_CHECKOUT" && $PY -m load_tests $ARGS --out "$OUT"/paged_$i > "$OUT"/paged_$i.log 2>&1)
done
