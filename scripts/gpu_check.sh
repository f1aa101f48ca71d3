#!/usr/bin/env bash
# One call on a GPU machine: environment facts, the test-suite (GPU tests included), the
# contract table, and the benchmarks. Logs go to $OUT (or ./out). Run from the repo root
# with the machine's own torch: PYTHONPATH=. bash scripts/gpu_check.sh [pytest args...]
# Env: BENCH_OPS="case1 case2" limits the benchmarks; SKIP_TESTS=1 / SKIP_BENCH=1 / SKIP_CHECK=1.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
status=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
    python3 -m pytest -q --maxfail=20 --durations=15 -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.txt" | tail -40
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -z "${SKIP_CHECK:-}" ]; then
    python3 -m graphsafe check --device cuda 2>&1 | tee "$OUT/check.txt" | tail -30
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -z "${SKIP_BENCH:-}" ]; then
    bench_args=()
    for op in ${BENCH_OPS:-}; do bench_args+=(--op "$op"); done
    python3 -m graphsafe bench "${bench_args[@]}" --json "$OUT/bench.json" 2>&1 > "$OUT/bench.txt"
    [ $? -eq 0 ] || status=1
    sed -n '/^device:/,$p' "$OUT/bench.txt"
fi
exit $status
