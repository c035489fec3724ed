#!/usr/bin/env bash
# Issue 16's one-GPU measurements, on the GPU machine after `source bench/gpu_env.sh`:
#   overhead: W=1 through the distributed path over NCCL (torchrun, dev.always_distributed) against the plain
#             trainer, same scene and steps, PAIRS alternated pairs (both on our CUDA kernels);
#   psnr:     test PSNR at STEPS (7000) of W=2 gloo ranks sharing the GPU (train.batch_size=2)
#             against one process with batch 2 and one process with batch 1, one run per seed,
#             all runs of a seed side by side on the GPU (MPS).
#   bash bench/dist_one_gpu.sh overhead SCENE [STEPS=3000] [PAIRS=2]
#   fp16:     test PSNR at STEPS of W=2 gloo ranks with dist.compress=none against fp16, per seed,
#             all runs side by side on the GPU (quality only: the times are under contention).
#   bash bench/dist_one_gpu.sh psnr SCENE [STEPS=7000] [SEEDS="0 1 2"]
#   bash bench/dist_one_gpu.sh fp16 SCENE [STEPS=7000] [SEEDS="0 1 2"]
# Prints one line per run (seconds, wall ms/step, final test PSNR, Gaussians) from train_summary.json.
set -uo pipefail
what=$1 scene=$2
tmp=${TMPDIR:-/tmp}/dist_one_gpu
mkdir -p "$tmp"
quiet="--set log.eval_steps=[] --set log.save_steps=[] --set log.eval_train_views=false --set log.ckpt_every=0"
run_torch() { python3 -m torch.distributed.run --standalone "$@"; }

summary() {  # summary NAME FOLDER
    python3 - "$1" "$2" <<'EOF'
import json, sys
name, folder = sys.argv[1:]
try:
    d = json.load(open(f"{folder}/train_summary.json"))
except OSError:
    print(f"{name}: no train_summary.json (see {folder}.log)")
else:
    print(f"{name}: seconds {d['seconds']:.2f}  ms/step {d['wall_ms_per_step']:.3f}  "
          f"test PSNR {d['final_test_psnr']}  Gaussians {d['num_gaussians']}  backend {d.get('backend')}")
EOF
}

case $what in
overhead)
    steps=${3:-3000} pairs=${4:-2}
    for i in $(seq 1 "$pairs"); do
        out=$tmp/plain_$i; rm -rf "$out"
        python3 -m gstrain fit "$scene" --steps "$steps" --out "$out" $quiet > "$out.log" 2>&1
        summary "plain $i" "$out"
        out=$tmp/w1_$i; rm -rf "$out"
        run_torch --nproc-per-node=1 -m gstrain fit "$scene" --steps "$steps" --out "$out" $quiet \
            --set dev.always_distributed=true > "$out.log" 2>&1
        summary "W=1 NCCL $i" "$out"
    done
    ;;
psnr)
    steps=${3:-7000} seeds=${4:-"0 1 2"}
    for s in $seeds; do
        rm -rf "$tmp"/p_*_"$s"
        python3 -m gstrain fit "$scene" --steps "$steps" --seed "$s" --out "$tmp/p_b1_$s" > "$tmp/p_b1_$s.log" 2>&1 &
        python3 -m gstrain fit "$scene" --steps "$steps" --seed "$s" --out "$tmp/p_b2_$s" \
            --set train.batch_size=2 > "$tmp/p_b2_$s.log" 2>&1 &
        run_torch --nproc-per-node=2 -m gstrain fit "$scene" --steps "$steps" --seed "$s" --out "$tmp/p_w2_$s" \
            --set dist.backend=gloo --set train.batch_size=2 > "$tmp/p_w2_$s.log" 2>&1 &
    done
    wait
    for s in $seeds; do
        summary "seed $s one process B=1" "$tmp/p_b1_$s"
        summary "seed $s one process B=2" "$tmp/p_b2_$s"
        summary "seed $s W=2 gloo B=2" "$tmp/p_w2_$s"
    done
    ;;
fp16)
    steps=${3:-7000} seeds=${4:-"0 1 2"}
    for s in $seeds; do
        for c in ${COMPRESS:-none fp16}; do
            rm -rf "$tmp/f_${c}_$s"
            run_torch --nproc-per-node=2 -m gstrain fit "$scene" --steps "$steps" --seed "$s" --out "$tmp/f_${c}_$s" \
                --set dist.backend=gloo --set train.batch_size=2 --set dist.compress=$c > "$tmp/f_${c}_$s.log" 2>&1 &
        done
    done
    wait
    for s in $seeds; do
        for c in ${COMPRESS:-none fp16}; do
            summary "seed $s W=2 gloo compress $c" "$tmp/f_${c}_$s"
            grep -m1 -i "error\|non-finite\|nan" "$tmp/f_${c}_$s.log"
        done
    done
    ;;
*)
    echo "usage: bash bench/dist_one_gpu.sh overhead|psnr|fp16 SCENE [STEPS] [PAIRS|SEEDS]" >&2
    exit 2
    ;;
esac
