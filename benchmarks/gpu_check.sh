#!/usr/bin/env bash
# One GPU session's checks, most valuable first, each phase bounded so that a failure or a hang costs only
# its own slot (about 9 minutes in all on one H100/H200):
#
#     bash benchmarks/gpu_check.sh OUTDIR
#
#   env       the device, driver, torch and triton versions, the commit
#   tests_*   the kernel test files on the GPU (compiled Triton, odd shapes); the other tests marked gpu
#   planner   benchmarks/planner_accuracy.py --gpu: predicted vs measured step and peak, world 1
#   train     benchmarks/training.py --preset 1b: parallel3d vs transformers, eager then torch.compile
#   kernels   benchmarks/kernels.py --markdown: our Triton kernels vs eager, torch.compile and SDPA
#
# Each phase's output is OUTDIR/<phase>.log; its last lines and exit code also go to stdout.
set -u
OUTDIR=${1:-/tmp/gpu_check}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD

phase() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name: start $(date +%T), limit ${limit} s"
    timeout -k 5 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
    echo "=== $name: exit $? at $(date +%T)"
    tail -n "${TAIL:-15}" "$OUTDIR/$name.log"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    git rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
    uptime
} >"$OUTDIR/env.log" 2>&1
cat "$OUTDIR/env.log"

phase tests_kernels 90 python3 -m pytest -q -rfEs --timeout 60 tests/test_kernels_rmsnorm.py \
    tests/test_kernels_swiglu.py tests/test_kernels_rope.py tests/test_kernels_cross_entropy.py \
    tests/test_kernels_flash_attention.py tests/test_kernel_ops.py tests/test_fused_head.py
phase tests_gpu 45 python3 -m pytest -q -rfEs --timeout 40 -m "gpu or multigpu" tests/test_followups.py \
    tests/test_gpu_async.py tests/test_offload_overlap.py tests/test_flash_attn_backend.py
phase planner 160 python3 benchmarks/planner_accuracy.py --gpu --steps 6 --json
phase train_eager 60 python3 benchmarks/training.py --preset 1b --steps 5 --warmup 2 --impl parallel3d transformers
phase train_compile 90 python3 benchmarks/training.py --preset 1b --steps 5 --warmup 2 \
    --impl parallel3d+compile transformers+compile
phase kernels 90 python3 benchmarks/kernels.py --markdown
