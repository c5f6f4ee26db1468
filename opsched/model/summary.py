"""The summary of one ONNX model that ``opsched inspect`` prints: operators, parameters, FLOPs, activations,
parallel branches and the blocks after coarsening, as a plain dict and as readable text.

The import and coarsening are the model layer's own (opsched.model.onnx_import,
opsched.model.coarsen); this module only gathers their figures, so the command
stays argument handling and printing.
"""

from __future__ import annotations

from collections import Counter


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
