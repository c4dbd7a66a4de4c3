"""train.fp8's fused casts (kernels/fp8_cast.py) against their torch twin, under TRITON_INTERPRET=1 on CPU.

Exactness: the fp8 bytes and the fp32 inverse scales equal the twin's bit for bit (same fp32 scale formula,
round-to-nearest-even conversion), for both fp8 formats, fp32 and bf16 inputs, odd and strided shapes, the
one-tile and the looped path, and values that reach fp8's subnormals and round up into the next binade."""
from __future__ import annotations

import pytest
import torch

from parallel3d.kernels import dispatch
from parallel3d.kernels import fp8_cast as fc
from parallel3d.kernels import fp8_cast_ops
from test_kernel_ops import OpNames

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _values(shape, dtype, seed=0):
    """Normal values times 10^u, u uniform in [-5, 2]: after scaling, many fall into fp8's subnormals or
    round up across a power of two (the interpreter's own conversion gets that carry wrong)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * 10 ** (7 * torch.rand(shape, generator=g) - 5)
    return t.to(dtype).to(DEVICE)


def _same(got, want):
    (g8, ginv), (w8, winv) = got, want
    assert g8.dtype == w8.dtype and g8.shape == w8.shape and ginv.shape == winv.shape
    assert torch.equal(g8.view(torch.uint8), w8.view(torch.uint8)), \
        f"{(g8.view(torch.uint8) != w8.view(torch.uint8)).sum().item()} bytes differ"
    assert torch.equal(ginv, winv)


SHAPES = [(1, 7), (33, 96), (5, 300), (67, 17), (2, 5000)]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_tensorwise_bytes_equal_the_twin(fp8, src, shape):
    t = _values(shape, src)
    amax = fc.amax_tensor(t)
    assert torch.equal(amax, fc.amax_reference(t, None))
    _same(fc.scale_cast(t, amax, fp8), fc.cast_reference(t, fp8))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("axis", [1, 0])
def test_axiswise_bytes_equal_the_twin(fp8, src, shape, axis):
    """Fused one pass (one tile, and looped with a small block), and the amax pass + given-amax cast."""
    t = _values(shape, src, seed=1)
    want = fc.cast_reference(t, fp8, axis)
    # blocks smaller than the reduced dimension: the looped path, 2-10 blocks a program (a column block is 64
    # lanes wide, so 256 elements is 4 rows: 1-row blocks looped 17 times made these the file's slowest tests)
    loop = (16 if axis == 1 else 256) if max(shape) < 1000 else 1024
    for block in (fc.TILE, loop):
        _same(fc.cast_axis(t, axis, fp8, max_block=block), want)
    amax = fc.amax_axis(t, axis, max_block=loop)
    assert torch.equal(amax, fc.amax_reference(t, axis))
    _same(fc.cast_axis(t, axis, fp8, amax=amax, max_block=loop), want)


@pytest.mark.parametrize("axis", [None, 1, 0])
def test_column_major_output(axis):
    """col_major: the same bytes written transposed (the layout the GEMM takes its second operand in)."""
    t = _values((37, 20), torch.bfloat16, seed=6)
    for backend in ("torch", "triton"):
        got = dispatch.fp8_cast(t, torch.float8_e4m3fn, axis, backend=backend, col_major=True)
        assert got[0].stride() == (1, 37)
        _same(got, fc.cast_reference(t, torch.float8_e4m3fn, axis))
    amax = fc.amax_axis(t, 0, max_block=16)
    got = fc.cast_axis(t, 0, torch.float8_e5m2, amax=amax, max_block=16, col_major=True)  # split, given amax
    assert got[0].stride() == (1, 37)
    _same(got, fc.cast_reference(t, torch.float8_e5m2, 0))


@pytest.mark.parametrize("axis", [None, 1, 0])
def test_strided_input_and_saturation(axis):
    """A transposed (column-major) view, and a reduced amax below the tensor's own: values saturate to
    +-fp8_max exactly as the twin's clamp."""
    t = _values((48, 40), torch.bfloat16, seed=2).t()  # (40, 48), strides (1, 40)
    _same(dispatch.fp8_cast(t, torch.float8_e4m3fn, axis, backend="triton"),
          fc.cast_reference(t, torch.float8_e4m3fn, axis))
    half = lambda a: a * 0.5  # noqa: E731
    got = dispatch.fp8_cast(t, torch.float8_e5m2, axis, half, backend="triton")
    _same(got, fc.cast_reference(t, torch.float8_e5m2, axis, half))
    assert got[0].float().abs().max() == torch.finfo(torch.float8_e5m2).max


def test_dispatch_backends_and_the_reduction_between_the_passes():
    t = _values((9, 24), torch.bfloat16, seed=3)
    seen = []

    def reduce(a):  # a stand-in for the TP MAX all-reduce: sees the amax, returns the reduced one
        seen.append(tuple(a.shape))
        return a * 2
    for backend in ("torch", "triton"):
        for axis in (None, 1, 0):
            _same(dispatch.fp8_cast(t, torch.float8_e4m3fn, axis, reduce, backend=backend),
                  fc.cast_reference(t, torch.float8_e4m3fn, axis, lambda a: a * 2))
    assert seen == [(), (9, 1), (1, 24)] * 2


def test_meta_runs_the_custom_ops():
    """The planner's stand-in: shapes and dtypes from the fake implementations, nothing runs."""
    t = torch.empty(6, 40, dtype=torch.bfloat16, device="meta")
    for axis, shape in ((None, ()), (1, (6, 1)), (0, (1, 40))):
        t8, inv = dispatch.fp8_cast(t, torch.float8_e5m2, axis)
        assert (t8.shape, t8.dtype, t8.device.type) == ((6, 40), torch.float8_e5m2, "meta")
        assert (tuple(inv.shape), inv.dtype) == (shape, torch.float32)
    t8, _ = dispatch.fp8_cast(t, torch.float8_e4m3fn, 1, lambda a: a)
    assert t8.is_meta


def test_eager_casts_skip_the_custom_op_layer_and_watchers_see_the_ops(monkeypatch):
    """An eager cast with nothing watching runs the launchers (kernels._triton_utils.direct), never the custom
    ops; under a dispatch mode the custom ops run, with the same bytes."""
    t = _values((9, 24), torch.bfloat16, seed=7)
    amax = fc.amax_reference(t, 1)
    calls = [lambda axis=axis, reduce=reduce: dispatch.fp8_cast(t, torch.float8_e4m3fn, axis, reduce, "triton")
             for axis in (None, 1, 0) for reduce in (None, lambda a: a * 2)]
    calls.append(lambda: dispatch.fp8_scale_cast(t, amax, torch.float8_e5m2, 1, "triton"))
    with monkeypatch.context() as patch:
        for op in ("fp8_amax", "fp8_scale_cast", "fp8_cast_axis"):
            patch.setattr(fp8_cast_ops, op, lambda *a, **k: pytest.fail("an eager cast went through a custom op"))
        eager = [call() for call in calls]
    watcher = OpNames()
    with watcher:
        watched = [call() for call in calls]
    assert {f"parallel3d::fp8_{n}" for n in ("amax", "scale_cast", "cast_axis")} <= watcher.names
    for got, want in zip(eager, watched):
        _same(got, want)


@pytest.mark.parametrize("name", ["fp8_amax", "fp8_scale_cast", "fp8_cast_axis", "fp8_cast_axis_col"])
def test_opcheck(name):
    t = _values((5, 40), torch.bfloat16, seed=4)
    args = {"fp8_amax": (t, 0), "fp8_scale_cast": (t, fc.amax_tensor(t), None, torch.float8_e5m2, True),
            "fp8_cast_axis": (t, 1, torch.float8_e4m3fn), "fp8_cast_axis_col": (t, 0, torch.float8_e4m3fn, True)}[name]
    name = name.replace("_col", "")
    torch.library.opcheck(getattr(fp8_cast_ops, name), args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("axis", [None, 1, 0])
def test_the_cast_pass_alone_with_a_given_amax(axis):
    """dispatch.fp8_scale_cast (ZeRO-3's fp8 gathers cast shards with the amax reduced over the shard group)."""
    t = _values((10, 24), torch.bfloat16, seed=5)
    amax = fc.amax_reference(t, axis) * 0.75  # reduced elsewhere: here below the shard's own, so some saturate
    want = fc.scale_cast_reference(t, amax, torch.float8_e4m3fn)
    for backend in ("torch", "triton"):
        _same(dispatch.fp8_scale_cast(t, amax, torch.float8_e4m3fn, axis, backend), want)
