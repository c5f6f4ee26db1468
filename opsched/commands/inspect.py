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
from opsched.commands.args import dimension, merged_dims, non_negative_int, positive_float, positive_int
from opsched.model.summary import format_summary, summarise

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
