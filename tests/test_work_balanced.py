"""Pipeline splits balanced by work (Megatron-style layouts of a model whose layers differ in work)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.cost.parallel_layout import ParallelLayout
from opsched.cost.pipeline_split import expand_pipeline_layout, work_balanced_layout
from opsched.plan.layout_search import layout_grid, unit_work, work_balanced_variants
from opsched.plan.layouts import layer_chunks, model_index
from test_encoders_first import two_stack_graph


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.floats(0.0, 100.0), min_size=2, max_size=40), st.integers(1, 40))
def test_every_run_is_within_one_unit_of_an_equal_share(work, chunks):
    """The cut keeps the units in order, gives each run one or more, and no run weighs more than an equal share
    of the total plus its heaviest unit (each cut sits within half a unit of its share's boundary)."""
    units = "E" + "t" * (len(work) - 2) + "L"
    runs = work_balanced_layout(units, work, chunks)
    if chunks > len(work):
        assert runs is None
        return
    assert runs is not None and len(runs) == chunks and "".join(runs) == units and all(runs)
    k = 0
    for run in runs:
        weight = sum(work[k:k + len(run)])
        assert weight <= sum(work) / chunks + max(work) + 1e-9 * (1 + sum(work)), (runs, work)
        k += len(run)


def test_light_encoder_layers_share_the_first_chunk_and_each_variant_splits_as_its_string_says():
    g = two_stack_graph(vit_layers=8, lm_layers=8)  # an encoder layer a quarter of a language-model layer
    for b in g:
        if g.nodes[b]["block"].name.startswith("vit/layers"):
            g.nodes[b]["block"] = dataclasses.replace(g.nodes[b]["block"], flops=0.1e12)  # now a fortieth
    index = model_index(g)
    letters, work = unit_work(g, index)
    assert letters == "E" + "t" * 16 + "L" and len(work) == 18
    assert abs(sum(work) - sum(g.nodes[b]["block"].flops for b in g)) < 1e3  # every block counted once
    grid = layout_grid(4, 4, layers=16, experts=0)
    variants = work_balanced_variants(grid, g, index)
    assert variants and all(v.pipeline_layout for v in variants)
    four = [v for v in variants if v.pp * v.vpp == 4]
    assert four
    units = expand_pipeline_layout(four[0].pipeline_layout)
    assert units[0].count("t") >= 8  # the eight light encoder layers and a language-model layer or more
    chunks = layer_chunks(g, 4, index, units=units)
    names = [[g.nodes[b]["block"].name for b in chunk] for chunk in chunks]
    assert all(f"vit/layers.{i}" in names[0] for i in range(8))  # the whole encoder in the first chunk
    assert sum(len(c) for c in chunks) == g.number_of_nodes()
    lm_per_chunk = [sum(1 for n in chunk if n.startswith("lm/layers")) for chunk in names]
    assert max(lm_per_chunk) - min(lm_per_chunk) <= 1  # the language model's layers spread as evenly as whole


def test_a_model_of_equal_layers_gets_no_variant():
    g = two_stack_graph(vit_layers=4, lm_layers=4)
    for b in g:
        if g.nodes[b]["block"].name.startswith("vit/layers"):
            g.nodes[b]["block"] = dataclasses.replace(g.nodes[b]["block"], flops=4e12 + 1e9)  # as heavy as the LM's
    assert work_balanced_variants(layout_grid(4, 4, layers=8, experts=0), g, model_index(g)) == []
    assert work_balanced_variants([ParallelLayout(pp=1)], g, model_index(g)) == []
