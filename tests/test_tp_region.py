"""The fused entry into the TP region (tensor_parallel/region.py): under sequence parallelism the column-
parallel GEMMs keep the (b, s/tp, h) shard, so the activations of a layer scale as 1/tp (issue 27 item 1);
without it the TP collectives reduce fresh tensors in place, with no copies (issue 30 item 3). Parity of the
layouts with world size 1 through the Trainer is tests/test_tp_parity.py, test_moe_parity.py and
test_deepseek_parity.py, which run these paths."""
from __future__ import annotations

import sys

import pytest
import torch

from ckpt_helpers import make_config
from parallel3d.kernels.rope import rope_cos_sin, rope_inv_freq
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Block
from parallel3d.params import init_parameters
from parallel3d.planner.dryrun import run_role
from parallel3d.planner.hardware import gpu
from test_planner import _stage_builder

H100 = gpu("h100")
B, S, H, FFN = 1, 256, 256, 512
DENSE = [f"model.hidden_size={H}", "model.num_heads=8", "model.num_kv_heads=8", f"model.ffn_hidden_size={FFN}",
         "model.vocab_size=512", f"train.seq_len={S}", f"model.max_seq_len={S}", f"train.global_batch_size={B}",
         "train.precision=bf16"]
E, TOP_K = 4, 2
MOE = [f"model.num_experts={E}", f"model.moe_top_k={TOP_K}", "model.moe_ffn_hidden_size=256"]


MLA = ["model.attention_type=mla", "model.q_lora_rank=96", "model.kv_lora_rank=64", "model.qk_nope_head_dim=32",
       "model.qk_rope_head_dim=16", "model.v_head_dim=32"]


def _layer_activations(tp: int, moe: bool, recompute: str, extra: tuple = ()) -> float:
    """Activation bytes per layer at the step's peak (transients included), from the dry run: the
    difference between 8 and 4 layers over 4, which leaves out the embedding, the head and the loss."""
    def act(layers: int) -> int:
        cfg = make_config([*DENSE, *(MOE if moe else []), *extra, f"parallel.tp={tp}", f"parallel.sp={tp > 1}".lower(),
                           f"model.num_layers={layers}", f"train.activation_checkpointing={recompute}"], tp)
        return run_role(cfg, 0, _stage_builder, H100, 8).memory["activations"]
    return (act(8) - act(4)) / 4


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_dense_layer_activations_scale_as_one_over_tp(recompute):
    """Korthikanti et al.: with TP and SP every activation of a layer is split t ways. Before the fused
    entry the q/k/v and gate/up GEMMs kept the all-gathered (b, s, h) input: 1.10x (tp=2), 1.30x (tp=4)."""
    one = _layer_activations(1, False, recompute)
    for tp in (2, 4):
        ratio = _layer_activations(tp, False, recompute) * tp / one
        assert ratio <= 1.2, f"tp={tp}: activations per layer {ratio:.2f} x 1/tp of tp=1"


def test_mla_layer_activations_scale_as_one_over_tp():
    """Multi-latent attention: q's projection keeps its (b, s/tp, .) input (the latent c_q, or x); the
    kv latent is gathered once and kept whole, as the core needs it (models/mla.py). Before: 1.24x at tp=4."""
    one = _layer_activations(1, False, "selective", tuple(MLA))
    ratio = _layer_activations(4, False, "selective", tuple(MLA)) * 4 / one
    assert ratio <= 1.2, f"tp=4: MLA activations per layer {ratio:.2f} x 1/tp of tp=1"


SHARED_CAPACITY = ("model.num_shared_experts=1", "model.capacity_factor=1.25")


FOLDS = {  # the experts' layout at each tp: whole experts with EP folded over the TP ranks, or split like the MLP
    "etp1-ep=tp": lambda tp: ("parallel.etp=1", f"parallel.ep={tp}"),
    "etp=tp": lambda tp: (f"parallel.etp={tp}",),
}


# CI runs each recompute mode and each expert set once at etp=1; make sweep the other pairs and etp=tp
@pytest.mark.parametrize("recompute, extra, fold", [
    pytest.param("none", (), "etp1-ep=tp", id="none-routed-etp1"),
    pytest.param("selective", SHARED_CAPACITY, "etp1-ep=tp", id="selective-shared-capacity-etp1"),
    pytest.param("none", (), "etp=tp", id="none-routed-etp=tp", marks=pytest.mark.sweep),
    pytest.param("none", SHARED_CAPACITY, "etp1-ep=tp", id="none-shared-capacity-etp1", marks=pytest.mark.sweep),
    pytest.param("selective", (), "etp1-ep=tp", id="selective-routed-etp1", marks=pytest.mark.sweep),
    pytest.param("selective", SHARED_CAPACITY, "etp=tp", id="selective-shared-capacity-etp=tp",
                 marks=pytest.mark.sweep)])
def test_moe_layer_activations_scale_as_one_over_tp(recompute, extra, fold):
    """The whole MoE layer under SP keeps 1/tp of its activations: the router and shared experts keep the
    shard (sp_entry.py, column_entry), and each TP rank dispatches only its own tokens, its expert gate/up
    keep only the rows it received and the combine only its tokens' slots (sp_dispatch.py).

    etp=1, ep=tp (parallel folding: whole experts, EP over the TP ranks; no expert rows cross TP): 1.003x
    (tp=2) and 1.005x (tp=4), with a shared expert and capacity too. etp=tp (experts split like the MLP, rows
    gathered over TP): 1.00x and 1.01x. Before the SP dispatcher every TP rank ran its ffn slice of every expert
    on all T tokens and kept the dispatched rows, the expert outputs and their fp32 copy whole (T*k*h*(2+2+4)
    bytes): 1.28x (tp=2) and 1.84x (tp=4). etp=1 with ep=1 (every TP rank holding all E experts whole, tp times
    the expert weights of either layout above) measures 1.64x / 3.28x: what grows there follows the experts held
    per rank, not the tokens (1.2 MB a layer more than etp=1 ep=2 at tp=2, whose missing two experts are 0.8 MB
    of bf16 weights), so folding EP over TP is what keeps the layer at 1/tp; validation warns about that layout
    (expert_parallel/experts.experts_replicated_over_tp, tests/test_config.py)."""
    one = _layer_activations(1, True, recompute, extra)
    for tp in (2, 4):
        ratio = _layer_activations(tp, True, recompute, (*extra, *FOLDS[fold](tp))) * tp / one
        assert ratio <= 1.2, f"tp={tp} {fold}: MoE layer activations {ratio:.2f} x 1/tp of tp=1"


def _order_of_collectives(w):
    ctx = w.context(MeshSpec(tp=w.world_size))
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=48)
    block = Block(cfg, ctx, True, "ring", "none")
    init_parameters(block, 0)
    x = torch.randn(2, 8 // w.world_size, 32, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(8), rope_inv_freq(cfg.attn_head_dim, cfg.rope_theta))
    y = block(x, cos, sin)
    ops = []
    ctx.stats.listener = lambda group, op, nbytes: ops.append((op, nbytes))
    y.square().sum().backward()
    ctx.stats.listener = None
    return ops


def test_backward_gathers_the_shard_again_before_reducing_the_input_gradient(worlds):
    """Per region in backward: the sequence all-gather of the saved shard is started first (so that on NCCL
    it runs under the dX GEMMs), then dX is reduce-scattered; the row-parallel exit's backward all-gathers
    the output gradient before that. MLP first, then attention: 3 collectives of b*s*h each per region."""
    bsh = 2 * 8 * 32 * 4
    for ops in worlds.run(2, _order_of_collectives):
        region = [("all_gather", bsh), ("all_gather", bsh), ("reduce_scatter", bsh)]
        assert ops == region + region


class _Births(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the storages born while a TP mapping or a collective is on the Python stack."""

    def __init__(self, files):
        super().__init__()
        self.files, self.count = files, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ not in ("detach", "view", "_unsafe_view", "alias", "t", "transpose"):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename not in self.files:
                frame = frame.f_back
            self.count += frame is not None and isinstance(out, torch.Tensor)
        return out


def test_tp_block_without_sp_copies_nothing_to_communicate():
    """Megatron's TP block without SP moves its activations with in-place all-reduces: the row-parallel
    output (forward) and the input gradient (backward) are fresh, so nothing is allocated to reduce them.
    Counted in the dry run (meta device, simulated collectives) of one block at tp=2. The old mappings
    cloned before each of the 4 all-reduces."""
    import parallel3d.comm as comm
    import parallel3d.tensor_parallel.mappings as mappings

    ctx = ParallelContext.simulated(MeshSpec(tp=2), 0, "meta")
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4, ffn_hidden_size=96)
    with torch.device("meta"):
        block = Block(cfg, ctx, False, "ring", "none")
    x = torch.empty(2, 16, 64, device="meta", requires_grad=True)
    cos, sin = (t.to("meta") for t in rope_cos_sin(torch.arange(16), rope_inv_freq(16, cfg.rope_theta)))
    births = _Births({comm.collectives.__file__, comm.p2p.__file__, mappings.__file__})
    ctx.stats.reset()
    with births:
        y = block(x, cos, sin)
        y.backward(torch.empty_like(y))
    assert ctx.stats.summary() == {("tp", "all_reduce"): (4, 4 * 2 * 16 * 64 * 4)}
    assert births.count == 0
