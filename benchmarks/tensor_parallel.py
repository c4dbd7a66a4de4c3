"""TP Llama training step: parallel3d vs PyTorch DTensor `parallelize_module`, same model and batch.

    python benchmarks/tensor_parallel.py [--tp 2] [--hidden 256] [--layers 4] [--seq 256] [--batch 4]

Both sides run the same Llama shape (the DTensor side is Hugging Face's LlamaForCausalLM with
ColwiseParallel on q/k/v/gate/up and RowwiseParallel on o/down, the TorchTitan plan), fp32 AdamW,
gloo on CPU with one thread per rank. Prints the median step time of each and the ratio.
Timings are never asserted in tests.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _median_step(step, iters: int) -> float:
    import torch.distributed as dist
    times = []
    for i in range(iters + 2):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _ours(w, shape: dict, iters: int) -> float:
    from parallel3d.models.config import ModelConfig
    from parallel3d.models.llama import Llama
    from parallel3d.data_parallel.grads import reduce_gradients
    from parallel3d.mesh import MeshSpec

    ctx = w.context(MeshSpec(tp=w.world_size))
    cfg = ModelConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_layers=shape["layers"],
                      num_heads=shape["heads"], num_kv_heads=shape["heads"], ffn_hidden_size=shape["ffn"],
                      kernels="torch")
    model = Llama(cfg, ctx)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1),
                           generator=torch.Generator().manual_seed(0))

    def step():
        opt.zero_grad()
        loss = model(tokens[:, :-1], torch.arange(shape["seq"]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        reduce_gradients(model.parameters(), ctx)
        opt.step()
    return _median_step(step, iters)


def _dtensor(w, shape: dict, iters: int) -> float:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (w.world_size,))
    cfg = transformers.LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                                   num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                                   num_key_value_heads=shape["heads"], intermediate_size=shape["ffn"])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    plan = {}
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))

    def step():
        opt.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        opt.step()
    return _median_step(step, iters)


def _worker(w, shape: dict, iters: int) -> dict:
    return {"parallel3d": _ours(w, shape, iters), "DTensor": _dtensor(w, shape, iters)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    from parallel3d.testing import WorldPool

    shape = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq, batch=args.batch,
                 vocab=args.vocab, ffn=args.hidden * 8 // 3 // 8 * 8)
    pool = WorldPool(backend="gloo")
    try:
        results = pool.run(args.tp, _worker, shape, args.iters, timeout=1800)
    finally:
        pool.close()
    ours = max(r["parallel3d"] for r in results)
    theirs = max(r["DTensor"] for r in results)
    print(f"TP={args.tp} Llama h={args.hidden} L={args.layers} seq={args.seq} batch={args.batch} (gloo CPU)")
    print(f"{'implementation':<14} {'step ms':>9} {'ratio':>7}")
    print(f"{'parallel3d':<14} {ours * 1e3:9.1f} {1.0:7.2f}")
    print(f"{'DTensor':<14} {theirs * 1e3:9.1f} {theirs / ours:7.2f}   (DTensor time / ours)")


if __name__ == "__main__":
    main()
