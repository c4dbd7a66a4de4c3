"""DeepSeek-V3 pieces: group-limited routing against transformers' gate, the sequence-wise balance loss against
the report's formula, config errors, the 671B preset (parameters, active parameters, FLOPs) and the meta-device
training step (MLA + DeepSeek MoE under tp/sp/cp/pp/ep/ZeRO-3 on a non-CPU device)."""
import math

import pytest
import torch

from ckpt_helpers import build_trainer, make_config
from parallel3d.models.config import ModelConfig
from parallel3d.expert_parallel.router import Router, sequence_balance_loss, sequence_balance_stats
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.training.config import ConfigError, load_config
from parallel3d.training.metrics import active_params, flops_per_token, total_params
from parallel3d.training.validate import resolve_and_validate
from test_deepseek_parity import DEEPSEEK


def test_group_limited_routing_matches_transformers_gate():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                                        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(0)
    hf = DeepseekV3TopkRouter(cfg)
    ours = Router(32, 16, 3, ParallelContext.single().tp, "sigmoid", True, num_groups=4, topk_groups=2,
                  scaling_factor=2.5)
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        hf.e_score_correction_bias.normal_(0, 0.3)
        ours.weight.copy_(hf.weight)
        ours.expert_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(64, 32)
    _, hf_w, hf_i = hf(x)
    r = ours(x)
    order_hf, order_ours = hf_i.sort(-1), r.indices.sort(-1)
    assert torch.equal(order_hf.values, order_ours.values)
    torch.testing.assert_close(hf_w.gather(1, order_hf.indices), r.weights.gather(1, order_ours.indices))
    # the group limit binds: without it some token picks an expert outside its best two groups
    free = Router(32, 16, 3, ParallelContext.single().tp, "sigmoid", True, scaling_factor=2.5)
    free.load_state_dict(ours.state_dict())
    free.weight.data.copy_(ours.weight)
    assert not torch.equal(free(x).indices.sort(-1).values, order_ours.values)


def test_sequence_balance_loss_is_the_reports_formula():
    """L = sum_i f_i P_i per sequence, f_i = E/(k T) * #tokens routed to i,
    P_i = mean over tokens of s_i / sum_j s_j."""
    torch.manual_seed(1)
    b, s, e, k = 3, 7, 6, 2
    scores = torch.rand(b * s, e)
    indices = torch.stack([torch.randperm(e)[:k] for _ in range(b * s)])
    probs = scores / scores.sum(-1, keepdim=True)
    got = sequence_balance_loss(sequence_balance_stats(probs, indices, b), s, k)
    for seq in range(b):
        rows = range(seq * s, (seq + 1) * s)
        expected = 0.0
        for i in range(e):
            f = e / (k * s) * sum(int(i in indices[t].tolist()) for t in rows)
            p = sum(float(probs[t, i]) for t in rows) / s
            expected += f * p
        assert math.isclose(float(got[seq]), expected, rel_tol=1e-6)
    uniform = sequence_balance_loss(torch.cat([torch.full((1, e), s / e), torch.full((1, e), s * k / e)], 1), s, k)
    assert math.isclose(float(uniform[0]), 1.0, rel_tol=1e-6)  # perfect balance gives 1


@pytest.mark.parametrize("override,message", [
    (["model.router_num_groups=3"], "router_num_groups=3 must be >= 1 and divide"),
    (["model.router_topk_groups=1", "model.moe_top_k=3"], "moe_top_k=3 exceeds the experts of the kept groups"),
    (["model.num_kv_heads=2"], "set model.num_kv_heads = model.num_heads"),
    (["model.kv_lora_rank=0"], "kv_lora_rank >= 1"),
    (["model.rope_scaling={rope_type: llama3, factor: 8}"], "must be YaRN"),
    (["model.attention_type=gqa"], "attention_type must be one of mha, mla"),
])
def test_bad_deepseek_config_is_one_clear_error(override, message):
    with pytest.raises(ConfigError, match=message):
        make_config([*DEEPSEEK, *override], 1)


def test_671b_preset_counts_active_parameters_and_mla_flops():
    cfg = resolve_and_validate(load_config("configs/deepseek_v3.yaml", [], ModelConfig), 2048)
    p, m = cfg.parallel, cfg.model
    assert (p.pp, p.ep, p.dp, p.tp, p.zero) == (16, 64, 128, 1, 1)
    assert m.mtp_depth == 1
    mtp_total, mtp_active = total_params(m), active_params(m)
    m.mtp_depth = 0
    assert round(total_params(m) / 1e9) == 671  # the report: 671B total, 37B activated
    assert 37e9 <= active_params(m) < 38e9
    # the report's 14B MTP module counts its own copies of the embedding and head (2 x 0.93B), shared here
    assert 13.4e9 < mtp_total - total_params(m) + 2 * 129280 * 7168 < 14e9  # 671B + 14B = the 685B published
    assert 0 < mtp_active - active_params(m) < mtp_total - total_params(m)
    n, s = 128, 4096
    mla = 7168 * 1536 + 1536 + 1536 * n * 192 + 7168 * 576 + 512 + 512 * n * 256 + n * 128 * 7168
    assert mla == 187_107_328
    matmul = active_params(m) - 129280 * 7168  # the embedding lookup is free; the head counts once
    assert flops_per_token(m, s) == 6.0 * matmul + 6.0 * 61 * n * (192 + 128) * s


def test_training_step_runs_off_the_cpu():
    """MLA + DeepSeek MoE + MTP on the meta device (the stand-in for CUDA: mixed devices and CPU tensors in a
    collective raise) for one rank of each pipeline stage of tp2 x cp2 x dp2 x pp2, SP, ep2, ZeRO-3."""
    layout = ["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.sp=true", "parallel.zero=3",
              "parallel.ep=2", "train.global_batch_size=8", "model.num_layers=4", "model.mtp_depth=1"]
    cfg = make_config([*DEEPSEEK, *layout], 16)
    spec = MeshSpec(tp=2, cp=2, dp=cfg.parallel.dp, pp=2, ep=2)
    for rank in (0, spec.world_size - 1):
        ctx = ParallelContext.simulated(spec, rank, "meta")
        out = build_trainer(cfg, ctx).train_step()
        assert not out["skipped"]
        ops = set(ctx.stats.summary())
        assert {("tp", "all_gather"), ("cp", "send"), ("ep", "all_to_all")} <= ops, ops


def test_mla_triton_kernels_match_torch():
    """The GPU path (Triton RoPE on a strided q slice and a one-head shared key, RMSNorm of latent widths,
    flash attention at head width 12 with v padded from 6, cross-entropy), forced under the interpreter, trains
    like the torch path (one dense MLA layer: the interpreter is slow)."""
    from parallel3d.models.moe import MoETransformer

    def train(kernels: str) -> list[float]:
        cfg = make_config([*DEEPSEEK, f"model.kernels={kernels}", "model.num_layers=1"], 1).model
        model = MoETransformer(cfg, ParallelContext.single())
        model.init_weights(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(2):
            tokens = torch.randint(0, cfg.vocab_size, (1, 9), generator=g)
            opt.zero_grad()
            loss = model(tokens[:, :-1], torch.arange(8), tokens[:, 1:]) / tokens[:, 1:].numel()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    for a, b in zip(train("triton"), train("torch")):
        assert abs(a - b) <= 1e-4 * abs(b)


def test_planner_dry_runs_a_deepseek_layout():
    """launch/plan.py's estimate on MLA + DeepSeek MoE (one rank per pipeline stage on the meta stand-in)."""
    from parallel3d.planner.estimate import plan
    from parallel3d.planner.hardware import gpu
    from test_planner import _stage_builder

    cfg = make_config([*DEEPSEEK, "parallel.tp=2", "parallel.sp=true", "parallel.cp=2", "parallel.pp=2",
                       "parallel.ep=2", "parallel.zero=1", "train.global_batch_size=8"], 16)
    result = plan(cfg, _stage_builder, gpu("h100"), 8)
    assert result.fits and result.step_time_s > 0 and 0 < result.mfu < 1
    assert [r["pp_rank"] for r in result.roles] == [0, 1]
    assert {"ep.all_to_all", "cp.send", "tp.all_gather"} <= set(result.comm_bytes), result.comm_bytes


def test_multi_token_prediction_loss_is_the_reports_formula():
    """With labels and gradients, the model's loss = main loss + lambda/D * sum_k CE(head(norm_k(h^k)),
    t_{i+k+1}), h^k = Block_k(W_k [enorm(Emb(t_{i+k})); hnorm(h^{k-1})]), written out here with plain ops."""
    import torch.nn.functional as F

    from parallel3d.models.moe import MoETransformer

    cfg = make_config([*DEEPSEEK, "model.mtp_depth=2", "model.mtp_loss_coef=0.4", "model.seq_aux_loss_coef=0"], 1).model
    model = MoETransformer(cfg, ParallelContext.single())
    model.init_weights(7)
    tokens = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(2))
    ids, labels, pos = tokens[:, :-1], tokens[:, 1:], torch.arange(12)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    with torch.no_grad():
        main = model(ids, pos, labels)  # no grad: the MTP modules are skipped
    hidden, cos, sin = model.trunk(ids, pos)
    expected = main.clone()
    for k, module in enumerate(model.mtp, start=1):
        future = tokens[:, k:k + 12]  # t_{i+k}, ids past the window are never seen causally by earlier targets
        future = torch.cat([future, future.new_zeros(2, 12 - future.shape[1])], 1)
        emb = F.embedding(future, model.embed.weight)
        x = F.linear(torch.cat([rms(emb, module.enorm.weight), rms(hidden, module.hnorm.weight)], -1),
                     module.eh_proj.weight)
        hidden = module.block(x, cos, sin, pos)
        logits = F.linear(rms(hidden, module.norm.weight), model.lm_head.weight)  # (b, s, V)
        target = torch.full((2, 12), -100)
        target[:, :12 - k] = tokens[:, k + 1:]
        expected = expected + 0.4 / 2 * F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
    got = model(ids, pos, labels)
    assert abs(got.item() - expected.item()) <= 1e-5 * expected.item()
    assert got.item() - main.item() > 1.0  # the MTP terms are there


def test_mla_with_packed_documents_equals_each_document_alone():
    """Document-masked MLA (+ DeepSeek MoE) over packed windows == every document run alone."""
    from parallel3d.models.moe import MoETransformer
    from parallel3d.context_parallel.documents import Documents, document_ids, document_positions
    from parity import enlarge_weights
    from doc_helpers import per_document_loss_sum
    from test_documents import EDGE_WINDOWS, EOS

    cfg = make_config([*DEEPSEEK, "model.vocab_size=64", "model.num_layers=2"], 1).model
    torch.manual_seed(7)
    model = enlarge_weights(MoETransformer(cfg, ParallelContext.single()))
    windows = torch.tensor(list(EDGE_WINDOWS.values()))  # (4, 17)
    ids, labels = windows[:, :-1], windows[:, 1:]
    doc = document_ids(ids, EOS)
    with torch.no_grad():
        got = float(model(ids, document_positions(doc), labels, documents=Documents.from_host(doc)))
        plain = float(model(ids, torch.arange(16), labels))
    want, _ = per_document_loss_sum(model, windows, EOS)
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert abs(plain - want) > 1e-3 * abs(want)  # crossing documents matters (100x the tolerance)
