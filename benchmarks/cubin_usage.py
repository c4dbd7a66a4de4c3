"""What a compiled kernel uses: registers, stack, local and shared memory from its cubin (`cuobjdump
-res-usage`, the tool Triton's NVIDIA backend ships), tensor-core instructions by kind from its PTX, and the
theoretical CTAs per SM that follow. benchmarks/kernel_report.py compiles; this reads what it compiled."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton

# per SM: 32-bit registers, max resident threads, max CTAs, shared memory per SM (bytes, usable per block opt-in)
ARCH = {80: dict(regs=65536, threads=2048, ctas=32, smem=164 * 1024),
        90: dict(regs=65536, threads=2048, ctas=32, smem=228 * 1024),
        100: dict(regs=65536, threads=2048, ctas=32, smem=228 * 1024)}
# tensor-core instructions in the PTX, by kind: Hopper uses wgmma for dots of >= 64 output rows (and warps
# in whole warpgroups), mma.sync below that
TC_PATTERNS = {"wgmma_ops": r"\bwgmma\.mma_async", "mma_sync_ops": r"\bmma\.sync", "tcgen05_ops": r"\btcgen05\.mma\b"}


def tools_dir() -> str:
    """ptxas and cuobjdump of the Triton imported (a release from triton_wheel.py brings its own)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def tools_available() -> bool:
    return all(os.path.isfile(os.path.join(tools_dir(), tool)) for tool in ("cuobjdump", "ptxas"))


def resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED and LOCAL (bytes, registers per thread) of the one function in `cubin`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.run([os.path.join(tools_dir(), "cuobjdump"), "-res-usage", path], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.unlink(path)
    usage = re.search(r"Function [^\n]*:\s*\n\s*(REG:.*)", text)
    fields = dict(re.findall(r"(\w+):(\d+)", usage.group(1))) if usage else {}
    return {k: int(fields.get(k, 0)) for k in ("REG", "STACK", "SHARED", "LOCAL")}


def occupancy(arch: int, regs: int, shared: int, warps: int) -> int:
    """Theoretical resident CTAs per SM (register file, shared memory, threads, CTA limit)."""
    a = ARCH[arch]
    threads = 32 * warps
    regs_per_cta = ((max(regs, 1) * 32 + 255) // 256) * 256 * warps  # allocated per warp in units of 256
    limits = [a["ctas"], a["threads"] // threads, a["regs"] // regs_per_cta]
    if shared:
        limits.append(a["smem"] // shared)
    return max(0, min(limits))
