"""``encoders_first=1`` (evaluate's layout key): a multimodal LLM's encoder whole in the first pipeline chunk."""

from __future__ import annotations

import networkx as nx
import pytest

from opsched.cost.cluster import Training, preset
from opsched.cost.parallel_layout import ParallelLayout
from opsched.errors import OpschedError
from opsched.model.graph import Block
from opsched.plan.layouts import evaluate_layout, layer_chunks, model_index


def two_stack_graph(vit_layers: int = 4, lm_layers: int = 4) -> nx.DiGraph:
    """patches -> vit layers -> projector -> (with the text embedding) lm layers -> head: one chain of blocks."""
    names = (["vit/patch_embed"] + [f"vit/layers.{i}" for i in range(vit_layers)] + ["vit/projector", "lm/embed"]
             + [f"lm/layers.{i}" for i in range(lm_layers)] + ["lm_head"])
    g = nx.DiGraph(kind="BlockGraph")
    for i, name in enumerate(names):
        heavy = "layers" in name
        g.add_node(i, block=Block(i, name, (name,), (name,), flops=(4e12 if name.startswith("lm/") else 1e12) * heavy
                                  + 1e9, param_count=10**7, output_bytes=1e7, saved_bytes=1e7))
    g.add_edges_from(((i, i + 1) for i in range(len(names) - 1)), bytes=1e6)
    return g


def chunk_names(g, chunks):
    return [[g.nodes[b]["block"].name for b in chunk] for chunk in chunks]


def test_the_encoder_stack_joins_the_first_chunk_whole():
    g = two_stack_graph()
    split = chunk_names(g, layer_chunks(g, 2, encoders_first=True))
    assert split[0] == ["vit/patch_embed", "vit/layers.0", "vit/layers.1", "vit/layers.2", "vit/layers.3",
                        "vit/projector", "lm/embed", "lm/layers.0", "lm/layers.1"]
    assert split[1] == ["lm/layers.2", "lm/layers.3", "lm_head"]
    # without it the eight layers of both stacks split evenly: the encoder alone in the first chunk, with what
    # follows its layers before the language model's (its projector, the embedding the image tokens join)
    assert chunk_names(g, layer_chunks(g, 2))[0][-3:] == ["vit/layers.3", "vit/projector", "lm/embed"]


@pytest.mark.parametrize("encoders_first", [False, True])
def test_every_chunk_feeds_only_later_ones(encoders_first):
    """A chunk holds no block that a later chunk's block feeds, however the stacks split (a pipeline stage cannot
    wait for a later one): before, an encoder's projector went to the last chunk, after the layers it feeds."""
    g = two_stack_graph()
    for chunks in ((2, 4) if encoders_first else (2, 4, 8)):
        chunk_of = {b: c for c, blocks in enumerate(layer_chunks(g, chunks, encoders_first=encoders_first))
                    for b in blocks}
        assert set(chunk_of) == set(g.nodes)
        assert all(chunk_of[a] <= chunk_of[b] for a, b in g.edges), chunks


def test_encoders_first_is_parsed_counted_and_priced():
    layout = ParallelLayout.parse("pp=4,encoders_first=1")
    assert layout.encoders_first and str(layout.resolved(4)).endswith("encoders-first")
    g = two_stack_graph(vit_layers=3)
    with pytest.raises(OpschedError, match="does not divide the 7 layers"):
        layer_chunks(g, 4)  # 7 layers of both stacks
    assert len(layer_chunks(g, 4, encoders_first=True)) == 4  # the language model's 4
    cluster, training = preset("h100-sxm", 4), Training(microbatches=8)
    first = evaluate_layout(g, cluster, training, layout.resolved(4), global_batch=8, micro_batch_size=1,
                           tokens_per_sequence=1024)
    # the first stage holds the encoder besides a language layer: the slowest stage, so a longer step than a
    # first stage without it (the layout with the encoder split over the stages is not whole-layer here)
    lm_only = two_stack_graph(vit_layers=0)
    plain = evaluate_layout(lm_only, cluster, training, ParallelLayout(pp=4).resolved(4), global_batch=8,
                            micro_batch_size=1, tokens_per_sequence=1024)
    assert first.step_time > plain.step_time
    assert model_index(g).layers[:3] == ["vit.layers.0", "vit.layers.1", "vit.layers.2"]


def test_encoders_first_on_a_model_of_one_stack_is_refused():
    """No encoder to put first: refused in one line, not ignored while the layout line says "encoders-first"."""
    g = two_stack_graph(vit_layers=0)
    cluster, training = preset("h100-sxm", 4), Training(microbatches=8)
    with pytest.raises(OpschedError, match=r"one stack \(lm.layers: 4 layers\); leave encoders_first out"):
        evaluate_layout(g, cluster, training, ParallelLayout.parse("pp=4,encoders_first=1").resolved(4),
                        global_batch=8, micro_batch_size=1, tokens_per_sequence=1024)
