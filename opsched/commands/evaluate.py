"""Predict the training step of the layout you run today, with opsched's cost model.

Imports the ONNX model (shapes only) at --micro-batch-size sequences of
--seq-len tokens, splits its layers into pp x vpp pipeline chunks (evenly, or as
first_layers / last_layers or a Megatron layout string say),
costs every block under the layout (tensor, sequence and context parallel,
expert parallel on an ep x etp grid folded over tp x cp x dp, ZeRO, recomputation) and times
one step with the named pipeline schedule: the same cost model and
simulator `opsched plan` uses, so a plan and your layout compare like with
like.

The layout is comma-separated KEY=VALUE, Megatron's names:
  tp  tensor-parallel size          pp   pipeline-parallel size
  vpp virtual pipeline chunks       ep   expert-parallel size
  cp  context-parallel size: each sequence split over cp ranks, K/V passed round a ring
  etp expert tensor-parallel size (default tp); the ep x etp expert grid is carved out of a
      pipeline rank's tp x cp x dp devices (Megatron-Core's parallel folding: tp=2,ep=32,etp=1
      on 32 devices per stage)
  max_nodes  each token's experts on at most this many nodes (DeepSeek-V3's node-limited
      routing): the network carries a token once per chosen node, NVLink the rest
  dp  data-parallel size (default: devices / (tp x pp x cp))
  sp  sequence parallel, 0 or 1     zero 0-3 (1 = Megatron's distributed optimizer, 3 = FSDP full shard)
  recompute none | selective (the attention core again) | full (the whole forward again)
  recompute_modules Megatron's --recompute-modules, e.g. layernorm,mla_up_proj (core_attn, moe_act,
      layernorm, mla_up_proj, mlp, moe, shared_experts): each module's forward again in the
      backward, none of its activations kept (with recompute none)
  encoders_first 0 or 1: a model of several stacks of layers (a vision encoder and a language model)
      puts every stack but the last (the language model) whole into the first pipeline chunk and
      splits the last evenly: Megatron-Core's multimodal layout, the encoder in the first pipeline stage
  ends_as_layers 0 or 1: the embedding and the head count as one layer each when the layers are
      split into pp x vpp chunks (Megatron's --account-for-embedding/loss-in-pipeline-split)
  pipeline_layout Megatron-Core's --pipeline-model-parallel-layout, e.g. Et|(tt|)*30mL: E embedding,
      t decoder layer, m MTP layer, L loss, | chunk end, (...)*n repeat; pp x vpp chunks (sets vpp)
  first_layers, last_layers  layers of the first / last pipeline rank, the others sharing the rest
      (Megatron's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)
  A split that does not divide the layers is refused with the settings that would.
  tp_overlap 0 or 1: Megatron's --tp-comm-overlap (needs tp > 1 and sp=1): each tensor-parallel
      collective runs under its GEMM, so only what outlasts the compute shows
  attention fused (default: FlashAttention, cuDNN, torch's SDPA) | unfused (Megatron-LM before
      FlashAttention, e.g. the SC'21 runs: the scores written to memory for softmax and dropout)
Microbatches per pipeline = global batch / (dp x micro-batch size).

Prints the step time, tokens/s per device, MFU (model FLOPs = 3 x the
forward FLOPs, no recompute: PaLM's 6ND + attention), peak memory per device
and whether it fits, and where the time goes. With --json, one object with
step_time (s), tokens_per_second_per_device, mfu, peak_memory_bytes, fits,
breakdown (s; context_comm, the exposed K/V ring, when cp > 1), phases
(s, the busiest rank's step as DeepSeek splits DualPipe's: forward_only,
pairs of overlapped forward and backward, backward_only, w_only, bubble,
optimizer = what follows the pipeline), layout, schedule, microbatches and
optimizer_state.

--optimizer-state bf16 keeps Adam's moments in BF16 and its FP32 master
weight as the 16 bits beyond the BF16 weight: 2 + 2 + 6 = 10 bytes per
parameter instead of 16 (Megatron-Core's precision-aware optimizer).

examples:
  opsched evaluate models/mixtral_8x7b.onnx --devices 64 --layout tp=1,pp=4,vpp=8,ep=8,zero=1 --seq-len 4096 --global-batch 256
  opsched evaluate models/llama_7b.onnx --devices 8 --layout tp=1,pp=1,zero=3,recompute=full --seq-len 4096 --global-batch 256
"""

from __future__ import annotations

import argparse
import json
import logging

from opsched.commands.args import (add_cluster_arguments, add_dtype_argument, add_optimizer_state_argument,
                                   byte_size, positive_int)
from opsched.plan.evaluation_text import summary_text

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from opsched.baselines import NAMES

    parser.add_argument("model", metavar="MODEL.onnx", help="an ONNX file (weights need not be present)")
    add_cluster_arguments(parser)
    parser.add_argument("--layout", required=True, metavar="KEY=VALUE,...",
                        help='e.g. "tp=1,pp=4,vpp=8,ep=8,zero=1,recompute=selective,sp=1" (keys above)')
    parser.add_argument("--seq-len", type=positive_int, metavar="S",
                        help="tokens per sequence (the model's seq dimension; default: the file's)")
    parser.add_argument("--global-batch", type=positive_int, required=True, metavar="G", help="sequences per step")
    parser.add_argument("--micro-batch-size", type=positive_int, default="1", metavar="B",
                        help="sequences per microbatch (default 1)")
    parser.add_argument("--schedule", choices=NAMES, metavar="NAME",
                        help=f"pipeline schedule, one of {', '.join(NAMES)} (default: interleaved-1f1b when vpp > 1, else 1f1b)")
    add_dtype_argument(parser)
    add_optimizer_state_argument(parser)
    parser.add_argument("--memory-limit", type=byte_size, metavar="BYTES",
                        help="per device with a unit, e.g. 80GiB (default: the cluster's memory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout (fields above)")


def run(args: argparse.Namespace) -> int:
    from opsched.cost.cluster import Training, resolve_cluster
    from opsched.model.coarsen import coarsen
    from opsched.errors import OpschedError
    from opsched.plan.layouts import ParallelLayout, evaluate_layout
    from opsched.model.onnx_import import import_onnx
    from opsched.model.recompute_modules import modules_without_parts

    cluster = resolve_cluster(args.devices, args.cluster, args.preset)
    # a malformed layout, or one that does not match the devices, fails before the import
    layout = ParallelLayout.parse(args.layout)
    dp = layout.resolved(cluster.devices).dp
    if args.global_batch % (dp * args.micro_batch_size):
        raise OpschedError(f"--global-batch {args.global_batch} is not a multiple of dp x --micro-batch-size = "
                           f"{dp} x {args.micro_batch_size}; each replica takes whole microbatches")
    dims = {"batch": args.micro_batch_size}
    if args.seq_len:
        dims["seq"] = args.seq_len
    og = import_onnx(args.model, dims=dims, strict_dims=True)
    used = dict(og.graph.get("dims", {}))
    if "batch" not in used:
        raise OpschedError(f"{args.model} has no symbolic batch dimension; evaluate needs one to size a microbatch")
    tokens_per_sequence = int(used.get("seq", 1))
    training = Training(microbatches=1, microbatch_size=args.micro_batch_size, dtype=args.dtype,
                        optimizer_state=args.optimizer_state)
    bg = coarsen(og)
    log.info("import: %s: %d operators, %d blocks, dims %s", args.model, og.number_of_nodes(), bg.number_of_nodes(), used)
    for sentence in og.graph.get("warnings") or []:  # what the import could not cost (unknown ops...), as plan says
        log.warning("import: warning: %s", sentence)
    absent = modules_without_parts(layout.recomputed_modules, {p.part for b in bg for p in bg.nodes[b]["block"].parts})
    if absent:  # said, not costed as nothing: the user asked for a recomputation the step would not show
        raise OpschedError(f"recompute_modules names {', '.join(absent)}, but opsched finds no operators of "
                           f"{'it' if len(absent) == 1 else 'them'} in {args.model} (Megatron-Core refuses "
                           "mla_up_proj without multi-latent attention); leave "
                           f"{'it' if len(absent) == 1 else 'them'} out")
    result = evaluate_layout(bg, cluster, training, layout, global_batch=args.global_batch,
                             micro_batch_size=args.micro_batch_size, tokens_per_sequence=tokens_per_sequence,
                             schedule=args.schedule, memory_limit=args.memory_limit)
    if args.json:
        print(json.dumps({"model": args.model, "cluster": cluster.name, "devices": cluster.devices,
                          "seq_len": tokens_per_sequence, "optimizer_state": training.optimizer_state,
                          **result.to_dict()}, indent=2))
        return 0
    print(summary_text(args.model, cluster, result, training))
    return 0
