"""The host allocator of a CPU run: freed memory is kept for the next tensor, not handed back to the kernel.

PyTorch's CPU tensors come from malloc. glibc hands large freed blocks back to the kernel (blocks it
mmapped, and the top of its heap past a trim threshold), so the next tensor of that size faults its pages
in again, each zeroed by the kernel. One llama_100m training step on one thread took about 490,000 page
faults and 0.7 s of system time out of 3.4 s that way. A GPU run does not pay this: the CUDA caching
allocator keeps device memory for reuse. `keep_freed_memory` asks glibc for the same behaviour (trim only
past 2 GiB of free top, mmap only blocks above 32 MiB, grow the heap 1 GiB at a time, untouched until
used); the same step then took 2.6-2.8 s with a few thousand faults in its first steps and none after.
The cost: freed memory stays with the process, and where buffers of many sizes come and go the heap
fragments, so peak RSS grows (llama_100m at world 2: unchanged for ZeRO-0, TP, PP and CP; about 30% more
for ZeRO-1/2, whose per-bucket buffers come and go).

Not glibc (macOS, musl): nothing to do, and nothing is done.
"""
from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((M_TRIM_THRESHOLD, 2**31 - 1), (M_MMAP_THRESHOLD, 32 << 20), (M_TOP_PAD, 1 << 30))


def keep_freed_memory() -> bool:
    """Set SETTINGS through glibc's mallopt; True when every setting was taken."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
