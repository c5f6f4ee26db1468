"""Write the ONNX graph of a Hugging Face model from its config.json, for `opsched plan`: no weights, no download.

For a model you have a config for and no ONNX file. transformers builds the
model from the config alone with every parameter on the meta device (shapes,
no memory: a 7B config takes well under 1 GB and a few minutes on a CPU), and
torch.onnx.export (dynamo) writes its graph. Each weight is in the file as an
initializer with its shape and dtype, its data marked external in a file
that is never written, which is all `opsched plan`, `inspect` and `evaluate`
read. Nothing is fetched from the network.

The graph has symbolic dims batch and seq; --batch and --seq-len become the
file's defaults (`opsched plan --dim seq=...` overrides them). Models:
causal language models (model types AutoModelForCausalLM knows; tried:
llama, mixtral, qwen2_moe, deepseek_v3, gpt2; MoE experts as stacked
weights, every routed expert counted) and the image-text two-tower models
clip and siglip. A model that does not trace is one error
line. Needs torch, transformers and onnxscript
(pip install 'opsched[torch,hf]').

examples:
  opsched onnx --hf-config llama-2-7b/config.json -o llama7b.onnx --seq-len 4096
  opsched plan llama7b.onnx --devices 8 -o out/
  opsched onnx --hf-config mixtral/config.json -o mixtral.onnx --seq-len 4096 --batch 1
"""

from __future__ import annotations

import argparse
import logging

from opsched.commands.args import positive_int

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from opsched.model.hf_onnx import DTYPES

    parser.add_argument("--hf-config", required=True, metavar="CONFIG.json",
                        help="a Hugging Face model config (config.json: model_type and sizes)")
    parser.add_argument("-o", "--output", required=True, metavar="MODEL.onnx", help="the ONNX file to write")
    parser.add_argument("--seq-len", type=positive_int, metavar="S",
                        help="default tokens per sequence (dim seq) written into the file "
                             "(default: the model's max_position_embeddings, at most 4096)")
    parser.add_argument("--batch", type=positive_int, default="1", metavar="B",
                        help="default sequences per microbatch (dim batch) written into the file (default 1)")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES),
                        help="the dtype the model is built in: its weights' and activations' bytes (default bf16)")


def run(args: argparse.Namespace) -> int:
    from opsched.model.hf_onnx import HfExportRequest, export_hf_config

    request = HfExportRequest(config_path=args.hf_config, output=args.output, seq_len=args.seq_len,
                              batch=args.batch, dtype=args.dtype)
    path = export_hf_config(request)
    print(f"wrote {path}")
    return 0
