"""The GEMM efficiency rule (opsched/model/gemm.py): tile quantisation against a per-dtype ceiling."""

import pytest

from opsched.model.gemm import (
    GemmShape,
    gemm_efficiency,
    matmul_shape,
    padded_flops,
    shape_factor,
)


def test_a_large_square_gemm_reaches_the_ceiling():
    for size in (4096, 8192, 16384):
        assert gemm_efficiency(GemmShape(size, size, size), ceiling=0.8) == pytest.approx(0.8)


def test_a_skinny_gemm_is_well_below_the_ceiling():
    # 8 tokens through a 4096 x 4096 weight: 8 of the tile's 128 rows do useful work
    skinny = gemm_efficiency(GemmShape(m=8, n=4096, k=4096), ceiling=0.8)
    assert skinny == pytest.approx(0.8 * 8 / 128)
    assert skinny < 0.1
    # an MoE router (8 experts): 8 of 128 columns
    assert gemm_efficiency(GemmShape(m=4096, n=8, k=4096), ceiling=0.8) < 0.1


def test_efficiency_is_monotone_in_size():
    """Non-decreasing along powers of two; between them a size just past a tile pays for the next (the sawtooth
    of NVIDIA's tile-quantisation figure), but never loses more than one tile's share of its dimension."""
    sizes = [1, 2, 8, 16, 32, 64, 128, 256, 1024, 4096]
    for make in (lambda s: GemmShape(s, s, s), lambda s: GemmShape(s, 4096, 4096), lambda s: GemmShape(4096, 4096, s)):
        factors = [shape_factor(make(s)) for s in sizes]
        assert factors == sorted(factors), factors
        assert 0 < factors[0] < factors[-1] == 1.0
    assert shape_factor(GemmShape(129, 4096, 4096)) < shape_factor(GemmShape(128, 4096, 4096))
    for m in range(1000, 1300, 7):
        assert 1 - 128 / m < shape_factor(GemmShape(m, 4096, 4096)) <= 1


def test_padding_rounds_each_dimension_up_to_its_tile():
    assert padded_flops(GemmShape(m=129, n=128, k=64)) == GemmShape(m=256, n=128, k=64).flops
    assert padded_flops(GemmShape(m=128, n=128, k=65)) == GemmShape(m=128, n=128, k=128).flops
    assert padded_flops(GemmShape(m=128, n=128, k=64, batch=3)) == 3 * GemmShape(128, 128, 64).flops


def test_onnx_matmul_shapes():
    # a weight matmul folds batch and sequence into M; two activations are a batch of GEMMs
    assert matmul_shape("MatMul", [(4, 512, 768), (768, 3072)], (4, 512, 3072)) == GemmShape(2048, 3072, 768)
    scores = matmul_shape("MatMul", [(2, 12, 512, 64), (2, 12, 64, 512)], (2, 12, 512, 512))
    assert scores == GemmShape(512, 512, 64, batch=24)
    assert matmul_shape("Gemm", [(64, 32), (64, 10)], (32, 10), trans_a=True) == GemmShape(32, 10, 64)
    assert matmul_shape("MatMul", [(4, None, 768), (768, 3072)], (4, None, 3072)) is None
    assert matmul_shape("Conv", [(1, 3, 8, 8), (4, 3, 3, 3)], (1, 4, 6, 6)) is None
