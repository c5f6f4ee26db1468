"""Time ONNX import + coarsening of a ~6,000-node 32-layer MoE (target: under 3 s).

The graph is built with ``onnx.helper`` by the tests' model builder
(``tests/helpers.py``): a legacy-style export (scoped node names, weights as
typed graph inputs, Constant nodes) of a 32-layer MoE language model with
Mixtral-like sizes, whose experts are a loop over the routed tokens
(Equal -> NonZero -> Gather -> expert -> ScatterND), so the import also
resolves 32 x experts data-dependent token counts. The bundled models are
timed too when present.

usage:
  python benchmarks/bench_import.py [--experts 13] [--repeat 3]

Prints one line per model: nodes, import seconds, coarsen seconds, total
(best of --repeat runs, wall clock).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers import make_moe_model, save  # noqa: E402

from opsched.model.coarsen import coarsen  # noqa: E402
from opsched.model.onnx_import import import_onnx  # noqa: E402


def time_model(path, repeat: int, dims=None, target_blocks=None) -> tuple[int, float, float, int]:
    """Best-of-``repeat`` wall seconds for import and for coarsening."""
    best_import = best_coarsen = float("inf")
    nodes = blocks = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        g = import_onnx(path, dims=dims)
        t1 = time.perf_counter()
        bg = coarsen(g, target_blocks=target_blocks)
        t2 = time.perf_counter()
        best_import = min(best_import, t1 - t0)
        best_coarsen = min(best_coarsen, t2 - t1)
        nodes, blocks = g.number_of_nodes(), bg.number_of_nodes()
    return nodes, best_import, best_coarsen, blocks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=13, help="experts per layer (13 gives ~6,000 nodes)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_moe_model("legacy", layers=32, experts=args.experts, top_k=2, hidden=4096, ffn=14336,
                               vocab=32000, routing="nonzero", name="bench_moe_32l")
        path = save(model, Path(tmp) / "moe32.onnx")
        rows = [("generated 32-layer MoE (legacy style, NonZero experts)", path, {"batch": 1, "seq": 4096})]
        for name in ("mixtral_8x7b.onnx", "deepseek_moe.onnx"):
            if (ROOT / "models" / name).exists():
                rows.append((f"models/{name}", ROOT / "models" / name, None))
        print(f"{'model':58s} {'nodes':>6s} {'import s':>9s} {'coarsen s':>9s} {'total s':>8s} {'blocks':>6s}")
        for label, p, dims in rows:
            nodes, t_imp, t_coarse, blocks = time_model(p, args.repeat, dims=dims)
            print(f"{label:58s} {nodes:6d} {t_imp:9.2f} {t_coarse:9.2f} {t_imp + t_coarse:8.2f} {blocks:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
