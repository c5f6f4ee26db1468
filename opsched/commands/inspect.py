"""Summarise an ONNX model: operators by type, parameters, forward FLOPs at the
given dims, activation bytes, parallel branches and the blocks after coarsening.

Weights are never loaded: shapes come from the file (initializers with or
without their external data, or typed graph inputs) and shape inference.

Symbolic dims (batch, sequence...) are set with --dim NAME=VALUE; a model may
carry defaults in its metadata (opsched.default_dims), which --dim overrides.

MoE routing assumption: an expert loop exported with NonZero below a router
(TopK) has data-dependent token counts. opsched assumes balanced routing: each expert
gets ceil(capacity_factor * tokens * top_k / num_experts) tokens, with
num_experts, tokens and top_k read from the router's TopK
(--capacity-factor, default 1.0). Experts stored as one stacked
[experts, ...] weight (read by Gather/GatherND of expert indices, or a
batched MatMul over the expert axis) are split into one copy per expert,
each with its weights and ceil(capacity_factor * rows / num_experts) of the
rows. A NonZero with no router above it is a mask, not routing (LLaVA merges
its image features into the text that way): it is assumed all nonzero, and a
warning says so. `opsched plan` carries these assumptions and warnings into
report.md and plan.json.

Parallel branches: the most blocks at one level of the block graph (blocks on
one level have no path between them, e.g. the experts of a layer).

examples:
  opsched inspect models/mixtral_8x7b.onnx
  opsched inspect models/mixtral_8x7b.onnx --dim seq=8192 --blocks 64 --json
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter

from opsched.commands.args import dimension, merged_dims, non_negative_int, positive_float, positive_int

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL.onnx", help="an ONNX file (weights need not be present)")
    parser.add_argument("--dim", type=dimension, action="append", default=[], metavar="NAME=VALUE",
                        help="value of a symbolic dimension, e.g. --dim batch=1 --dim seq=4096 (repeatable)")
    parser.add_argument("--capacity-factor", type=positive_float, default=1.0, metavar="X",
                        help="MoE capacity factor for data-dependent expert loops (default 1.0, balanced routing)")
    parser.add_argument("--depth", type=non_negative_int, default=None, metavar="D",
                        help="coarsen by the first D module-scope levels (default: down to each op's layer)")
    parser.add_argument("--blocks", type=positive_int, default=None, metavar="K",
                        help="contract small blocks into neighbours down to K blocks where branches allow")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text summary")


def summarise(path: str, dims: dict[str, int] | None = None, capacity_factor: float = 1.0,
              depth: int | None = None, blocks: int | None = None) -> dict:
    """The inspect summary of one model as a plain dict (what ``--json`` prints)."""
    from opsched.model.coarsen import coarsen, parallel_branches
    from opsched.model.graph import totals
    from opsched.model.onnx_import import import_onnx, routing_assumptions

    # a --dim the model does not have is refused (a typo would otherwise summarise the default dims)
    g = import_onnx(path, dims=dims, capacity_factor=capacity_factor, strict_dims=True)
    bg = coarsen(g, depth=depth, target_blocks=blocks)
    t = totals(g)
    types = Counter(data["op"].op_type for _, data in g.nodes(data=True))
    flops_by_type: Counter = Counter()
    for _, data in g.nodes(data=True):
        flops_by_type[data["op"].op_type] += data["op"].flops
    return {
        "model": path,
        "name": g.graph["name"],
        "exporter": g.graph["exporter"],
        "dims": g.graph["dims"],
        "capacity_factor": capacity_factor,
        "nodes": g.number_of_nodes(),
        "edges": g.number_of_edges(),
        "params": int(t["param_count"]),
        "param_bytes": t["param_bytes"],
        "flops": t["flops"],
        "activation_bytes": t["output_bytes"],
        "kept_activation_bytes": t["saved_bytes"],
        "op_types": dict(sorted(types.items(), key=lambda kv: (-kv[1], kv[0]))),
        "flops_by_op_type": {k: v for k, v in sorted(flops_by_type.items(), key=lambda kv: (-kv[1], kv[0])) if v},
        "blocks": bg.number_of_nodes(),
        "block_edges": bg.number_of_edges(),
        "blocks_target_met": bg.graph["target_met"],
        "max_parallel_branches": parallel_branches(bg),
        "moe_nonzero_resolved": len(g.graph.get("moe_routing", {})),
        "nonzero_masks": len(g.graph.get("nonzero_masks", {})),
        "stacked_experts": g.graph.get("stacked_experts", {}),
        "data_inputs": g.graph["data_inputs"],
        "assumptions": routing_assumptions(g),
        "warnings": list(g.graph["warnings"]),
    }


def format_summary(s: dict) -> str:
    """The readable text form of :func:`summarise`'s dict."""
    from opsched.units import bytes_text, plural, si_text

    dims = ", ".join(f"{k}={v}" for k, v in s["dims"].items()) or "none"
    lines = [
        f"model        {s['model']} ({s['exporter']} export, graph '{s['name']}')",
        f"dims         {dims}",
        f"operators    {plural(s['nodes'], 'node')}, {plural(s['edges'], 'edge')}",
        f"parameters   {s['params']:,} ({si_text(s['params'])}, {bytes_text(s['param_bytes'])})",
        f"forward      {si_text(s['flops'], 'FLOP')} per microbatch at these dims",
        f"activations  {bytes_text(s['activation_bytes'])} written by the forward pass, "
        f"{bytes_text(s['kept_activation_bytes'])} of them kept for the backward",
        f"branches     at most {plural(s['max_parallel_branches'], 'block')} in parallel",
        f"blocks       {s['blocks']} after coarsening, {plural(s['block_edges'], 'edge')}"
        + ("" if s["blocks_target_met"] else " (no more merges keep branches apart: target not reached)"),
    ]
    for sentence in s.get("assumptions", []):
        lines.append(f"assumes      {sentence}")
    lines.append("op types     " + ", ".join(f"{k} {v}" for k, v in list(s["op_types"].items())[:12])
                 + (" ..." if len(s["op_types"]) > 12 else ""))
    top = list(s["flops_by_op_type"].items())[:6]
    if top and s["flops"]:
        lines.append("FLOPs in     " + ", ".join(f"{k} {100 * v / s['flops']:.1f}%" for k, v in top))
    for w in s["warnings"]:
        lines.append(f"warning      {w}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    s = summarise(args.model, dims=merged_dims(args.dim), capacity_factor=args.capacity_factor, depth=args.depth, blocks=args.blocks)
    # the summary lists them on stdout; stderr gets them too, as plan's do, so --json or a redirect cannot hide them
    for sentence in s["warnings"]:
        log.warning("import: warning: %s", sentence)
    if args.json:
        print(json.dumps(s, indent=2, sort_keys=False))
    else:
        print(format_summary(s))
    return 0
