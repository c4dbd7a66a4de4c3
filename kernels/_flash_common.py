"""What the flash-attention forward (flash_attention.py) and backward (flash_attention_bwd.py) kernels share:
the document-id tile test, tile configurations, argument checks and dtypes."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from parallel3d.kernels._triton_utils import acc_dtype, dot_dtype, interpreting, next_pow2

try:  # host-side TMA tensor descriptors (Triton >= 3.3); without them the kernels load through pointers
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


@triton.jit
def _doc_block(DOC, idx, n):
    """Document ids of positions idx (< n valid) and their [min, max] over the valid ones. Ids are >= 0;
    padding rows get -1 so they match no key (keys pad with -2)."""
    d = tl.load(DOC + idx, mask=idx < n, other=-1)  # (BLOCK,) int32
    lo = tl.min(tl.where(idx < n, d, 2147483647), axis=0)
    hi = tl.max(d, axis=0)
    return d, lo, hi


# Launch configurations, one table: (kernel, arch, head-dim class) -> (BLOCK_M, BLOCK_N, num_warps, num_stages).
# kernel: "fwd", "dkdv" (BLOCK_N key rows per program, BLOCK_M query rows per step) or "dq" (the reverse);
# the delta pre-pass has its own rule (delta_block_m). arch (tile_arch): 80 stands for mma.sync (sm_80-89),
# 90 for Hopper's warpgroup MMA (wgmma: a dot takes it when its output has a multiple of 64 rows and the
# warps are a multiple of 4), 100 for Blackwell's tcgen05 (its accumulators live in tensor memory, so other
# tiles fit). Consumer Blackwell (sm_120) has neither wgmma nor tcgen05 and no column of its own: the 100
# column compiles there to mma.sync, and its d=64 dK/dV and d=128 documents forward keep 24-80 B of stack
# (as with the 90 column; the 80 column's d=128 forward keeps 330 B) -- unexamined on such a GPU.
# Head-dim class: the smallest of 64, 128, 256 that holds d. Every 16-bit row spills
# nothing (no stack either) and uses its arch's tensor cores (but for the d=256 backward, below), chosen on
# paper from the ahead-of-time compile (benchmarks/kernel_report.py; checked by
# tests/test_kernel_budget.py, sm_100 in the sweep); where a 4-warp tile fitted it is preferred (on the H200
# the 4-warp tiles ran 2.2x the 8-warp ones, RESULTS.md). That holds under the pinned Triton (3.9); the GPU
# image's 3.6 allocates registers differently (`kernel_report.py --triton 3.6.0`, in CI for sm_90): there no
# tile tried keeps the pointer-loaded sm_90 dQ with documents at d=128, or the sm_90 d=256 forward, free of
# stack (the budget test names them), and sm_80's d=128 forward is (128, 64) because that tile is stack-free
# under both releases. The 100 column keeps the 90 column's forward and dQ tiles (every product on tcgen05,
# no stack); its dK/dV runs the key-rows form at d <= 128 (KEY_ROWS_16BIT), where the 90 column's query-rows
# tiles ran 64 of 72 products on mma.sync (RESULTS.md, "Blackwell's own tile column").
# Which rows run fastest is for a GPU to measure (attention_tiles.py, gpu_check.sh attn_table): the table is
# where a measurement lands. No autotune: every rank, every run alike.
TILES_16BIT = {
    ("fwd", 80, 64): (64, 32, 4, 3), ("fwd", 80, 128): (128, 64, 8, 2), ("fwd", 80, 256): (32, 32, 8, 2),
    ("fwd", 90, 64): (64, 32, 4, 3), ("fwd", 90, 128): (64, 32, 4, 3), ("fwd", 90, 256): (64, 16, 8, 2),
    ("dkdv", 80, 64): (32, 32, 4, 2), ("dkdv", 80, 128): (32, 64, 8, 2), ("dkdv", 80, 256): (16, 32, 8, 2),
    ("dkdv", 90, 64): (32, 64, 4, 2), ("dkdv", 90, 128): (32, 64, 8, 2), ("dkdv", 90, 256): (16, 32, 8, 2),
    ("dq", 80, 64): (64, 32, 4, 2), ("dq", 80, 128): (64, 32, 8, 2), ("dq", 80, 256): (16, 32, 8, 2),
    ("dq", 90, 64): (64, 32, 4, 2), ("dq", 90, 128): (64, 16, 8, 2), ("dq", 90, 256): (16, 32, 8, 2),
    ("fwd", 100, 64): (64, 32, 4, 3), ("fwd", 100, 128): (64, 32, 4, 3), ("fwd", 100, 256): (64, 16, 8, 2),
    ("dkdv", 100, 64): (32, 128, 8, 1), ("dkdv", 100, 128): (32, 64, 8, 1), ("dkdv", 100, 256): (16, 32, 8, 2),
    ("dq", 100, 64): (64, 32, 4, 2), ("dq", 100, 128): (64, 16, 8, 2), ("dq", 100, 256): (16, 32, 8, 2),
}
# Above 128, no dK/dV or dQ tile with a 64-row product fits in the registers on sm_90 (every one tried kept
# 400-1800 B of stack: a (64, 256) fp32 accumulator or 64-row operands of 256 columns per warpgroup), nor on
# sm_100 (56-1750 B at the 14 tcgen05 tiles tried, 8 and 16 warps), so the d=256 backward stays on mma.sync
# there, without spills (tests/test_kernel_budget.py names the exception).
# fp32 / fp64: exact IEEE dots (no tensor cores), small tiles on 8 warps; any arch. The dK/dV and dQ loops
# run unpipelined (1 stage): with 2 stages the split loops kept 16-600 B of stack at 255 registers.
TILES_FP32 = {
    ("fwd", 64): (32, 16, 4, 3), ("fwd", 128): (16, 32, 8, 2), ("fwd", 256): (16, 16, 8, 2),
    ("dkdv", 64): (32, 16, 8, 1), ("dkdv", 128): (16, 16, 8, 1), ("dkdv", 256): (16, 16, 8, 1),
    ("dq", 64): (32, 16, 8, 1), ("dq", 128): (16, 16, 8, 1), ("dq", 256): (16, 16, 8, 1),
}
INTERPRETER_TILES = (16, 16, 4, 1)

# TMA (sm_90+): the kernels named here, at these head-dim classes, load their Q / K / V / dO tiles through
# tensor descriptors (one `(1, rows, 1, block_d)` box of the (b, s, h, d) tensor per load: the copy engine
# computes the addresses and zero-fills rows past the sequence and columns past the head dim, as the pointer
# loads' masks do) instead of per-element pointers. What it buys on paper (benchmarks/kernel_report.py, sm_90,
# bf16, d=128): fewer registers for addresses, e.g. the 4-warp (64, 64) dK/dV tile the H200 measured fastest
# keeps 328 B of stack instead of 744. Empty until a GPU measures it against the pointer loads
# (benchmarks/attention_tiles.py times both for every candidate tile; gpu_check.sh attn_tiles): a row lands
# here when it is faster. The report compiles every 16-bit sm_90 variant both ways, so the path is held to
# the same budget in CI; the interpreter tests run it with INTERPRETER_TMA.
TMA_16BIT: frozenset = frozenset()
INTERPRETER_TMA = False
# dK/dV's key-rows form (flash_attention_bwd.py, KEY_ROWS: every product with the key tile's rows, all on
# warpgroup MMA once BLOCK_N >= 64; K and V held as left operands in registers) at these (arch, head-dim
# class) for 16-bit; the query-rows form elsewhere. On sm_90 at d=64 the (32, 64) key-rows tile compiles
# with no stack and all its products on wgmma, where the query-rows (64, 32) tile ran 64 of its 80 on
# mma.sync. At d=128 no key-rows tile is free of stack in both the pointer and the document-masked variant
# (K and V in registers beside the two fp32 accumulators: 184-1344 B on sm_90), so that class keeps the
# query-rows form until attention_tiles.py measures the two. On sm_100 the key-rows tiles of the 100 column
# put every product on tcgen05 with no stack at d=64 and 128, pointer and TMA loads, with and without
# documents. INTERPRETER_KEY_ROWS for the interpreter tests.
KEY_ROWS_16BIT: frozenset = frozenset({(90, 64), (100, 64), (100, 128)})
INTERPRETER_KEY_ROWS = False


def head_dim_class(d: int) -> int:
    """The table's head-dim row for head dim d: 64, 128 or 256 (everything above 128)."""
    return 64 if d <= 64 else 128 if d <= 128 else 256


def device_capability(device: torch.device) -> int:
    """Compute capability as 10 * major + minor (90 for sm_90); 0 off CUDA, where only
    benchmarks/kernel_report.py launches outside the interpreter (standing in the arch it compiles for)."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def tile_arch(capability: int) -> int:
    """The table's arch column for a compute capability: 80 below sm_90 (mma.sync), 90 for Hopper (wgmma), 100
    for sm_100 and later (tcgen05; consumer Blackwell, sm_120, compiles it to mma.sync: see the table)."""
    return 80 if capability < 90 else 90 if capability < 100 else 100


def delta_block_m(d: int) -> int:
    """Rows per program of the backward's delta pre-pass (dO and O tiles, no dot): 4096 elements of each,
    which keeps it free of stack on 4 warps at every head dim (bandwidth-bound, so no tile to tune)."""
    return 16 if interpreting() else max(16, min(128, 4096 // next_pow2(max(d, 16))))


def launch_config(kernel: str, d: int, dtype: torch.dtype, device: torch.device, block_m: Optional[int] = None,
                  block_n: Optional[int] = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of one attention kernel ("fwd", "dkdv", "dq") from the
    tables above; block_m / block_n override the tile (rounded up to a power of two)."""
    if interpreting():
        bm, bn, warps, stages = INTERPRETER_TILES
    elif dtype in (torch.float32, torch.float64):
        bm, bn, warps, stages = TILES_FP32[(kernel, head_dim_class(d))]
    else:
        bm, bn, warps, stages = TILES_16BIT[(kernel, tile_arch(device_capability(device)), head_dim_class(d))]
    return (next_pow2(block_m) if block_m else bm), (next_pow2(block_n) if block_n else bn), warps, stages


def use_tma(kernel: str, d: int, device: torch.device, *tensors: torch.Tensor) -> bool:
    """Whether `kernel` loads its tiles through TMA descriptors for these (b, s, h, d) operands: TMA_16BIT
    names it (sm_90+, 16-bit; INTERPRETER_TMA under the interpreter) and every operand meets TMA's layout
    rules (16-byte aligned base and strides, unit last stride); else the pointer loads."""
    if TensorDescriptor is None:
        return False
    if interpreting():
        wanted = INTERPRETER_TMA
    else:
        wanted = (tensors[0].dtype in (torch.bfloat16, torch.float16) and device_capability(device) >= 90
                  and (kernel, head_dim_class(d)) in TMA_16BIT)
    return wanted and all(_tma_layout(t) for t in tensors)


def key_rows_form(d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether dK/dV runs its key-rows form (KEY_ROWS_16BIT, by the table's arch column;
    INTERPRETER_KEY_ROWS under the interpreter)."""
    if interpreting():
        return INTERPRETER_KEY_ROWS
    arch = tile_arch(device_capability(device))
    return dtype in (torch.bfloat16, torch.float16) and (arch, head_dim_class(d)) in KEY_ROWS_16BIT


def _tma_layout(x: torch.Tensor) -> bool:
    size = x.element_size()
    return (x.numel() > 0 and x.data_ptr() % 16 == 0 and x.stride(-1) == 1
            and all(st * size % 16 == 0 for st in x.stride()[:-1]))


def tile_operand(x: torch.Tensor, rows: int, block_d: int, tma: bool):
    """x (b, s, h, d) as a kernel takes it: a TMA descriptor of (1, rows, 1, block_d) boxes, or x itself."""
    return TensorDescriptor.from_tensor(x, [1, rows, 1, block_d]) if tma else x


def _prep(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"expected q (b, sq, hq, d), k/v (b, sk, hk, d); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads {q.shape[2]} not a multiple of kv heads {k.shape[2]}")


def _docs(q_doc: Optional[torch.Tensor], k_doc: Optional[torch.Tensor], q: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel arguments for document ids: contiguous int32 (b, sq) / (b, sk), or q itself as an unused
    placeholder pointer when there are none (HAS_DOC=False). Ids must be >= 0 (padding uses -1 / -2).
    Block skipping compares id ranges, so it is only a shortcut; the per-pair equality test is exact."""
    if q_doc is None:
        if k_doc is not None:
            raise ValueError("k_doc given without q_doc")
        return q, q
    k_doc = q_doc if k_doc is None else k_doc
    if q_doc.shape != q.shape[:2]:
        raise ValueError(f"q_doc must be (b, sq) = {tuple(q.shape[:2])}, got {tuple(q_doc.shape)}")
    return q_doc.to(torch.int32).contiguous(), k_doc.to(torch.int32).contiguous()


def _kernel_dtypes(q: torch.Tensor) -> dict:
    """Constexprs every attention kernel takes: operand and accumulator dtypes, dot precision, and EXP2
    (softmax in base 2; off for fp64, which stays exact)."""
    return dict(DOT=dot_dtype(q.dtype), ACC=acc_dtype(q.dtype),
                PREC="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32", EXP2=base_two(q.dtype))


def base_two(dtype: torch.dtype) -> bool:
    """Whether the kernels exponentiate in base 2 (exp2 is one instruction; exp is exp2 with a multiply).
    fp64 keeps base e: float arguments and constants reach a kernel as fp32, whose roundings of log2(e) and
    ln(2) would cost fp64 its exactness."""
    return dtype != torch.float64


def logit_scale(scale: float, q: torch.Tensor) -> float:
    """The factor on q.k^T inside the kernels: scale * log2(e) in base 2, so that
    exp(scale * x - lse) = exp2(x * logit_scale - lse * log2(e)); scale in base e. It must be positive: the
    forward takes the row max of the unscaled logits and scales it (max(c s) = c max(s) only for c > 0)."""
    if not scale > 0:
        raise ValueError(f"attention scale must be positive, got {scale}")
    return scale * LOG2E if base_two(q.dtype) else scale


LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _pair_mask(r, c, qd, kd, seq_q, seq_k, diag, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr):
    """Which (query r, key c) pairs of a tile count, for a block that needs a mask (MASKED or HAS_DOC): in a
    MASKED block, both inside their sequences and, causal, c <= r + diag; with documents, of one document
    (ids qd, kd). r, c, qd, kd broadcast against each other: query-major ((BLOCK_M, 1) against (1, BLOCK_N))
    or key-major (transposed), so no register tile is transposed to mask it."""
    if MASKED:
        valid = (r < seq_q) & (c < seq_k)
        if CAUSAL:
            valid = valid & (c <= r + diag)
        if HAS_DOC:
            valid = valid & (qd == kd)
    else:
        valid = qd == kd
    return valid


@triton.jit
def _key_range(pid_m, seq_q, seq_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks query block pid_m visits (forward, dQ), split in two: [0, whole) every row of the block
    sees whole, unmasked; [whole, hi) masked (the causal diagonal, the ragged last block). Causal is
    bottom-right aligned: row i sees keys j <= i + seq_k - seq_q."""
    diag = seq_k - seq_q
    hi = seq_k                            # keys past the last one any row sees
    whole = (seq_k // BLOCK_N) * BLOCK_N  # key blocks inside seq_k ...
    if CAUSAL:
        hi = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + diag)
        # ... that the block's first row sees up to their last key: key j <= row pid_m * BLOCK_M + diag
        whole = tl.minimum(whole, (tl.maximum(pid_m * BLOCK_M + diag + 1, 0) // BLOCK_N) * BLOCK_N)
    return whole, hi


@triton.jit
def _heavy_first(pid, n, REVERSE: tl.constexpr):
    """Causal load balance over a grid axis of n query blocks (REVERSE: causal without documents): program
    pid runs block n - 1 - pid, so the blocks that see the most keys (the last) are issued first and the
    short ones fill the grid's tail (longest processing time first). Without the causal mask every block
    has the same work, and with packed documents about the same (each sees its own document's keys only);
    there the order stays, which also keeps the document-masked sm_80 forward at d=128 free of stack."""
    if REVERSE:
        pid = n - 1 - pid
    return pid


@triton.jit
def _exp(x, EXP2: tl.constexpr):
    """exp of a logit in the kernels' base: 2 ** x with EXP2, else e ** x."""
    if EXP2:
        y = tl.exp2(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _lse_to_base(lse, EXP2: tl.constexpr):
    """A natural-log lse (the ops' interface) in the kernels' base: once per row, where it is loaded."""
    if EXP2:
        lse = lse * _LOG2E
    return lse


@triton.jit
def _lse_from_base(m, l, EXP2: tl.constexpr):
    """lse in natural log from the running max m (kernel base) and the sum l of exponentials: m + log(l)."""
    if EXP2:
        out = (m + tl.log2(l)) * _LN2
    else:
        out = m + tl.log(l)
    return out
