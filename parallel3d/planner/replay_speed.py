"""How fast this machine runs at the moment an op is replayed (planner/op_replay.py), so that op times
replayed at different moments compare: each replay is set beside a probe timed just before it, and the
cache keeps every time at the speed of one reference (`reference`, measured when the cache is made).

Why: a shared machine's speed moves under its load from outside (the vCPUs of this VM share physical
cores with other tenants). On an idle 2-vCPU VM one small GEMM, called back to back for 10 s, took 47 us
at best and 93 at the median. The 327 small ops of tiny's dp2 backward, replayed in order (five passes),
summed to 8.9-20.1 ms over 813 replays in a minute (median 9.5), and the median of ten replays in a row was
hardly steadier than one (stdev over mean 12% against 14%): the slow spells last seconds. A plan priced
each stretch of ops at its one replay: the cache priced the GEMMs tiny's dp2 and pp2 steps share 1.46x
higher in dp2's order, and a fresh replay a few seconds apart put one at 121 us in dp2's backward and 61
in pp2's. Scaled by a probe timed just before each replay, the median of three replays spread 7.9% instead
of 14.0%, of ten 3.9% instead of 12.0% (the same minute; one replay scaled alone is no steadier: 14%, the
probe is noisy too, hence the median over passes and rounds in op_replay).

The probe is the kinds of work a CPU step is made of, on one thread: a small GEMM and an element-wise
op over a cache-sized tensor, a quarter of a millisecond, timed warm."""
from __future__ import annotations

import statistics
import time

import torch

REFERENCE_S = 0.5      # seconds of probes the reference is the median of
_GEMM = (256, 64, 172)  # m, k, n: a tiny layer's FFN GEMM
_ELEMENTS = 1 << 15     # 128 KiB of fp32: in the core's cache


class Probe:
    """The reference work, its tensors made once."""

    def __init__(self) -> None:
        m, k, n = _GEMM
        gen = torch.Generator().manual_seed(0)
        self.a, self.b = torch.rand(m, k, generator=gen) + 0.5, torch.rand(k, n, generator=gen) + 0.5
        self.x, self.y = torch.rand(_ELEMENTS, generator=gen) + 0.5, torch.rand(_ELEMENTS, generator=gen) + 0.5

    def _pass(self) -> None:
        for _ in range(4):
            torch.mm(self.a, self.b)
            torch.mul(self.x, self.y)

    def __call__(self) -> float:
        """Seconds of one pass of the reference work, timed after an untimed one (the caller sets the thread
        count: op_replay). The untimed pass brings the probe's data back into the cache: after a replay
        that swept it out, a lone pass took 1.24x its reference, which scaled every replay after a large op
        down by a fifth (llama_100m's plans fell by 40%)."""
        self._pass()
        t0 = time.perf_counter()
        self._pass()
        return time.perf_counter() - t0

    def reference(self, seconds: float = REFERENCE_S) -> float:
        """The median probe over `seconds`: the speed a cache's op times are kept at."""
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            times.append(self())
        return statistics.median(times)
