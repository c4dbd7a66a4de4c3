"""Host time of our kernel ops per forward + sum + backward, by path: the custom op (what torch.compile, the
planner's dry run and the profiler see), the direct autograd Function (what an eager call takes:
kernels/ops.py, `direct`) and eager torch's own op where there is one.

    python benchmarks/op_host_cost.py [--calls 2000] [--repeats 5]

On a GPU the Triton kernels launch on tiny tensors (their device time is a few microseconds, so the host sets
the pace); without one the kernels' launches do nothing (--stub, the default off CUDA) while the launch
functions still prepare them, which times all our host work but Triton's launch call itself. Prints the best
and the median of the repeats, microseconds per call. Results go to benchmarks/RESULTS.md by hand.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from parallel3d.kernels import ops, rmsnorm as rn, rope as rp  # noqa: E402


class _NoLaunch:
    """A Triton kernel whose launch does nothing (`kernel[grid](...)`)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stub_launches() -> Iterator[None]:
    """Inside, our RMSNorm and RoPE kernels launch nothing: the launch functions still prepare their launches
    (checks, strides, output allocations, grid and block sizes), so all our host work but the driver call is
    timed. Restored on exit."""
    kernels = {(module, name): getattr(module, name) for module in (rn, rp) for name in vars(module)
               if name.startswith("_") and name.endswith("_kernel")}
    for (module, name) in kernels:
        setattr(module, name, _NoLaunch())
    try:
        yield
    finally:
        for (module, name), kernel in kernels.items():
            setattr(module, name, kernel)


def cases(device: str) -> dict:
    x = torch.randn(16, 64, device=device, requires_grad=True)
    w = torch.ones(64, device=device, requires_grad=True)
    q = torch.randn(1, 16, 4, 64, device=device, requires_grad=True)
    k = torch.randn(1, 16, 2, 64, device=device, requires_grad=True)
    cos, sin = torch.randn(16, 64, device=device), torch.randn(16, 64, device=device)
    both = lambda pair: pair[0].sum() + pair[1].sum()  # noqa: E731
    return {"rmsnorm, custom op": lambda: ops.rmsnorm_fwd(x, w, 1e-6)[0].sum().backward(),
            "rmsnorm, direct Function": lambda: ops.rmsnorm(x, w, 1e-6).sum().backward(),
            "rmsnorm, eager torch": lambda: torch.nn.functional.rms_norm(x, (64,), w, 1e-6).sum().backward(),
            "rope, custom op": lambda: both(ops.rope_op(q, k, cos, sin, False)).backward(),
            "rope, direct Function": lambda: both(ops.rope(q, k, cos, sin)).backward()}


def time_us(fn, calls: int, repeats: int, sync) -> list[float]:
    for _ in range(calls // 10):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)   # host time: the device is never waited on
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stub", action="store_true", help="launch nothing, prepare everything (default off CUDA)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    stub = args.stub or not cuda
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
          f"{'launches stubbed' if stub else 'kernels launched'}; us per fwd + sum + bwd")
    with stub_launches() if stub else contextlib.nullcontext():
        for name, fn in cases(device).items():
            times = time_us(fn, args.calls, args.repeats, sync)
            print(f"{name:28s} best {min(times):7.1f}  median {statistics.median(times):7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
