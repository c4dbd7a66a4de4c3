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
from typing import Optional

import torch

REFERENCE_S = 0.5      # seconds of probes the reference is the median of
CHECK_S, CHECK_ROUNDS = 0.1, 3   # a plan's look at the speed now: the fastest of three 0.1 s medians
DRIFT = 1.25           # the speed now against the cache's, past which a plan says so: the 25%
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


def now(probe: Probe, seconds: float = CHECK_S, rounds: int = CHECK_ROUNDS) -> float:
    """The machine's probe now, for a plan whose op times all come from the cache: the fastest of `rounds`
    short medians, since a slow spell of a second or so (a 0.1 s median of 0.39 ms on an idle VM whose
    reference is 0.26) is the VM's noise, not its state (the fastest of three stayed within 0.229-0.261 ms)."""
    return min(probe.reference(seconds) for _ in range(rounds))


def drift_note(cached_s: float, now_s: float, load: float, path: str) -> Optional[str]:
    """What a plan tells its user when this machine's speed now is more than DRIFT from the speed the op
    cache at `path` keeps its times at (`cached_s`: its reference probe); None within it. The cache's times
    price every op, so a run now computes in about now_s / cached_s of the plan's time. One cause is a cache
    measured under load (a 0.41 ms reference against 0.25-0.26 quiet put tiny's plans 1.4-2.2x high), the
    other a machine loaded now; `load`: the load average, which tells them apart."""
    ratio = cached_s / now_s
    if 1 / DRIFT <= ratio <= DRIFT:
        return None
    how = f"{ratio:.2f}x faster" if ratio > 1 else f"{1 / ratio:.2f}x slower"
    return (f"note: the op cache {path} keeps its op times at a probe of {cached_s * 1e3:.3f} ms; this machine runs "
            f"that probe {how} now ({now_s * 1e3:.3f} ms, load average {load:.2f}), so a run now would compute "
            f"about {how} than planned. On a quiet machine, measure again with --reprofile; under load, plan "
            f"and run when it is quiet.")
