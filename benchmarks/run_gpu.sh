#!/usr/bin/env bash
# Runs the GPU benchmarks of issues 2-5 in one go (an acceptance check, masks and grammar,
# speculative decoding, engine vs transformers, gRPC service), each bounded by `timeout` so the
# whole script stays under 10 minutes on one H200. Writes $OUT/check_acceptance.json,
# $OUT/bench_{engine,spec,masks,service}.json and one combined log
# $OUT/bench_gpu.log (also echoed to stdout). A carried .whl/ directory (xgrammar and its
# dependencies) is installed into /tmp/site first.
#
#   OUT=/some/dir bash benchmarks/run_gpu.sh
#   BENCH_DEVICE=cpu BENCH_QUICK=1 OUT=/tmp/b bash benchmarks/run_gpu.sh   # checks the script on CPU

set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
DEVICE=${BENCH_DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/bench_gpu.log"
: >"$LOG"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3 | tee -a "$LOG"
    export PYTHONPATH="/tmp/site:$PWD"
fi

quick=()
service_size=()
accept_size=()
scale=1
if [ -n "${BENCH_QUICK:-}" ]; then
    quick=(--quick)
    service_size=(--requests 4 --max-tokens 8 --repeats 1)
    accept_size=(--requests 4 --tokens 16)
    scale=4  # a 2-core CPU is slower than the H200 the limits are set for
fi

# step NAME SECONDS SCRIPT ARGS...: one benchmark under a time limit; its output goes to the log.
step() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    limit=$((limit * scale))
    echo "=== $name: start (limit ${limit}s) ==="
    timeout -k 10 "$limit" $PY "$@"
    echo "=== $name: exit $? after $((SECONDS - start))s ==="
}

{
    echo "=== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null) device=$DEVICE ==="
    [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    # Most needed first (see BENCHMARKS.md: masks and the 8B verify cost at batch 64 were cut).
    # The acceptance check first: an acceptance that depends on the execution path is a bug to chase
    # before any speculative number means anything (BENCHMARKS.md, issue 4, fourth session).
    step acceptance 90 benchmarks/check_acceptance.py --device "$DEVICE" "${accept_size[@]}" \
        --out "$OUT/check_acceptance.json"
    step masks 150 benchmarks/bench_masks.py --device "$DEVICE" "${quick[@]}" --out "$OUT/bench_masks.json"
    step spec 200 benchmarks/bench_spec.py --device "$DEVICE" "${quick[@]}" --out "$OUT/bench_spec.json"
    step engine 120 benchmarks/bench_engine.py --device "$DEVICE" "${quick[@]}" --out "$OUT/bench_engine.json"
    step service 150 benchmarks/bench_service.py --device "$DEVICE" --spec dflash --repeats 7 \
        "${service_size[@]}" --out "$OUT/bench_service.json"
    echo "=== done after ${SECONDS}s ==="
} 2>&1 | tee -a "$LOG"
