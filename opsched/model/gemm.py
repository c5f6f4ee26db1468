"""A matrix multiply's achievable fraction of peak from its shape: tile quantisation.

A GPU GEMM ``C[M, N] = A[M, K] · B[K, N]`` is computed in output tiles, each
tile by one thread block stepping through ``K`` a slice at a time; a
dimension that is not a multiple of the tile is padded to one, and the
padding is computed and thrown away (NVIDIA, *Matrix Multiplication
Background User's Guide*, DU-09799-001, 2023, section 3.1 "Tile
Quantization"; its section 2.3 gives cuBLAS's typical tiles, 256×128 and
128×128 for large problems, smaller ones only for small problems). So:

    efficiency(M, N, K, dtype) = ceiling(dtype) · shape_factor(M, N, K)
    shape_factor = (M · N · K) / (⌈M/128⌉·128 · ⌈N/128⌉·128 · ⌈K/64⌉·64)

``ceiling(dtype)`` is what a large, well-shaped GEMM reaches in that dtype:
the cluster's ``matmul_efficiency[dtype]`` (or its one ``efficiency``), see
``opsched.cost.cluster.Cluster.matmul_flops_per_second``. The tile is 128 × 128
outputs with K slices of 64 (128 bytes of a 16-bit operand row), the
smallest of the guide's large-problem tiles, so the rule never charges more
padding than cuBLAS's large tiles would. A large square GEMM has factor 1;
a skinny one (few rows, e.g. 16 tokens) pays for a whole tile row.

The rule is applied per operator at import (:func:`padded_flops`, stored as
``OpNode.matmul_padded_flops`` and summed into blocks like every cost
field); ``cost.compute_time`` charges a block's matmuls their padded FLOPs at
the ceiling. Not modelled: wave quantisation (the output tiles against the
SM count, section 3.2 of the guide), which depends on the device and on how
tensor parallelism splits the shape, neither known at import.

>>> round(shape_factor(GemmShape(m=4096, n=4096, k=4096)), 3)
1.0
>>> round(shape_factor(GemmShape(m=16, n=4096, k=4096)), 3)   # 16 of 128 tile rows used
0.125
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: output tile (rows × columns) and K slice of the rule: the smallest of cuBLAS's large-problem tiles
#: (NVIDIA Matrix Multiplication Background User's Guide, section 2.3)
TILE_M = 128
TILE_N = 128
TILE_K = 64


@dataclass(frozen=True)
class GemmShape:
    """One matrix multiply ``[batch ×] (M × K) · (K × N)``; ``batch`` independent GEMMs of that shape.

    >>> GemmShape(m=2, n=3, k=4, batch=5).flops
    240.0
    """

    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> float:
        """Useful FLOPs: 2 per multiply-add."""
        return 2.0 * self.batch * self.m * self.n * self.k


def _padded(size: int, tile: int) -> int:
    return math.ceil(size / tile) * tile


def padded_flops(shape: GemmShape) -> float:
    """FLOPs the tensor cores execute for ``shape``: every dimension padded to the tile.

    >>> padded_flops(GemmShape(m=100, n=128, k=64)) == GemmShape(m=128, n=128, k=64).flops
    True
    """
    return 2.0 * shape.batch * _padded(shape.m, TILE_M) * _padded(shape.n, TILE_N) * _padded(shape.k, TILE_K)


def shape_factor(shape: GemmShape) -> float:
    """Useful / executed FLOPs of ``shape``, in (0, 1]: what tile quantisation leaves of a GEMM's ceiling."""
    return shape.flops / padded_flops(shape)


def gemm_efficiency(shape: GemmShape, ceiling: float) -> float:
    """Achievable fraction of peak of one GEMM: the dtype's ``ceiling`` times :func:`shape_factor`.

    >>> gemm_efficiency(GemmShape(m=8192, n=8192, k=8192), ceiling=0.8)
    0.8
    >>> round(gemm_efficiency(GemmShape(m=4096, n=8, k=4096), ceiling=0.8), 3)   # a router: 8 of 128 columns
    0.05
    """
    return ceiling * shape_factor(shape)


def matmul_shape(op_type: str, in_shapes: list, out_shape, trans_a: bool = False) -> GemmShape | None:
    """The GEMM an ONNX ``MatMul`` / ``Gemm`` performs, from its static shapes (None if unknown or another op).

    A weight matmul (2-D second input) folds the leading dims of its input
    into M, as cuBLAS runs ``X[b, s, h] · W[h, n]`` as one GEMM of ``b·s``
    rows; a matmul of two activations is ``batch`` GEMMs.

    >>> matmul_shape("MatMul", [(2, 4096, 4096), (4096, 11008)], (2, 4096, 11008))
    GemmShape(m=8192, n=11008, k=4096, batch=1)
    >>> matmul_shape("MatMul", [(1, 32, 4096, 128), (1, 32, 128, 4096)], (1, 32, 4096, 4096))
    GemmShape(m=4096, n=4096, k=128, batch=32)
    """
    shapes = [s for s in in_shapes[:2]]
    if len(shapes) < 2 or not all(_static(s) for s in (*shapes, out_shape)) or not out_shape or not shapes[0]:
        return None
    a, b = shapes
    if op_type == "Gemm" and len(a) == 2 and len(out_shape) == 2:
        return GemmShape(m=out_shape[0], n=out_shape[1], k=a[0] if trans_a else a[1])
    if op_type not in ("MatMul", "FusedMatMul") or not b:
        return None
    n, k = out_shape[-1] if len(b) > 1 else 1, a[-1]
    rows = math.prod(out_shape) // max(1, n)
    if len(b) <= 2 or len(out_shape) < 2:
        return GemmShape(m=rows, n=n, k=k)
    m = out_shape[-2]
    return GemmShape(m=m, n=n, k=k, batch=rows // max(1, m))


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, int) and d > 0 for d in shape)
