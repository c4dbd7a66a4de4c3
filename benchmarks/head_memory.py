"""LM head + loss, fused (model.fused_head=true) vs unfused: peak memory of forward + backward, and CPU time.

    python benchmarks/head_memory.py [--tokens 8192] [--hidden 4096] [--vocabs 32000 128256] [--time-tokens 1024]

Memory: the head runs on the `meta` device (no values, any size) under a dispatch mode that adds every new
storage's bytes when an op creates it and subtracts them when it is freed; the peak is over the head's
forward and backward, above its inputs (hidden states and weight), bf16 activations as in training.
Bytes are exact and deterministic (they may be asserted; the fused head saves nothing of the logits' size,
tests/test_fused_head.py). Time: fp32 on this CPU at a smaller size, median of a few runs (never asserted).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import weakref

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Peak of live bytes of the storages created by ops run under this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.seen:
                    self.seen.add(key)
                    self.live += st.nbytes()
                    weakref.finalize(t, self._free, key, st.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def _head(fused: bool, vocab: int, hidden: int, device: str, dtype: torch.dtype):
    from parallel3d.models.config import ModelConfig
    from parallel3d.models.llama import Llama
    from parallel3d.mesh import ParallelContext

    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=1, num_heads=8, num_kv_heads=8,
                      ffn_hidden_size=4 * hidden, kernels="torch", fused_head=fused)
    with torch.device("meta"):
        model = Llama(cfg, ParallelContext.single(), layers=[], pre=False, post=True)
    return model.to_empty(device=device).to(dtype)


def peak_bytes(fused: bool, tokens: int, vocab: int, hidden: int) -> int:
    head = _head(fused, vocab, hidden, "meta", torch.bfloat16)
    x = torch.empty(1, tokens, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with LiveBytes() as mode:
        head(x, torch.arange(tokens, device="meta"), labels).backward()
    return mode.peak


def seconds(fused: bool, tokens: int, vocab: int, hidden: int, iters: int = 3) -> float:
    head = _head(fused, vocab, hidden, "cpu", torch.float32)
    torch.nn.init.normal_(head.lm_head.weight, std=0.02)
    torch.nn.init.ones_(head.norm.weight)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        head(x, torch.arange(tokens), labels).backward()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[iters // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--time-tokens", type=int, default=1024)
    ap.add_argument("--time-hidden", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"head fwd+bwd, bf16, {args.tokens} tokens, hidden {args.hidden}, tp=1 (peak above the inputs)")
    print(f"{'vocab':>7} {'unfused GiB':>12} {'fused GiB':>10} {'ratio':>6}   "
          f"time fp32 {args.time_tokens}x{args.time_hidden}: {'unfused s':>9} {'fused s':>8}")
    for v in args.vocabs:
        un, fu = (peak_bytes(f, args.tokens, v, args.hidden) / 2 ** 30 for f in (False, True))
        tu, tf = (seconds(f, args.time_tokens, v, args.time_hidden) for f in (False, True))
        print(f"{v:>7} {un:>12.2f} {fu:>10.2f} {un / fu:>6.1f}   {'':>30}{tu:>9.2f} {tf:>8.2f}")


if __name__ == "__main__":
    main()
