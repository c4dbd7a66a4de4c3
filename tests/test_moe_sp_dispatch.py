"""The MoE layer under sequence parallelism (expert_parallel/sp_dispatch.py): each TP rank dispatches only its
own tokens; with etp == tp the experts gather the rows of all TP ranks and reduce-scatter their outputs back,
with etp = 1 (whole experts, EP folded over TP) nothing but the routing crosses TP. Units of the
grouped projections it runs, and the layer against world size 1 when TP ranks receive different numbers of
rows (one of them none), with the TP bytes it moves. Training parity: tests/test_moe_parity.py (tp2-sp...),
the Trainer paths: test_deepseek_parity.py, test_recompute_layers.py, test_trainer_regressions.py."""
import pytest
import torch

from parallel3d import comm
from parallel3d.expert_parallel import MoELayer
from parallel3d.expert_parallel.experts import grouped_linear, grouped_weight_grad
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.params import init_parameters

IMPLS = ["loop", "grouped_mm", pytest.param("triton", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 0, 0, 16], [0, 0, 0, 0]])
def test_grouped_projections_match_per_expert_products(impl, counts):
    if impl == "triton" and not torch.cuda.is_available():
        pytest.skip("the Triton grouped GEMM needs CUDA here")
    device = "cuda" if impl == "triton" else "cpu"
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), 16, generator=gen).to(device)
    w = torch.randn(len(counts), 8, 16, generator=gen).to(device)  # (E_local, out, in)
    dy = torch.randn(sum(counts), 8, generator=gen).to(device)
    rows = list(zip(x.split(counts), dy.split(counts)))
    want_y = torch.cat([xe @ we.t() for (xe, _), we in zip(rows, w)])  # (N, out)
    want_dx = torch.cat([dye @ we for (_, dye), we in zip(rows, w)])  # (N, in)
    want_dw = torch.stack([dye.t() @ xe for xe, dye in rows])  # (E_local, out, in)
    torch.testing.assert_close(grouped_linear(impl, x, counts, w), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped_linear(impl, dy, counts, w, transposed=True), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped_weight_grad(impl, dy, x, counts), want_dw, rtol=1e-5, atol=1e-5)


def _layer(ctx, sp, impl, shared):
    layer = MoELayer(16, 24, 4, 2, ctx, sequence_parallel=sp, shared_ffn_hidden=shared, capacity_factor=1.0,
                     impl=impl)
    init_parameters(layer, 0, 0.3)  # the same global weights at every layout (seeded by name and slice)
    with torch.no_grad():  # every token picks experts 0 and 1; capacity 4 a sequence keeps positions 0-3 only
        layer.router.expert_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
    return layer


def _skewed_sp(w, impl, shared):
    """tp=2, sp: TP rank 0 holds positions 0-3 of each sequence (all its slots kept), rank 1 positions 4-7
    (all dropped), so rank 1 sends, receives and gathers no rows, and experts 2 and 3 get none anywhere."""
    ctx = w.context(MeshSpec(tp=2, etp=2))
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    mine = slice(4 * w.rank, 4 * w.rank + 4)
    out = []
    for layer, inp in ((_layer(ctx, True, impl, shared), x[:, mine]), (_layer(ParallelContext.single(), False,
                                                                               impl, shared), x)):
        inp = inp.clone().requires_grad_()
        ctx.stats.reset()
        y = layer(inp)
        forward = ctx.stats.summary()
        y.square().sum().backward()
        router = comm.all_reduce(layer.router.weight.grad.clone(), ctx.tp) if layer.sp else layer.router.weight.grad
        f = slice(None) if layer.sp else slice(12 * w.rank, 12 * w.rank + 12)  # this rank's ffn slice
        s = slice(None) if layer.sp else mine  # this rank's positions
        out.append(dict(y=y[:, s], dx=inp.grad[:, s], router=router, gate=layer.experts.gate_proj.grad[:, f],
                        down=layer.experts.down_proj.grad[..., f], forward=forward))
    return out


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("shared", [0, 16], ids=["routed", "shared"])
def test_sp_layer_matches_world_size_1_with_uneven_rows_over_tp(worlds, impl, shared):
    for rank, (sp, ref) in enumerate(worlds.run(2, _skewed_sp, impl, shared)):
        for name in ("y", "dx", "router", "gate", "down"):
            torch.testing.assert_close(sp[name], ref[name], rtol=1e-5, atol=2e-5, msg=f"rank {rank}: {name}")
        assert ref["gate"][:2].abs().sum() > 0 and ref["gate"][2:].abs().sum() == 0  # experts 2, 3 idle
        # forward over TP: the routing gathers (logits+scores fp32 (b, s, 2E), experts int64 (b, s, k)), the
        # TP ranks' split counts (tp, E) int64, then the rows: rank 0's 2 x 4 x 2 slots (rank 1 has none)
        # padded to 16 on each of 2 ranks, (2 * 16, h) fp32; and their reduce-scatter. Shared experts: their
        # own gather and reduce-scatter of the (b, s, h) tokens.
        rows, tokens = 2 * 16 * 16 * 4, 2 * 8 * 16 * 4
        gathers = [2 * 8 * 8 * 4, 2 * 8 * 2 * 8, 2 * 4 * 8, rows] + ([tokens] if shared else [])
        scatters = [rows] + ([tokens] if shared else [])
        assert sp["forward"] == {("tp", "all_gather"): (len(gathers), sum(gathers)),
                                 ("tp", "reduce_scatter"): (len(scatters), sum(scatters))}


def _folded_sp(w, shared):
    """tp=2 sp, etp=1 ep=2: EP folded over the TP ranks, each holding two whole experts (module docstring)."""
    ctx = w.context(MeshSpec(tp=2, ep=2))
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    mine, experts = slice(4 * w.rank, 4 * w.rank + 4), slice(2 * w.rank, 2 * w.rank + 2)
    out = []
    for layer, inp in ((_layer(ctx, True, "loop", shared), x[:, mine]),
                       (_layer(ParallelContext.single(), False, "loop", shared), x)):
        with torch.no_grad():  # route to every expert (the skewed bias of _layer would idle EP rank 1)
            layer.router.expert_bias.zero_()
        inp = inp.clone().requires_grad_()
        ctx.stats.reset()
        y = layer(inp)
        forward = ctx.stats.summary()
        y.square().sum().backward()
        router = comm.all_reduce(layer.router.weight.grad.clone(), ctx.tp) if layer.sp else layer.router.weight.grad
        e = slice(None) if layer.sp else experts  # this rank's whole experts
        s = slice(None) if layer.sp else mine
        out.append(dict(y=y[:, s], dx=inp.grad[:, s], router=router, gate=layer.experts.gate_proj.grad[e],
                        down=layer.experts.down_proj.grad[e], forward=forward))
    return out


@pytest.mark.parametrize("shared", [0, 16], ids=["routed", "shared"])
def test_folded_etp1_layer_matches_world_size_1_without_tp_row_traffic(worlds, shared):
    for rank, (sp, ref) in enumerate(worlds.run(2, _folded_sp, shared)):
        for name in ("y", "dx", "router", "gate", "down"):
            torch.testing.assert_close(sp[name], ref[name], rtol=1e-5, atol=2e-5, msg=f"rank {rank}: {name}")
        assert ref["gate"].abs().sum() > 0
        # over TP only the routing gathers (logits+scores fp32 (b, s, 2E), experts int64 (b, s, k)) and the
        # shared experts' token gather and reduce-scatter: no expert rows cross TP; they cross EP (the same
        # ranks here: counts, then the rows there and back)
        tokens = 2 * 8 * 16 * 4
        gathers = [2 * 8 * 8 * 4, 2 * 8 * 2 * 8] + ([tokens] if shared else [])
        tp_ops = {k: v for k, v in sp["forward"].items() if k[0] == "tp"}
        assert tp_ops == {("tp", "all_gather"): (len(gathers), sum(gathers)),
                          **({("tp", "reduce_scatter"): (1, tokens)} if shared else {})}
        assert sp["forward"][("ep", "all_to_all")][0] == 3
