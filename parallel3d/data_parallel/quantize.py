"""Block-wise int8 quantisation for ZeRO++ communication (qwZ weights, qgZ gradients).

A flat tensor is cut into blocks of `block` values; each block travels as `block` int8 values plus one
scale (fp32, or bf16 when the weights are bf16):

    scale = max|x| / 127        q = round(x / scale) in [-127, 127]        x' = q * scale

so the error of each value is at most scale / 2 (half a quantisation step of its block). Rows are padded
to a whole number of blocks with zeros; the padding is dropped after dequantisation.

    quantized_all_gather      qwZ: every rank's shard, gathered as int8 + scales, dequantised
    quantized_reduce_scatter  qgZ: the all-to-all form of reduce-scatter: rank k receives every rank's
                              quantised copy of segment k and sums the dequantised copies in fp32
Bytes on the wire per value: 1 + scale_bytes / block (vs 2 for bf16, 4 for fp32).
"""
from __future__ import annotations

import torch

from parallel3d import comm
from parallel3d.comm import Group

QMAX = 127.0


def check_zeropp(zero: int, quantized_weights: bool, hpz: bool, quantized_gradients: bool, block: int) -> None:
    """ZeRO++ keys: they change ZeRO-3's parameter gathers and gradient reduce-scatters."""
    on = [k for k, v in (("zero_quantized_weights", quantized_weights), ("zero_hpz", hpz),
                         ("zero_quantized_gradients", quantized_gradients)) if v]
    if on and zero != 3:
        raise ValueError(f"parallel.{on[0]} is a ZeRO++ option of ZeRO-3; set parallel.zero=3 (got zero={zero})")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"parallel.quant_block must be a positive integer, got {block!r}")


def padded(n: int, block: int) -> int:
    return -(-n // block) * block


def quantize(x: torch.Tensor, block: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, n) with n % block == 0 -> (int8 (rows, n), scales (rows, n / block))."""
    rows, n = x.shape
    blocks = x.float().view(rows, n // block, block)                      # (rows, nb, block)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / QMAX                # (rows, nb, 1)
    scale = scale.to(scale_dtype).float()  # quantise with the scale the receiver will see
    q = (blocks / scale.clamp_min(torch.finfo(torch.float32).tiny)).round_().clamp_(-QMAX, QMAX)
    return q.to(torch.int8).view(rows, n), scale.view(rows, n // block).to(scale_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """(int8 (rows, n), scales (rows, n / block)) -> fp32 (rows, n)."""
    rows, n = q.shape
    return (q.float().view(rows, n // block, block) * scale.float().unsqueeze(-1)).view(rows, n)


def _pad_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (rows, n) -> (rows, width) with zero padding on the right."""
    if x.shape[1] == width:
        return x
    out = torch.zeros((x.shape[0], width), dtype=x.dtype, device=x.device)
    out[:, : x.shape[1]] = x
    return out


def quantized_all_gather(out: torch.Tensor, shard: torch.Tensor, group: Group, block: int,
                         scale_dtype: torch.dtype) -> None:
    """out (size * n,) <- every rank's shard (n,), moved as int8 blocks + scales and dequantised."""
    n = shard.numel()
    width = padded(n, block)
    q, scale = quantize(_pad_rows(shard.view(1, n), width), block, scale_dtype)   # (1, w), (1, w/block)
    all_q = comm.all_gather(q.view(-1), group).view(group.size, width)            # (size, w) int8
    all_scale = comm.all_gather(scale.view(-1), group).view(group.size, width // block)
    out.view(group.size, n).copy_(dequantize(all_q, all_scale, block)[:, :n])


def quantized_reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: Group, block: int) -> None:
    """out (n,) <- this rank's n-element block of the sum over ranks of full (size * n,), exchanged with
    one all-to-all of int8 blocks + fp32 scales; the dequantised copies are summed in fp32."""
    size, n = group.size, out.numel()
    width = padded(n, block)
    q, scale = quantize(_pad_rows(full.view(size, n), width), block, torch.float32)  # row k: segment k
    got_q = comm.all_to_all(q, group)                        # (size, w): every rank's copy of my segment
    got_scale = comm.all_to_all(scale, group)                # (size, w / block)
    out.copy_(dequantize(got_q, got_scale, block).sum(dim=0)[:n])
