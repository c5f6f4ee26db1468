"""How the presets' efficiencies by operator kind were chosen (docs/cost-model.md, "Efficiency by operator kind").

For each GPU preset, every setting of a grid of ``matmul_efficiency`` x
``attention_efficiency`` x ``memory_efficiency`` (``efficiency`` 0.5 for the
other FLOPs; FP8 matmuls at 0.75 x the BF16 figure) is written as a cluster
file, and every published run of ``bench_published.py`` on that GPU is
evaluated on it: the row's own ``opsched evaluate`` command with ``--cluster``
in place of ``--preset``. A setting scores the rows within 0.85-1.15 (then
the least mean |ln ratio|). The report gives the best settings, each row's
ratio on the preset as shipped and on the best setting, and an out-of-sample
check: the best setting on every other row (RUNS order), scored on the rest,
both ways, against the preset on the same rows.

Each evaluation is cached (``--cache FILE``, JSON), so a run cut short goes on
where it stopped. The default grid (45 settings x 37 rows) takes more than an
hour on 2 cores; ``--matmul/--attention/--memory`` choose another. The H100
preset comes from the default grid; the A100 preset from the second command
below (attention at or below FlashAttention-2's A100 ceiling, 0.63).

usage:
  python benchmarks/fit_presets.py --cache fit.json                      # both GPUs, the default grid
  python benchmarks/fit_presets.py --presets a100-80g --matmul 0.65 0.7 0.75 --attention 0.45 0.55 0.6 \
      --memory 0.5 0.6 0.7 0.8 0.9 --cache fit.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_published as bp  # the published runs, their commands and the ratio

from opsched.cost.cluster import preset_fields

WITHIN = (0.85, 1.15)
GRID = {"matmul": (0.55, 0.6, 0.65, 0.7, 0.75), "attention": (0.35, 0.45, 0.55), "memory": (0.5, 0.7, 0.9)}


def cluster_spec(preset: str, matmul: float, attention: float, memory: float) -> dict:
    """A cluster file for one setting of the grid on ``preset``."""
    dtypes = {"bf16": matmul, "fp16": matmul}
    if preset != "a100-80g":
        dtypes["fp8"] = round(0.75 * matmul, 6)  # the grid's rule; the shipped preset sets FP8 apart
    return {"preset": preset, "name": f"{preset}-fit", "efficiency": 0.5, "matmul_efficiency": dtypes,
            "attention_efficiency": attention, "memory_efficiency": memory}


def one_efficiency(preset: str) -> dict:
    """``preset`` with one efficiency, 0.5, for every FLOP and the full memory bandwidth: the presets before."""
    return {"preset": preset, "name": f"{preset}-one", "efficiency": 0.5, "matmul_efficiency": {},
            "attention_efficiency": None, "memory_efficiency": 1.0}


def ratio(run: bp.Run, spec: dict | None, folder: Path, cache: dict, cache_path: Path | None) -> float | None:
    """Predicted / published throughput of ``run`` on the cluster ``spec`` (None: its preset as shipped); None
    when evaluate refuses the setting."""
    # the preset as shipped is keyed by its figures, so a cache kept across a refit does not answer for the old ones
    shipped = {"shipped": preset_fields(run.preset)} if spec is None else spec
    key = f"{run.name}|{json.dumps(shipped, sort_keys=True)}"
    if key not in cache:
        command = run.command(model_path=bp.model_file(run, str(folder)))
        if spec is not None:
            path = folder / "cluster.json"
            path.write_text(json.dumps(spec))
            at = command.index("--preset")
            command[at:at + 2] = ["--cluster", str(path)]
        try:
            cache[key] = bp.throughput_ratio(run, bp.predicted_by(run, command)[0])
        except bp.NotEvaluated:
            cache[key] = None
        if cache_path is not None:
            cache_path.write_text(json.dumps(cache, indent=1, sort_keys=True))
    return cache[key]


def score(ratios: list[float | None]) -> tuple[int, float]:
    """(rows within, mean |ln ratio| over the rows evaluated); a refused row counts as outside."""
    done = [r for r in ratios if r is not None]
    mean = sum(abs(math.log(r)) for r in done) / len(done) if done else math.inf
    return sum(WITHIN[0] <= r <= WITHIN[1] for r in done), mean


def best(table: dict[tuple, list[float | None]], rows: list[int]) -> tuple:
    """The setting with the most of ``rows`` (positions) within, then the least mean |ln ratio|."""
    def rank(setting: tuple) -> tuple[int, float]:
        within, mean = score([table[setting][k] for k in rows])
        return -within, mean

    return min(table, key=rank)


def fit(preset: str, grid: list[tuple], folder: Path, cache: dict, cache_path: Path | None) -> None:
    runs = [r for r in bp.RUNS if r.preset == preset]
    shipped = [ratio(r, None, folder, cache, cache_path) for r in runs]
    single = [ratio(r, one_efficiency(preset), folder, cache, cache_path) for r in runs]
    table = {}
    for n, setting in enumerate(grid, 1):
        table[setting] = [ratio(r, cluster_spec(preset, *setting), folder, cache, cache_path) for r in runs]
        within, mean = score(table[setting])
        print(f"{preset} {n}/{len(grid)} matmul, attention, memory = {setting}: {within} of {len(runs)} within, "
              f"mean |ln ratio| {mean:.3f}", flush=True)
    top = best(table, list(range(len(runs))))
    print(f"\n{preset}: one efficiency {score(single)[0]} of {len(runs)}, the preset as shipped "
          f"{score(shipped)[0]}, the best setting {top} {score(table[top])[0]}; each row's ratio so:")
    for run, *ratios in zip(runs, single, shipped, table[top]):
        print(f"  {run.name[:60]:60s} " + " | ".join("refused" if r is None else f"{r:.3f}" for r in ratios))
    halves = (list(range(0, len(runs), 2)), list(range(1, len(runs), 2)))
    for fitted, held in (halves, halves[::-1]):
        chosen = best(table, fitted)
        out = score([table[chosen][k] for k in held])[0]
        print(f"  out of sample: fitted on rows {fitted} -> {chosen}; the other {len(held)} rows: {out} within "
              f"(one efficiency: {score([single[k] for k in held])[0]})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["a100-80g", "h100-sxm"])
    parser.add_argument("--matmul", type=float, nargs="+", default=GRID["matmul"])
    parser.add_argument("--attention", type=float, nargs="+", default=GRID["attention"])
    parser.add_argument("--memory", type=float, nargs="+", default=GRID["memory"])
    parser.add_argument("--cache", type=Path, help="JSON file of the evaluations done (read, then kept up to date)")
    args = parser.parse_args()
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    grid = list(itertools.product(args.matmul, args.attention, args.memory))
    with tempfile.TemporaryDirectory() as folder:
        for preset in args.presets:
            fit(preset, grid, Path(folder), cache, args.cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
