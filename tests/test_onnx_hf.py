"""`opsched onnx --hf-config`: a Hugging Face config -> an ONNX graph without weights, ready for `opsched plan`.

Tiny configs (2 layers, hidden 32) of a dense decoder (Llama), an MoE decoder
(Mixtral, experts as stacked weights) and two-tower image-text models (CLIP, SigLIP)
are exported with parameters on the meta device; the importer's parameter
count must equal the count transformers gives the same config. Each export
traces the model with torch.export (10-20 s on a shared CPU), so those tests
are slow; the refusals happen before any export and are in the default run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import onnx
import pytest

from opsched.cli import main

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)
CONFIGS = {
    "llama": dict(model_type="llama", intermediate_size=48, tie_word_embeddings=False, **COMMON),
    "llama-tied": dict(model_type="llama", intermediate_size=48, tie_word_embeddings=True, **COMMON),
    "mixtral": dict(model_type="mixtral", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **COMMON),
    # DeepSeek-V3: MLA attention, a dense first layer, then 4 routed + 1 shared experts with grouped routing
    "deepseek_v3": dict(model_type="deepseek_v3", intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        **dict(COMMON, num_key_value_heads=4)),
    "clip": dict(model_type="clip", projection_dim=16,
                 text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=16),
                 vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=32, patch_size=8)),
}
# SigLIP: the same towers; its image tower ends in an attention-pooling head (a probe and nn.MultiheadAttention)
CONFIGS["siglip"] = dict(CONFIGS["clip"], model_type="siglip")
del CONFIGS["siglip"]["projection_dim"]
TWO_TOWERS = ("clip", "siglip")
#: parameters the import's rules leave out (onnx_import rule 6): scalars, a weight read only by Expand (CLIP's class
#: embedding, SigLIP's probe), and the packed q/k/v projection of nn.MultiheadAttention, read through a Split
UNCOUNTED = ("logit_scale", "logit_bias", "class_embedding", "probe", "in_proj_weight", "in_proj_bias")


def write_config(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    return path


class Counts(NamedTuple):
    """Of a config's model as transformers builds it (on meta)."""

    params: int  # sum(p.numel())
    float_buffers: int  # buffers the file holds as float initializers, counted like weights by the import
    meta_buffers: int  # of those, the ones left on meta by the export (DeepSeek-V3's router score bias)
    uncounted: int  # parameters the import's rules leave out (UNCOUNTED)


def hf_counts(name: str) -> Counts:
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    fields = dict(CONFIGS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    auto = AutoModel if name in TWO_TOWERS else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    buffers = dict(model.named_buffers())
    routed_bias = sum(b.numel() for n, b in buffers.items() if n.endswith(".e_score_correction_bias"))
    rotary = sum(b.numel() for n, b in buffers.items() if n.endswith(".inv_freq"))
    uncounted = sum(p.numel() for n, p in model.named_parameters() if n.endswith(UNCOUNTED))
    return Counts(sum(p.numel() for p in model.parameters()), rotary + routed_bias, routed_bias, uncounted)


def _attention_layers(name: str) -> int:
    cfg = CONFIGS[name]
    if name in TWO_TOWERS:
        return cfg["text_config"]["num_hidden_layers"] + cfg["vision_config"]["num_hidden_layers"]
    return cfg["num_hidden_layers"]


def export(tmp_path: Path, name: str, *extra: str) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    out = tmp_path / f"{name}.onnx"
    assert main(["onnx", "--hf-config", str(write_config(tmp_path, name)), "-o", str(out), *extra]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "llama-tied", "mixtral", "deepseek_v3", "clip", "siglip"])
def test_import_counts_every_parameter_of_the_config(tmp_path, name):
    from opsched.model.graph import totals
    from opsched.model.onnx_import import import_onnx

    path = export(tmp_path, name, "--seq-len", "16", "--batch", "2")
    params, float_buffers, meta_buffers, uncounted = hf_counts(name)
    g = import_onnx(path)
    # float buffers (the rotary inv_freq, head_dim / 2 floats) are initializers the graph reads, counted like
    # weights; a tied embedding is one parameter in transformers and one initializer in the file
    assert totals(g)["param_count"] == params + float_buffers - uncounted
    assert (float_buffers > 0) == (name not in TWO_TOWERS) and (uncounted > 0) == (name in TWO_TOWERS)
    model = onnx.load(str(path), load_external_data=False)
    written = sum(math.prod(t.dims) for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    assert written == params + meta_buffers  # every parameter is in the file, once (shapes only)
    assert g.graph["dims"] == {"batch": 2, "seq": 16}
    assert g.graph["warnings"] == []
    # attention is one fused op (opset 23), not score matrices of [batch, heads, seq, seq]
    assert sum(n.op_type == "Attention" for n in model.graph.node) == _attention_layers(name)
    # the other softmaxes: Mixtral's routers (over experts), SigLIP's pooling head (nn.MultiheadAttention);
    # DeepSeek-V3's router scores by sigmoid
    others = {"mixtral": CONFIGS["mixtral"]["num_hidden_layers"], "siglip": 1}.get(name, 0)
    assert sum(n.op_type == "Softmax" for n in model.graph.node) == others
    weights = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert weights and all(not t.raw_data for t in weights)  # shapes only: no weight was written
    # --dtype bf16, the default, but where transformers keeps fp32 (DeepSeek-V3's router, weight and bias)
    fp32_router = {f"model.model.layers.1.mlp.gate.{w}" for w in ("weight", "e_score_correction_bias")}
    kept = {t.name for t in weights if t.data_type != onnx.TensorProto.BFLOAT16}
    assert kept == (fp32_router if name == "deepseek_v3" else set())
    assert path.stat().st_size < 200_000
    assert not list(tmp_path.glob("*.data"))


@pytest.mark.slow
def test_mixtral_routed_experts_are_split_and_counted(tmp_path):
    from opsched.model.onnx_import import import_onnx

    path = export(tmp_path, "mixtral", "--seq-len", "16")
    g = import_onnx(path)
    cfg = CONFIGS["mixtral"]
    hidden, ffn, experts = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    # every layer's stacked experts are split into one copy per expert, each with one expert's weights
    # (gate and up H x 2F, down F x H) and, at capacity factor 1, ceil(tokens * top_k / experts) rows
    families = g.graph["stacked_experts"]
    assert len(families) == cfg["num_hidden_layers"]
    assert {f["rows_per_expert"] for f in families.values()} == {math.ceil(16 * 2 / experts)}
    per_layer = {}
    for _, op in g.nodes(data="op"):
        scope = [p for p in op.scope if p.startswith("experts.")]
        if scope:
            per_layer.setdefault(scope[0], 0)
            per_layer[scope[0]] += op.param_count
    assert sorted(per_layer) == [f"experts.{e}" for e in range(experts)]
    assert set(per_layer.values()) == {cfg["num_hidden_layers"] * 3 * hidden * ffn}


@pytest.mark.slow
def test_config_to_plan(tmp_path):
    path = export(tmp_path, "llama", "--seq-len", "32")
    out = tmp_path / "plan"
    assert main(["plan", str(path), "--devices", "4", "--time-limit", "20", "-o", str(out), "-q"]) == 0
    from opsched.export.plan_json import read_plan
    from opsched.schedule import validate

    schedule, doc = read_plan(out / "plan.json")
    validate(schedule)
    assert doc["model"] == str(path)


# --------------------------------------------------------------------------- refusals: one line, exit 2, nothing written


def refused(tmp_path, capsys, argv: list[str], *words: str) -> str:
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("opsched: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary file left
    return lines[0]


def test_missing_config_is_refused(tmp_path, capsys):
    refused(tmp_path, capsys, ["onnx", "--hf-config", str(tmp_path / "none.json"), "-o", str(tmp_path / "m.onnx")],
            "file not found")


@pytest.mark.parametrize("text, words", [
    ("{not json", ("not valid JSON", "line 1")),
    ("[1, 2]", ("expected a JSON object",)),
    ('{"hidden_size": 32}', ('no "model_type"',)),
])
def test_invalid_config_is_refused(tmp_path, capsys, text, words):
    config = tmp_path / "config.json"
    config.write_text(text)
    refused(tmp_path, capsys, ["onnx", "--hf-config", str(config), "-o", str(tmp_path / "m.onnx")], *words)


@pytest.mark.slow  # imports transformers: seconds on a busy machine
def test_unknown_model_type_is_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llamma", "hidden_size": 32}))
    refused(tmp_path, capsys, ["onnx", "--hf-config", str(config), "-o", str(tmp_path / "m.onnx")],
            "'llamma' is unknown to transformers")


@pytest.mark.slow
def test_unsupported_model_kind_is_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "vit", "hidden_size": 32, "num_attention_heads": 4}))
    refused(tmp_path, capsys, ["onnx", "--hf-config", str(config), "-o", str(tmp_path / "m.onnx")],
            "'vit' is not supported", "causal language models")


@pytest.mark.slow  # imports transformers
@pytest.mark.parametrize("name, change, words", [
    ("mixtral", dict(hidden_size=44), ("hidden_size 44 / num_attention_heads 4", "rotary dimension of 11")),
    # an explicit head dim transformers checks itself, in a line of its own
    ("llama", dict(head_dim=9), ("rotary dimension", "9")),
    ("deepseek_v3", dict(qk_rope_head_dim=5), ("rotary dimension", "5")),
])
def test_odd_rotary_dimension_is_refused_before_the_export(tmp_path, capsys, name, change, words):
    """rotate_half needs an even rotary dimension; a derived one (hidden / heads) transformers does not check, and
    the export then failed inside attention with a shape error."""
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**CONFIGS[name], **change}))
    refused(tmp_path, capsys, ["onnx", "--hf-config", str(config), "-o", str(tmp_path / "m.onnx")], *words, "even")


def test_odd_head_dim_without_rotary_embeddings_is_not_refused():
    """GPT-2 and CLIP learn their positions: an odd head dimension is theirs to have."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config

    from opsched.model.hf_onnx import _check_rotary_dim

    _check_rotary_dim(GPT2Config(n_embd=33, n_head=3), "config.json")  # head dim 11, no rotary: no error


def test_missing_output_directory_is_refused(tmp_path, capsys):
    config = write_config(tmp_path, "llama")
    refused(tmp_path, capsys, ["onnx", "--hf-config", str(config), "-o", str(tmp_path / "no" / "m.onnx")],
            "does not exist", "create it first")


@pytest.mark.slow
def test_seq_len_over_the_positions_is_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = write_config(tmp_path, "llama")
    refused(tmp_path, capsys, ["onnx", "--hf-config", str(config), "-o", str(tmp_path / "m.onnx"), "--seq-len", "129"],
            "over the model's 128 positions")


@pytest.mark.parametrize("missing", ["torch", "transformers"])
def test_missing_backend_is_refused(tmp_path, capsys, monkeypatch, missing):
    import sys

    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    config = write_config(tmp_path, "llama")
    refused(tmp_path, capsys, ["onnx", "--hf-config", str(config), "-o", str(tmp_path / "m.onnx")],
            "opsched onnx --hf-config needs", missing, "pip install")


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["onnx", "--help"])
    out = capsys.readouterr().out
    assert "meta device" in out and "opsched onnx --hf-config" in out and "--seq-len" in out


@pytest.mark.slow
def test_transformers_notes_on_a_config_leave_a_refusal_one_line(tmp_path, capsys):
    """Found by a bug hunt: a CLIP config whose text vocabulary is smaller than CLIP's default token ids made
    transformers print two warnings on stderr before the one-line refusal; they go to opsched's log at DEBUG."""
    pytest.importorskip("transformers")
    config = write_config(tmp_path, "clip")
    import logging

    shown = []  # what reached stderr through transformers' own handlers (made before capsys replaced sys.stderr)
    hf_log = logging.getLogger("transformers")
    spy = logging.Handler()
    spy.emit = shown.append
    hf_log.addHandler(spy)
    try:
        refused(tmp_path, capsys, ["onnx", "--hf-config", str(config), "-o", str(tmp_path / "m.onnx"),
                                   "--seq-len", "17"], "over the model's 16 positions")
    finally:
        hf_log.removeHandler(spy)
    assert shown == []
