#!/usr/bin/env bash
# Runs a list of benchmark steps on a device machine inside one time budget, so that one call of a
# lent GPU measures several changes. Each line of LIST is `NAME LIMIT_SECONDS COMMAND...` (blank lines
# and lines starting with # are skipped); a step gets at most its limit and what is left of BUDGET.
# Writes $OUT/log.txt (every step's tail, its exit status and seconds) and $OUT/results.tgz (each
# step's full output and every file under benchmarks/results/ the steps wrote). A carried .whl/
# (benchmarks/gpu_wheels.sh) is installed into /tmp/site first.
#
#   OUT=/some/dir bash benchmarks/run_list.sh benchmarks/pending_gpu.txt 570
#   OUT=/tmp/o BENCH_DEVICE=cpu bash benchmarks/run_list.sh LIST 600   # a CPU check: --device cuda -> cpu

set -u
cd "$(dirname "$0")/.."
LIST=${1:?usage: run_list.sh LIST [BUDGET_SECONDS]}
BUDGET=${2:-570}
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT" "$OUT/steps"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | tail -2
    export PYTHONPATH="/tmp/site:$PWD"
fi
marker=$(mktemp)
{
    echo "=== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null) ==="
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} | tee -a "$LOG"
while read -r name limit cmd; do
    case "$name" in ""|\#*) continue ;; esac
    left=$((BUDGET - SECONDS - 15))  # 15 s for the archive at the end
    if [ "$left" -lt 20 ]; then
        echo "=== $name: skipped (no time left) ===" | tee -a "$LOG"
        continue
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    [ "${BENCH_DEVICE:-cuda}" = cpu ] && cmd=${cmd//--device cuda/--device cpu}
    echo "=== $name (limit ${limit}s): $cmd ===" | tee -a "$LOG"
    start=$SECONDS
    timeout -k 5 "$limit" bash -c "$cmd" >"$OUT/steps/$name.out" 2>&1
    status=$?
    tail -n 40 "$OUT/steps/$name.out" | tee -a "$LOG"
    echo "=== $name: exit $status after $((SECONDS - start))s ===" | tee -a "$LOG"
done <"$LIST"
find benchmarks/results -type f -newer "$marker" >"$marker.list"
tar czf "$OUT/results.tgz" -T "$marker.list" -C "$OUT" steps
rm -rf "$OUT/steps" "$marker" "$marker.list"
