#!/usr/bin/env bash
# One GPU session's checks, most valuable first, each phase bounded so that a failure or a hang costs only
# its own slot (about 10 minutes in all on one H100/H200):
#
#     bash benchmarks/gpu_check.sh OUTDIR [PHASE ...]      (default: PHASES below; any phase listed here by name)
#
#   tests_kernels  the kernel test files on the GPU (compiled Triton, odd shapes)
#   tests_gpu      the other tests marked gpu (multigpu ones skip on one GPU)
#   planner        benchmarks/planner_accuracy.py --gpu: predicted vs measured step and peak, world 1
#                  (PLANNER_LAYOUTS, default none,accum4,offload; PLANNER_S seconds, default 200)
#   profile        benchmarks/step_profile.py --plan: where a step's time goes (kernels by time, device busy) and
#                  the planner's seconds per op beside the profiled ones (PROFILE_LAYOUT, default none)
#   dispatch       eager PyTorch's host cost per launched op, and the shortest kernel's device time
#   attn_tiles     benchmarks/attention_tiles.py: each attention kernel's candidate tiles, pointer and TMA loads (dK/dV
#                  in both forms), at d128 and d64 (ATTN_TILES_D; ATTN_TILES_S seconds, default 380); the fastest
#                  beside the table's choice in OUTDIR/attn_tiles.md
#   issue49        issue 49 in one 10-minute call, most valuable first: attn_tiles at d128 (120 s), bwd49 (the head
#                  and RoPE rows), fp8_step, flex, then attn_table for as many shapes as 150 s allow; the same as
#                  ATTN_TILES_S=120 ATTN_TILES_D=128 ATTN_TABLE_S=150 ... attn_tiles bwd49 fp8_step flex attn_table
#   flex           model.attention=flex on CUDA (tests/test_flex_backend.py -m gpu): the compiled FlexAttention's
#                  forward and backward against fp64 on packed documents, and 3 Trainer steps against auto's
#   attn_rates     attention's share of the peak (SDPA's, ours, the CP block's) at four shapes, beside HOPPER_ATTENTION
#   attn_table     benchmarks/attention_table.py: issue 49's shapes (ATTN_TABLE_S seconds, default 480): causal GQA 32/8 and
#                  64/8, head dim 64 and 128, 8K-64K tokens, and packed documents; ours against each SDPA backend,
#                  the CP block, FlexAttention with a document block mask and flash-attn where installed, forward
#                  and backward; markdown tables for RESULTS.md in OUTDIR/attn_table.md (rewritten after each shape)
#   opcost         benchmarks/op_host_cost.py: host time of RMSNorm and RoPE forward + backward by path (custom op,
#                  the direct autograd Function eager calls take, eager torch), then cProfile of the launcher
#   train_eager    benchmarks/training.py --preset 1b: parallel3d vs transformers, eager
#   train_compile  the same under torch.compile
#   kernels        benchmarks/kernels.py --markdown: our Triton kernels vs eager, torch.compile and SDPA
#   bwd49          issue 49.3: the fused linear + CE (n8192 h4096 v128256, summed as the model's head and per-token)
#                  and RoPE (b4 s4096 hq32 hk8 d128), bf16, against torch.compile: forward, forward + backward,
#                  backward, their compile/ours ratios (> 1: ours faster), the head's peak memory above its
#                  inputs (also at 4096-row chunks: fewer fp32 d weight passes, twice the chunk logits), and
#                  RoPE's raw forward / backward kernel times (also one token per program) beside the autograd backward
#   fp8_kernels    tests/test_kernels_fp8_cast.py compiled on the GPU: the fused fp8 casts' bytes (the hardware's
#                  conversion) against the torch twin's, both fp8 formats, odd shapes
#   fp8_step       benchmarks/fp8_step.py: the training step at Llama-3 8B layer shapes (h 4096, ffn 14336, GQA 32/8,
#                  seq 8192, as many layers as fit), bf16 vs train.fp8=tensorwise vs rowwise: s/step, ratios, loss
#                  difference, fp8 weight casts per step (FP8_LAYERS overrides the layer count)
#   selftest2      launch/selftest.py at world 2 on ONE GPU, two NCCL ranks sharing it (NCCL_MULTI_RANK_GPU_ENABLE=1,
#                  NCCL 2.30 or newer; else it says why not): the first real NCCL run on a one-GPU session
#   selftest       launch/selftest.py on every GPU of the node (at least 2), one rank each
#   simrank        launch/pretrain.py --simulate-rank: one rank of a large layout alone on this GPU, 4 steps, then
#                  launch/plan.py --compare (on the CPU, beside the next run): its measured peak memory, step and
#                  stage compute beside the plan (SIMRANK_LAYOUTS, default "8b 70b 405b moe": Llama 3 8B at
#                  TorchTitan's 128-GPU FSDP, 70B at FSDP32 x TP8 (256), 405B at TP8 PP16 as the planner fits it
#                  (8192), Mixtral 8x7B at its preset's EP 8 (32); SIMRANK_S per run, default 180; SIMRANK_GPU h200)
#   sanitizer      TORCH_CUDA_SANITIZER=1 (PyTorch's CUDA stream sanitizer) over simulated ranks of a 4-layer
#                  llama_100m, 2 steps each: ZeRO 1-3, HSDP, offload, overlap_param_gather, MoE with ep == dp
#                  (plain and parallel.ep_overlap + model.moe_delay_wgrad: pairs in turns, the backward on
#                  autograd's device thread, the weight gradients beside a started all-to-all), TP+PP
#                  (SANITIZER_LAYOUTS; SANITIZER_S per layout, default 90). A race ends the run: exit 1, "CSAN" in the log
#
# OUTDIR/env.log holds the device, driver, torch and triton versions and the commit; each phase's output
# is OUTDIR/<phase>.log, and its last lines and exit code also go to stdout.
set -u
OUTDIR=${1:-/tmp/gpu_check}
shift || true
PHASES=${*:-tests_kernels tests_gpu bwd49 planner attn_rates train_eager train_compile kernels}
mkdir -p "$OUTDIR"
if [[ " $PHASES " == *" issue49 "* ]]; then   # an alias (see the header), its budgets unless set
    PHASES=${PHASES//issue49/attn_tiles bwd49 fp8_step flex attn_table}
    : "${ATTN_TILES_S:=120}" "${ATTN_TILES_D:=128}" "${ATTN_TABLE_S:=150}"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD

phase() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name: start $(date +%T), limit ${limit} s"
    timeout -k 5 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
    echo "=== $name: exit $? at $(date +%T)"
    tail -n "${TAIL:-15}" "$OUTDIR/$name.log"
}

DISPATCH='
import time, torch
x = torch.zeros(16, device="cuda"); torch.cuda.synchronize()
for n in (2000, 20000):
    t0 = time.perf_counter()
    for _ in range(n): x.add_(1)
    host = time.perf_counter() - t0; torch.cuda.synchronize(); total = time.perf_counter() - t0
    print(f"{n} add_ on 16 elements: host {host / n * 1e6:.2f} us/op, host+device {total / n * 1e6:.2f} us/op")
'

OPCOST='
import cProfile, pstats, torch
from parallel3d.kernels.rmsnorm import rmsnorm_forward
x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
prof = cProfile.Profile(); prof.enable()
for _ in range(500): rmsnorm_forward(x, w, 1e-6)
prof.disable(); torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(14)
'

# attention's share of the dense bf16 peak, SDPA's kernels, ours and the CP block's (SDPA's flash op with the lse),
# forward and backward, at several shapes:
# the planner's hardware.HOPPER_ATTENTION comes from one shape (b2 s4096 hq32 hk8 d128 causal)
ATTN_RATES='
import torch, triton.testing
from parallel3d.hardware import peak_flops_of
from parallel3d.kernels import dispatch, ops
from parallel3d.kernels.attention_backend import select_attention
from parallel3d.planner.hardware import HOPPER_ATTENTION
peak = peak_flops_of(torch.cuda.get_device_name(), "bf16")   # FLOP/s
print("planner shares:", {k: round(v, 3) for k, v in HOPPER_ATTENTION.items()})
for b, s, hq, hk, d in ((2, 4096, 32, 8, 128), (1, 8192, 32, 8, 128), (4, 2048, 16, 8, 128), (2, 4096, 32, 8, 64)):
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (hq, hk, hk))
    fwd = 4 * b * hq * (s * (s + 1) / 2) * d
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                                    is_causal=True, enable_gqa=True)
    ours = lambda: ops.flash_attention(q, k, v, True)[0]
    blocks = lambda: dispatch.attention_with_lse(q, k, v, True, None, "auto")[0]   # CP blocks: the flash op
    for name, f in (("sdpa", sdpa), ("ours", ours), ("cp-block " + select_attention("auto", q, True), blocks)):
        ms = triton.testing.do_bench(f)                                   # forward
        ms_both = triton.testing.do_bench(lambda: f().sum().backward())   # forward + backward
        print(f"b{b} s{s} hq{hq} hk{hk} d{d} {name}: forward {fwd / (ms * 1e-3) / peak:.2f} of peak, "
              f"backward {2.5 * fwd / ((ms_both - ms) * 1e-3) / peak:.2f}")
'

# issue 49.3: the fused head and RoPE backward against torch.compile at the issue's shapes (ratios: compile / ours)
BWD49='
import torch, triton.testing
from parallel3d.kernels import fused_linear_cross_entropy as fl, rope as rp
bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=60, return_mode="median")
bf = torch.bfloat16
b, s, hq, hk, d = 4, 4096, 32, 8, 128
q = torch.randn(b, s, hq, d, device="cuda", dtype=bf, requires_grad=True)
k = torch.randn(b, s, hk, d, device="cuda", dtype=bf, requires_grad=True)
dq, dk = torch.randn_like(q), torch.randn_like(k)
cos, sin = rp.rope_cos_sin(torch.arange(s, device="cuda"), rp.rope_inv_freq(d, 500000.0))
ref = torch.compile(rp.rope_reference)
rope = {"ours": lambda: rp.rope(q, k, cos, sin), "compile": lambda: ref(q, k, cos, sin)}
out = {}
for name, f in rope.items():
    fwd, fb = bench(f), bench(lambda: torch.autograd.grad(f(), (q, k), (dq, dk)))
    kept = f()   # the backward alone: one forward, graph retained
    bwd = bench(lambda: torch.autograd.grad(kept, (q, k), (dq, dk), retain_graph=True))
    out[name] = (fwd, fb, bwd)
    print(f"rope b{b} s{s} hq{hq} hk{hk} d{d} {name}: fwd {fwd:.3f} ms, fwd+bwd {fb:.3f} ms, bwd alone {bwd:.3f} ms")
kf = bench(lambda: rp.rope_apply(q.detach(), k.detach(), cos, sin))
kb = bench(lambda: rp.rope_apply(dq, dk, cos, sin, backward=True))
kb1 = bench(lambda: rp.rope_apply(dq, dk, cos, sin, backward=True, tokens_per_program=1))
print(f"rope kernels alone: forward {kf:.3f} ms, backward {kb:.3f} ms (one token per program: {kb1:.3f} ms)")
o, c = out["ours"], out["compile"]
print(f"RATIO rope compile/ours: fwd {c[0] / o[0]:.2f}, fwd+bwd {c[1] / o[1]:.2f}, bwd alone {c[2] / o[2]:.2f}")
del q, k, dq, dk
n, h, v = 8192, 4096, 128256
hid = torch.randn(n, h, device="cuda", dtype=bf, requires_grad=True)
wt = (0.02 * torch.randn(v, h, device="cuda")).to(bf).requires_grad_()
tgt = torch.randint(0, v, (n,), device="cuda")
summed = torch.compile(lambda x, w, t: fl.fused_linear_cross_entropy_reference(x, w, t).sum())
head = {"ours": lambda: fl.fused_linear_cross_entropy(hid, wt, tgt, reduction="sum"),   # 2048-row chunks
        "ours-chunk4096": lambda: fl.fused_linear_cross_entropy(hid, wt, tgt, chunk=4096, reduction="sum"),
        "ours-per-token": lambda: fl.fused_linear_cross_entropy(hid, wt, tgt).sum(),
        "compile": lambda: summed(hid, wt, tgt)}
res = {}
for name, f in head.items():
    fwd, fb = bench(f), bench(lambda: torch.autograd.grad(f(), (hid, wt)))
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    torch.autograd.grad(f(), (hid, wt)); torch.cuda.synchronize()
    res[name] = (fwd, fb, (torch.cuda.max_memory_allocated() - base) / 2 ** 30)
    print(f"head n{n} h{h} v{v} {name}: fwd {fwd:.2f} ms, fwd+bwd {fb:.2f} ms, bwd {fb - fwd:.2f} ms, "
          f"peak {res[name][2]:.2f} GiB above the inputs")
c = res["compile"]
for name in ("ours", "ours-chunk4096", "ours-per-token"):
    o = res[name]
    bwd = (c[1] - c[0]) / max(o[1] - o[0], 1e-3)
    print(f"RATIO head {name} compile/ours: fwd+bwd {c[1] / o[1]:.2f}, bwd {bwd:.2f}, "
          f"peak {o[2]:.2f} GiB vs compile {c[2]:.2f} GiB")
'

# the selftest at world 2 on one GPU: NCCL lets two ranks share a GPU from 2.30 (NCCL_MULTI_RANK_GPU_ENABLE=1)
SELFTEST2='
version=$(python3 -c "import torch
v = torch.cuda.nccl.version()   # (major, minor, patch), or major*10000 + minor*100 + patch on older torch
v = v if isinstance(v, tuple) else (v // 10000, v // 100 % 100, v % 100)
print(*v, sep=\".\")")
echo "NCCL ${version:-none}, $(python3 -c "import torch; print(torch.cuda.device_count())") GPU(s)"
if [ -z "$version" ]; then
    echo "selftest2 not run: this torch has no NCCL"
elif python3 -c "import sys; sys.exit(0 if tuple(map(int, \"$version\".split(\".\"))) >= (2, 30, 0) else 1)"; then
    NCCL_MULTI_RANK_GPU_ENABLE=1 python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
        launch/selftest.py --json "$1/selftest2.json"
else
    echo "selftest2 not run: NCCL $version is older than 2.30, the first that lets two ranks share one GPU"
fi
'
# simrank: "config world rank overrides" per layout (the published plans' overrides: planner_published.py)
simrank_layout() {
    case $1 in
    8b) echo "llama3_8b 128 0 parallel.tp=1 parallel.pp=1 parallel.sp=false parallel.zero=3 parallel.dp=0" \
        "train.seq_len=8192 train.micro_batch_size=2 train.global_batch_size=256 train.activation_checkpointing=selective" ;;
    70b) echo "llama3_70b 256 0 parallel.tp=8 parallel.pp=1 parallel.sp=true parallel.zero=3 parallel.dp=0" \
        "parallel.schedule=1f1b parallel.virtual_stages=1 train.seq_len=8192 train.micro_batch_size=16" \
        "train.global_batch_size=512 train.activation_checkpointing=full train.fp8=tensorwise" ;;
    405b) echo "llama3_405b 8192 0 parallel.tp=8 parallel.pp=16 parallel.sp=true parallel.zero=1 train.seq_len=8192" \
        "train.micro_batch_size=1 train.global_batch_size=2048 parallel.dp=0 parallel.schedule=interleaved" \
        "parallel.virtual_stages=2 train.activation_checkpointing=selective train.recompute_layers=2" ;;
    moe) echo "mixtral_8x7b 32 0 parallel.tp=1 parallel.pp=4 parallel.ep=8 parallel.zero=1" ;;
    *) echo "" ;;
    esac
}

# sanitizer: "world rank overrides" per layout, on a 4-layer llama_100m with small buckets (several in flight)
SANITIZER_BASE="model.num_layers=4 train.seq_len=512 train.micro_batch_size=1 train.global_batch_size=8
    parallel.bucket_size=5000000 train.steps=2 train.warmup_steps=1 train.eval_interval=0 log.interval=1"
sanitizer_layout() {
    case $1 in
    zero1) echo "8 3 parallel.zero=1" ;;
    zero2) echo "8 3 parallel.zero=2" ;;
    zero3) echo "8 3 parallel.zero=3" ;;
    hsdp) echo "8 3 parallel.zero=3 parallel.dp_shard=4" ;;
    offload) echo "8 3 parallel.zero=1 parallel.offload_optimizer=cpu" ;;
    offload3) echo "8 3 parallel.zero=3 parallel.offload_params=cpu parallel.offload_optimizer=cpu" ;;
    overlap) echo "8 3 parallel.zero=1 parallel.overlap_param_gather=true" ;;
    moe) echo "8 3 parallel.zero=1 parallel.ep=8 model.num_experts=8 model.moe_top_k=2 model.moe_ffn_hidden_size=512" ;;
    moe_overlap) echo "8 3 parallel.zero=1 parallel.ep=8 model.num_experts=8 model.moe_top_k=2 model.moe_ffn_hidden_size=512 parallel.ep_overlap=true model.moe_delay_wgrad=true" ;;
    tp_pp) echo "16 15 parallel.zero=1 parallel.tp=2 parallel.pp=2 parallel.sp=true" ;;
    *) echo "" ;;
    esac
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    # the release the AOT report's device case compiles with (benchmarks/triton_wheel.py): say when the image moved
    python3 -c "import sys, triton; sys.path.insert(0, 'benchmarks'); import triton_wheel as w
print('' if triton.__version__ == w.DEVICE_TRITON else f'NOTE: triton {triton.__version__} here, DEVICE_TRITON is {w.DEVICE_TRITON}: update it')"
    git rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
    uptime
} >"$OUTDIR/env.log" 2>&1
cat "$OUTDIR/env.log"

for p in $PHASES; do
    case $p in
    tests_kernels) phase tests_kernels 90 python3 -m pytest -q -rfEs --timeout 60 tests/test_kernels_rmsnorm.py \
        tests/test_kernels_swiglu.py tests/test_kernels_rope.py tests/test_kernels_cross_entropy.py \
        tests/test_kernels_flash_attention.py tests/test_kernel_ops.py tests/test_fused_head.py ;;
    tests_gpu) phase tests_gpu 75 python3 -m pytest -q -rfEs --timeout 40 -m "gpu or multigpu" \
        tests/test_followups.py tests/test_gpu_async.py tests/test_offload_overlap.py tests/test_flash_attn_backend.py \
        tests/test_attention_cuda_flash.py ;;
    planner) phase planner "${PLANNER_S:-200}" python3 benchmarks/planner_accuracy.py --gpu --steps 6 --json \
        --layouts "${PLANNER_LAYOUTS:-none,accum4,offload}" ;;
    profile) phase profile 90 python3 benchmarks/step_profile.py --layout "${PROFILE_LAYOUT:-none}" --top 25 --plan ;;
    dispatch) phase dispatch 30 python3 -c "$DISPATCH" ;;
    attn_rates) phase attn_rates 100 python3 -c "$ATTN_RATES" ;;
    attn_table) TAIL=80 phase attn_table $((${ATTN_TABLE_S:-480} + 80)) python3 benchmarks/attention_table.py \
        --budget-s "${ATTN_TABLE_S:-480}" --out "$OUTDIR/attn_table.md" ;;
    opcost) phase opcost 60 bash -c 'python3 benchmarks/op_host_cost.py && python3 -c "$0"' "$OPCOST" ;;
    attn_tiles) TAIL=20 phase attn_tiles $((${ATTN_TILES_S:-380} + 60)) python3 benchmarks/attention_tiles.py \
        --budget-s "${ATTN_TILES_S:-380}" --head-dims ${ATTN_TILES_D:-128 64} --out "$OUTDIR/attn_tiles.md" ;;
    train_eager) phase train_eager 60 python3 benchmarks/training.py --preset 1b --steps 5 --warmup 2 \
        --impl parallel3d transformers ;;
    train_compile) phase train_compile 90 python3 benchmarks/training.py --preset 1b --steps 5 --warmup 2 \
        --impl parallel3d+compile transformers+compile ;;
    kernels) phase kernels 90 python3 benchmarks/kernels.py --markdown ;;
    bwd49) TAIL=16 phase bwd49 150 python3 -c "$BWD49" ;;
    flex) phase flex 90 python3 -m pytest -q -rfEs --timeout 80 -m gpu tests/test_flex_backend.py ;;
    fp8_kernels) phase fp8_kernels 90 python3 -m pytest -q -rfEs --timeout 80 tests/test_kernels_fp8_cast.py ;;
    fp8_step) TAIL=12 phase fp8_step 90 python3 benchmarks/fp8_step.py --layers "${FP8_LAYERS:-0}" --steps 3 --warmup 2 ;;
    selftest2) TAIL=45 phase selftest2 240 bash -c "$SELFTEST2" selftest2 "$OUTDIR" ;;
    selftest) TAIL=45 phase selftest 300 python3 -m torch.distributed.run --standalone \
        --nproc_per_node="$(python3 -c "import torch; print(max(2, torch.cuda.device_count()))")" \
        launch/selftest.py --json "$OUTDIR/selftest.json" ;;
    simrank)   # each run on the GPU, then its plan on the CPU in the background while the next runs
        for name in ${SIMRANK_LAYOUTS:-8b 70b 405b moe}; do
            read -r cfg world rank ov <<<"$(simrank_layout "$name")"
            [ -n "$cfg" ] || { echo "unknown simrank layout $name"; continue; }
            run="$OUTDIR/simrank_$name"
            rm -f "$run.jsonl" "$run.timeline.json"   # (the JSONL is appended to)
            # shellcheck disable=SC2086
            phase "simrank_$name" "${SIMRANK_S:-180}" python3 launch/pretrain.py --config "configs/$cfg.yaml" \
                --simulate-rank "$rank" --world-size "$world" $ov train.steps=4 train.warmup_steps=1 \
                train.eval_interval=0 log.interval=1 "log.jsonl=$run.jsonl" "log.timeline=$run.timeline.json" \
                log.timeline_step=1   # the timeline's step synchronises per action: not one the step time is read from
            # shellcheck disable=SC2086
            [ -s "$run.jsonl" ] && TAIL=40 phase "simrank_${name}_plan" "${SIMRANK_PLAN_S:-240}" python3 launch/plan.py \
                --config "configs/$cfg.yaml" --world-size "$world" --gpu "${SIMRANK_GPU:-h200}" $ov \
                --compare "$run.jsonl" --timeline "$run.timeline.json" &
        done
        wait ;;
    sanitizer)
        for name in ${SANITIZER_LAYOUTS:-zero1 zero2 zero3 hsdp offload offload3 overlap moe moe_overlap tp_pp}; do
            read -r world rank ov <<<"$(sanitizer_layout "$name")"
            [ -n "$world" ] || { echo "unknown sanitizer layout $name"; continue; }
            # shellcheck disable=SC2086
            TORCH_CUDA_SANITIZER=1 phase "sanitizer_$name" "${SANITIZER_S:-90}" python3 launch/pretrain.py \
                --config configs/llama_100m.yaml --simulate-rank "$rank" --world-size "$world" $SANITIZER_BASE $ov
            echo "    sanitizer_$name: $(grep -c 'CSAN' "$OUTDIR/sanitizer_$name.log") lines naming CSAN"
        done ;;
    *) echo "unknown phase $p" ;;
    esac
done
