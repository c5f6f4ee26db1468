"""Issue 44's branchy models of the literature (models/build.py, on demand): sizes worked out independently."""

from __future__ import annotations

import math
import re

import networkx as nx
import pytest

from tests.test_models import count_params, load_build, metadata, node_graph

build = load_build()


def transformer_layer_params(h: int, ff: int) -> int:
    """Pre-norm layer with biases: q, k, v, out (h x h + h each), fc1 (h x ff + ff), fc2 (ff x h + h), 2 LayerNorms."""
    return 4 * (h * h + h) + (h * ff + ff) + (ff * h + h) + 2 * 2 * h


def mmt_params(k: int) -> int:
    """GraphPipe's MMT of ``k`` branches: 8 layers (1024, FFN 4096) and a final LayerNorm per branch, the fusion."""
    return k * (8 * transformer_layer_params(1024, 4096) + 2 * 1024) + (k * 1024 * 1024 + 1024)


def uno_params(width: int = 1000) -> int:
    """CANDLE-Uno's default: 3 encoders (one per feature type, shared by both drugs) and the top net."""
    def dense(d_in, d_out):
        return d_in * d_out + d_out
    encoders = sum(dense(d, width) + 2 * dense(width, width) for d in (942, 5270, 2048))
    return encoders + dense(5 * width + 2, width) + 2 * dense(width, width) + dense(width, 1)


def vit_params(h: int, layers: int, ff: int) -> int:
    """An Optimus ViT: patch embedding (3 x 14 x 14 x h, no bias), 256 positions, layers, final LayerNorm."""
    return 3 * 14 * 14 * h + 256 * h + layers * transformer_layer_params(h, ff) + 2 * h


def optimus_params(encoders: tuple[str, ...], llm: str) -> int:
    """Encoders with their projectors to the LLM width, plus a Megatron GPT (vocab 51200, 2048 positions, tied)."""
    h, layers, _ = build.OPTIMUS_GPT[llm]
    total = layers * (12 * h * h + 13 * h) + 51200 * h + 2048 * h + 2 * h
    for enc in encoders:
        eh, elayers, eff, _ = build.OPTIMUS_VIT[enc]
        total += vit_params(eh, elayers, eff) + eh * h + h
    return total


@pytest.fixture(scope="module")
def models():
    return {}


def model(models, name):
    if name not in models:
        models[name] = build.MODELS[name]()
    return models[name]


@pytest.mark.parametrize("name, expected", [
    ("mmt", mmt_params(4)),
    *[(f"branches_k{k}", mmt_params(k)) for k in build.BRANCH_COUNTS],
    ("candle_uno", uno_params()),
])
def test_graphpipe_model_sizes(models, name, expected):
    m = model(models, name)
    assert count_params(m) == expected
    assert int(metadata(m)["opsched.param_count"]) == expected


def test_mmt_is_graphpipes_size():
    # appendix A.2 gives no total; 4 x 8 layers of 12.6 M each are 0.40 B
    assert 0.40e9 < mmt_params(4) < 0.41e9


@pytest.mark.parametrize("name", list(build.OPTIMUS_MODELS))
def test_optimus_model_sizes(models, name):
    encoders, llm = build.OPTIMUS_MODELS[name]
    assert count_params(model(models, name)) == optimus_params(encoders, llm)


def test_optimus_sizes_near_the_papers_names():
    # the names are the paper's: ViT-3B, ViT-5B, ViT-22B; GPT-175B. GPT-11B's published layer sizes give 9.2 B.
    for enc, billions in (("vit_3b", 3), ("vit_5b", 5), ("vit_22b", 22)):
        h, layers, ff, _ = build.OPTIMUS_VIT[enc]
        assert abs(vit_params(h, layers, ff) / 1e9 - billions) / billions < 0.1
    gpt_175b = optimus_params((), "gpt_175b")
    assert abs(gpt_175b / 175e9 - 1) < 0.01
    assert 9.1e9 < optimus_params((), "gpt_11b") < 9.3e9


@pytest.mark.parametrize("name, branches", [("mmt", 4), ("branches_k2", 2), ("branches_k16", 16), ("candle_uno", 5)])
def test_branches_are_independent(models, name, branches):
    """The towers share no path until they are joined: as many pairwise-unreachable first layers as branches."""
    g = node_graph(model(models, name))
    firsts = [n for n in g if re.search(r"layers\.0/self_attn/q_proj/MatMul$|_net(_1)?/dense_0/MatMul(_1)?$", n)]
    assert len(firsts) == branches
    for a in firsts:
        reach = nx.descendants(g, a)
        assert not any(b in reach for b in firsts if b != a)


def test_every_new_model_is_on_demand():
    new = ["mmt", "candle_uno", *(f"branches_k{k}" for k in build.BRANCH_COUNTS), *build.OPTIMUS_MODELS]
    assert all(name in build.ON_DEMAND and name not in build.BUNDLED for name in new)


def test_optimus_image_tokens_fill_the_sequence_positions(models):
    """256 image tokens per encoder (not published: 224 px in patches of 14), written into the 2048-token sequence."""
    m = model(models, "optimus_vit22b_vit5b_gpt175b")
    shapes = {vi.name: [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim] for vi in m.graph.input}
    assert shapes["image_positions_0"] == ["batch", 256, 2] == shapes["image_positions_1"]
    assert math.prod((224 // 14, 224 // 14)) == build.OPTIMUS_IMAGE_TOKENS
    assert metadata(m)["opsched.default_dims"] == "batch=1,seq=2048"


def test_towers_of_a_module_list_split_into_layers(tmp_path):
    """MMT's towers are ``branches.k`` (a ModuleList): each splits into its 8 layers, as CLIP's named towers do,
    and the towers stay parallel (4 blocks on one level)."""
    from opsched.model.coarsen import coarsen, parallel_branches
    from opsched.model.onnx_import import import_onnx

    path = tmp_path / "mmt.onnx"
    build.write_model(build.MODELS["mmt"](), str(path))
    bg = coarsen(import_onnx(str(path)))
    per_tower = {}
    for n in bg:
        m = re.match(r"branches\.(\d+)", bg.nodes[n]["block"].name.strip("/"))
        if m:
            per_tower[m.group(1)] = per_tower.get(m.group(1), 0) + 1
    assert sorted(per_tower) == ["0", "1", "2", "3"] and min(per_tower.values()) >= 8
    assert parallel_branches(bg) == 4
