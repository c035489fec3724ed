#!/usr/bin/env bash
# CUDA tests and compute-sanitizer checks, for a GPU machine. Exit status non-zero if anything
# fails. Logs go to $OUT when it is set (the device tool's output folder), else only to stdout.
#   bash bench/gpu_tests.sh         (from anywhere; runs in the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"

log() {  # log NAME: tee into $OUT/NAME when $OUT is set
    if [ -n "${OUT:-}" ]; then tee -a "$OUT/$1"; else cat; fi
}

# Wheels carried to a machine without a registry (see the device notes); skip if already there.
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site/gsplat ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "gpu_tests: wheel install failed"; exit 1; }
fi
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

status=0
echo "== pytest -m cuda" | log gpu_tests.log
python3 -m pytest -m cuda -q tests/ bench/tests/ 2>&1 | log gpu_tests.log || status=1

# The sanitizers need no caching allocator: each tensor its own allocation, so overruns show.
for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool" | log "sanitizer_$tool.log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" --error-exitcode 3 \
        python3 -m bench.sanitize_case 2>&1 | log "sanitizer_$tool.log" || status=1
    # the fused SSIM kernels: tile edges, batches, 1 and 4 channels
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" --error-exitcode 3 \
        python3 -m bench.bench_ssim --sanitize-case 2>&1 | log "sanitizer_$tool.log" || status=1
done

# Conv vs fused SSIM timing (a few seconds; the extension is already built by the tests above).
echo "== bench_ssim" | log bench_ssim.log
python3 -m bench.bench_ssim 2>&1 | log bench_ssim.log || status=1

if [ "$status" -eq 0 ]; then echo "gpu_tests: all passed"; else echo "gpu_tests: FAILED"; fi
exit "$status"
