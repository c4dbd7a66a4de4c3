"""FLOPs / active-parameter counting, peak tables, the jsonl metrics logger, and the LR schedule."""
from __future__ import annotations

import json
import math

import pytest

from parallel3d.models.config import ModelConfig
from parallel3d.training.config import TrainConfig
from parallel3d.training.lr_schedule import lr_at
from parallel3d.training.metrics import (MetricsLogger, active_params, flops_per_token, lookup_peak_flops,
                                         peak_memory_bytes, resolve_peak_flops, total_params)


def test_dense_flops_by_hand():
    m = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=172)
    # head_dim 16; per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288, SwiGLU 3*64*172 = 33024,
    # two norms 128; plus final norm 64, embedding 256*64 and untied head 256*64.
    total = 2 * 16384 + 2 * (12288 + 33024 + 128) + 64
    assert total == 123712
    assert total_params(m) == active_params(m) == total
    # FLOPs exclude the embedding lookup, keep the head: 6 * 107328 + 12 * 2 * 64 * 128
    assert flops_per_token(m, 128) == 6 * (total - 16384) + 12 * 2 * 64 * 128 == 840576


def test_moe_active_params_by_hand():
    m = ModelConfig(vocab_size=100, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=4,
                    ffn_hidden_size=64, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=16,
                    num_shared_experts=1, first_k_dense=1, tie_embeddings=True)
    emb, attn, dense = 100 * 32, 3 * 4 * 32 * 32, 3 * 32 * 64       # layer 0 keeps a dense MLP
    expert, router, norms = 3 * 32 * 16, 8 * 32, 7 * 32
    assert total_params(m) == emb + attn + dense + 2 * (8 * expert + expert + router) + norms == 50016
    assert active_params(m) == emb + attn + dense + 2 * (2 * expert + expert + router) + norms == 31584
    # tied embeddings: the table is still used once as the output matmul
    assert flops_per_token(m, 16) == 6 * 31584 + 12 * 3 * 32 * 16


def test_peak_lookup_prefers_the_specific_name():
    """Device names contain each other (\"GH200\" contains \"H200\", \"H100 PCIe\" contains \"H100\"): the
    specific entry must win, and an unknown device must not borrow some other table row."""
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12      # H100 SXM dense bf16 peak
    assert lookup_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert lookup_peak_flops("NVIDIA GH200 480GB", "fp32") == 67e12
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert lookup_peak_flops("Some Unknown GPU", "bf16") is None
    assert resolve_peak_flops("bf16", override=123.0) == 123.0


def test_peak_memory_sees_a_large_allocation():
    """On the CPU the reported peak is the process's max resident set: with 256 MiB touched, it is at least
    what the process holds now, block included. (Not "what it held before plus the block": the block may
    reuse freed pages the allocator kept resident, parallel3d/host_memory.py, as it did after other tests
    in one pytest-xdist worker.)"""
    import os
    import torch
    block = torch.ones(64 << 20)  # 256 MiB, every page written
    resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert resident >= block.numel() * 4
    assert peak_memory_bytes("cpu") >= 0.99 * resident   # the kernel's RSS counters lag by a few pages


def test_logger_writes_every_field(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    lines: list[str] = []
    with MetricsLogger(str(path), flops_per_token=1e6, world_size=2, peak_flops=1e9,
                       printer=lines.append, print_interval=2) as log:
        rec = log.log(1, loss=2.5, grad_norm=0.7, lr=1e-3, tokens=1000, elapsed_s=2.0,
                      extra={"loss_scale": 1.0})
        log.log(2, loss=2.25, grad_norm=0.5, lr=1e-3, tokens=1000, elapsed_s=2.0)
    assert rec["tokens_per_s"] == 500.0 and rec["mfu"] == pytest.approx(500 * 1e6 / 2e9)
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_bytes"):
        assert key in records[0] and key in records[1]
    assert records[0]["loss_scale"] == 1.0 and records[0]["peak_mem_bytes"] > 0
    assert len(lines) == 1 and "step      2" in lines[0] and "loss 2.2500" in lines[0]


def test_logger_non_rank0_is_silent(tmp_path):
    path = tmp_path / "m.jsonl"
    lines: list[str] = []
    log = MetricsLogger(str(path), flops_per_token=1.0, peak_flops=1.0, is_rank0=False, printer=lines.append)
    assert log.log(0, loss=1.0, grad_norm=1.0, lr=0.1, tokens=1, elapsed_s=1.0)["step"] == 0
    log.close()
    assert not path.exists() and lines == []


def test_lr_warmup_peak_cosine_end():
    c = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, steps=110)
    assert lr_at(0, c) == pytest.approx(1e-4)                # (0+1)/10 of the peak
    assert lr_at(4, c) == pytest.approx(5e-4)
    assert lr_at(9, c) == pytest.approx(1e-3)                # warmup ends at the peak
    assert lr_at(10, c) == pytest.approx(1e-3)               # decay starts from the peak
    assert lr_at(60, c) == pytest.approx(1e-4 + 0.5 * 9e-4)  # cosine midpoint
    assert lr_at(35, c) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.25)))
    assert lr_at(110, c) == pytest.approx(1e-4) and lr_at(500, c) == pytest.approx(1e-4)
    lrs = [lr_at(s, c) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_lr_variants():
    lin = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=0, steps=10, lr_schedule="linear")
    assert [lr_at(s, lin) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    const = TrainConfig(lr=2.0, min_lr=0.0, warmup_steps=2, steps=10, lr_schedule="constant")
    assert [lr_at(s, const) for s in (0, 1, 9)] == pytest.approx([1.0, 2.0, 2.0])
    decay = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=0, steps=100, lr_decay_steps=10)
    assert lr_at(10, decay) == pytest.approx(0.0) and lr_at(50, decay) == pytest.approx(0.0)
