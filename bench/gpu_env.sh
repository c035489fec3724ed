# Sourced from the repository root at the start of a GPU-machine call (the device tool):
#   source bench/gpu_env.sh            (then the commands), or: bash bench/gpu_env.sh CMD ARGS...
# Installs the carried wheels (.whl/: gsplat 1.5.3, pycolmap) into /tmp/site, sets the paths,
# starts the CUDA MPS daemon (so that several quality runs, bench_train --jobs K, overlap their
# kernels), and builds gsplat's and gstrain's CUDA extensions once, side by side (bench/builds.py). A gsplat
# module built on an earlier machine of the same image can be carried as
# .benchdata/gsplat_cuda.so.gz (see bench/gsplat_prebuilt.py); a fresh build is saved to
# $OUT/gsplat_cuda.so.gz for the next call. Logs go to $OUT (else /tmp).
export PYTHONUNBUFFERED=1
logs=${OUT:-/tmp}
[ -d /tmp/site/gsplat ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=$PWD/build/ext
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog
pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d
t0=$(date +%s)
if [ -f .benchdata/gsplat_cuda.so.gz ] && [ ! -f /tmp/site/gsplat/gsplat_cuda.so ]; then
    gunzip -c .benchdata/gsplat_cuda.so.gz > /tmp/site/gsplat/gsplat_cuda.so &&
        cp bench/gsplat_prebuilt.py /tmp/site/gsplat/csrc.py
fi
MAX_JOBS=8 python3 -m bench.builds gsplat > "$logs/build_gsplat.log" 2>&1 &
MAX_JOBS=16 python3 -m bench.builds gstrain > "$logs/build_gstrain.log" 2>&1
wait
echo "gpu_env: builds done in $(( $(date +%s) - t0 )) s"
tail -n 2 "$logs/build_gsplat.log" "$logs/build_gstrain.log"
if [ -f build/ext/gsplat_cuda/gsplat_cuda.so ] && [ ! -f /tmp/gsplat_saved ] && [ -n "${OUT:-}" ]; then
    gzip -c build/ext/gsplat_cuda/gsplat_cuda.so > "$OUT/gsplat_cuda.so.gz" && touch /tmp/gsplat_saved
fi
# Run as a program (`bash bench/gpu_env.sh CMD ...`) its exports reach no later command, so it runs CMD here.
if [ "${BASH_SOURCE[0]}" = "$0" ] && [ $# -gt 0 ]; then exec "$@"; fi
