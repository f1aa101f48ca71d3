#!/usr/bin/env bash
# One call on a GPU machine: environment facts, the GPU tests, the contract table, and
# the benchmarks. Logs go to $OUT (default ./out). Run from the repository root with the
# machine's own torch (no install needed):
#
#     PYTHONPATH=. bash scripts/gpu_check.sh
#
# Env: BENCH_OPS="case1 case2" limits the benchmarks (default: all), CHECK_OPS likewise for
# `graphsafe check`; SKIP_TESTS=1 / SKIP_CHECK=1 / SKIP_BENCH=1; PYTEST_WORKERS (default 8,
# needs pytest-xdist); GRAPHSAFE_MAX_EXAMPLES (default 3 here: CPU CI draws more).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
export GRAPHSAFE_MAX_EXAMPLES=${GRAPHSAFE_MAX_EXAMPLES:-3}
status=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
    workers=()
    if python3 -c "import xdist" 2>/dev/null; then workers=(-n "${PYTEST_WORKERS:-8}"); fi
    python3 -m pytest -m gpu "${workers[@]}" -p no:cacheprovider -v --tb=short -rfE "$@" > "$OUT/pytest.txt" 2>&1
    [ $? -eq 0 ] || status=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | grep -v "^\[gw" | tail -40
fi
if [ -z "${SKIP_CHECK:-}" ]; then
    check_args=()
    for op in ${CHECK_OPS:-}; do check_args+=(--op "$op"); done
    python3 -m graphsafe check --device cuda "${check_args[@]}" > "$OUT/check.txt" 2>&1
    [ $? -eq 0 ] || status=1
    grep -v -E "Warning|warnings.warn|_cuda_set_sync|capture_end" "$OUT/check.txt" | tail -30
fi
if [ -z "${SKIP_BENCH:-}" ]; then
    bench_args=()
    for op in ${BENCH_OPS:-}; do bench_args+=(--op "$op"); done
    python3 -m graphsafe bench "${bench_args[@]}" --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
    [ $? -eq 0 ] || status=1
    sed -n '/^time:/,$p' "$OUT/bench.txt"
fi
exit $status
