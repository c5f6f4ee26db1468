"""Uneven pipeline splits as Megatron-Core writes them: layout strings, first/last rank layers, and the fixes named."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.cost.cluster import Training, preset
from opsched.cost.parallel_layout import ParallelLayout
from opsched.cost.pipeline_split import (chunk_units, compact_pipeline_layout, expand_pipeline_layout,
                                         split_fixes)
from opsched.errors import OpschedError
from opsched.model.coarsen import coarsen
from opsched.model.onnx_import import import_onnx
from opsched.plan.layouts import evaluate_layout, layer_chunks, model_index

MODELS = Path(__file__).resolve().parent.parent / "models"


def megatron_layout(text: str, pp: int):
    """Megatron-Core's own reading of a layout string (None without megatron-core, an optional extra)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    except ImportError:
        return None
    return PipelineParallelLayerLayout(text, pp)


@pytest.mark.parametrize("text, chunks", [
    ("Et|(tt|)*30mL", ("Et",) + ("tt",) * 30 + ("mL",)),
    ("E,t*3|t*4|t,L", ("Ettt", "tttt", "tL")),
    ("Et|((tt|)*2t|)*2L", ("Et", "tt", "tt", "t", "tt", "tt", "t", "L")),  # nested groups
    (" E t | t L ", ("Et", "tL")),
])
def test_layout_strings_expand_to_their_chunks(text, chunks):
    assert expand_pipeline_layout(text) == chunks


@pytest.mark.parametrize("text, words", [
    ("Et|tx|L", "'x' is no layout letter"),
    ("Et|(tt|*2L", "'(' without its ')'"),
    ("Et|tt)|L", "closes no '('"),
    ("Et|t*|L", "'*' needs a whole number"),
    ("", "empty"),
])
def test_a_malformed_layout_string_is_refused_in_one_line(text, words):
    with pytest.raises(OpschedError, match=re.escape(words)) as caught:
        ParallelLayout.parse(f"pp=2,pipeline_layout={text}")
    assert "\n" not in str(caught.value)


def test_the_layout_string_sets_vpp_and_refuses_what_megatron_refuses():
    lay = ParallelLayout.parse("pp=16,pipeline_layout=Et|(tt|)*30mL")
    assert (lay.pp, lay.vpp) == (16, 2) and lay.chunk_units(61, 1)[-1] == "mL"
    assert ParallelLayout.parse("pipeline_layout=E,t*2|tL,pp=2,vpp=1").vpp == 1  # commas inside are cosmetic
    for text, words in [
        ("pp=3,pipeline_layout=Et|tL", "2 chunks, no multiple of pp=3"),
        ("pp=2,vpp=2,pipeline_layout=Et|tL", "vpp=2 but pipeline_layout"),
        ("pp=2,first_layers=1,pipeline_layout=Et|tL", "cannot go with first_layers"),
    ]:
        with pytest.raises(OpschedError, match=words):
            ParallelLayout.parse(text)
    with pytest.raises(OpschedError, match="first_layers / last_layers cannot go with ends_as_layers"):
        ParallelLayout.parse("pp=2,first_layers=1,ends_as_layers=1").resolved(2)


@pytest.mark.parametrize("text, layers, mtp, words", [
    ("pipeline_layout=Et|tt|tL", 5, 0, "places 4 decoder layers"),
    ("pipeline_layout=Et|tt|tmL", 4, 0, "places 1 MTP layers"),
    ("pipeline_layout=tE|tt|tL", 5, 0, "must begin with the embedding"),
    ("pipeline_layout=Et|mt|tL", 3, 1, "decoder layer after an MTP layer"),
    ("pipeline_layout=Ett||ttL", 4, 0, "empty chunk"),
])
def test_a_layout_string_the_model_cannot_take_is_refused(text, layers, mtp, words):
    lay = ParallelLayout.parse(f"pp=4,{text}" if text.count("|") == 3 else f"pp=3,{text}")
    with pytest.raises(OpschedError, match=words):
        lay.chunk_units(layers, mtp)


def test_first_and_last_rank_layers_follow_megatron():
    # Megatron-Core's TransformerConfig: the first rank 2, the last 3, the 14 others (61 - 5) / 14 = 4
    units = chunk_units(layers=61, mtp_layers=0, pp=16, vpp=1, first_layers=2, last_layers=3)
    assert [u.count("t") for u in units] == [2] + [4] * 14 + [3]
    # with vpp the rank's layers split evenly over its chunks, chunk c on rank c mod pp
    units = chunk_units(layers=30, mtp_layers=0, pp=4, vpp=2, first_layers=6, last_layers=8)
    assert [u.count("t") for u in units] == [3, 4, 4, 4, 3, 4, 4, 4]
    assert units[0].startswith("E") and units[-1].endswith("L")
    with pytest.raises(OpschedError, match="no multiple of vpp=2"):
        chunk_units(layers=30, mtp_layers=0, pp=4, vpp=2, first_layers=5, last_layers=8)


def test_the_undivided_deepseek_layout_names_the_fixes_in_one_line():
    with pytest.raises(OpschedError) as caught:
        ParallelLayout.parse("tp=1,pp=16,ep=64,zero=1").chunk_units(61)
    message = str(caught.value)
    assert "\n" not in message and "pp x vpp = 16 x 1 does not divide the 61 layers" in message
    assert "first_layers=2,last_layers=3" in message and "pipeline_layout=" in message


@settings(max_examples=150, deadline=None)
@given(layers=st.integers(1, 80), mtp=st.integers(0, 2), pp=st.integers(1, 16), vpp=st.integers(1, 4))
def test_every_fix_named_splits_the_layers(layers, mtp, pp, vpp):
    """Each fix the refusal names, applied, gives a split with every layer once, each chunk holding a unit."""
    if vpp > 1 and pp < 2:
        return
    for fix in split_fixes(layers, mtp, pp, vpp).removeprefix("fixes: ").split(", or "):
        if fix.startswith("pp x vpp"):
            continue  # another depth: a list, not a setting
        words = fix.split(" (")[0]
        lay = ParallelLayout.parse(f"pp={pp},{words}" if words.startswith("pipeline_layout")
                                   else f"pp={pp},vpp={vpp},{words}")
        units = lay.chunk_units(layers, mtp)
        flat = "".join(units)
        assert len(units) == pp * vpp and all(units)
        assert (flat.count("t"), flat.count("m"), flat[0], flat[-1]) == (layers, mtp, "E", "L")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text("tm", max_size=5), min_size=2, max_size=12))
def test_compact_layout_strings_read_back_the_same_and_megatron_reads_them_so(middle):
    chunks = tuple(["E" + middle[0]] + middle[1:-1] + [middle[-1] + "L"])
    text = compact_pipeline_layout(chunks)
    assert expand_pipeline_layout(text) == chunks
    megatron = megatron_layout(text, len(chunks))
    if megatron is not None:  # Megatron's own parser: one chunk per rank, the same letters in each
        letters = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
        assert tuple("".join(letters[u.name] for u in rank[0]) for rank in megatron.layout) == chunks


@pytest.fixture(scope="module")
def llama():
    return coarsen(import_onnx(MODELS / "llama_7b.onnx"))


def test_an_uneven_layout_reaches_evaluate(llama):
    """Llama 7B's 32 layers as 1 + 15 + 15 + 1 with the ends alone: the chunks hold what the string says."""
    lay = ParallelLayout.parse("pp=4,pipeline_layout=Et|t*15|t*15|tL")
    result = evaluate_layout(llama, preset("h100-sxm", 4), Training(), lay, global_batch=8, micro_batch_size=1,
                             tokens_per_sequence=4096)
    index = model_index(llama)
    layers_of = [sum(index.layer_of[b] is not None for b in c) and len({index.layer_of[b] for b in c} - {None})
                 for c in result.chunks]
    assert layers_of == [1, 15, 15, 1]
    assert result.chunks == layer_chunks(llama, 4, index, units=lay.chunk_units(32))
    busy = [s.time["F"] for s in result.schedule.stage_graph.stages]
    assert busy[1] > 10 * busy[0]  # the middle chunks carry fifteen times the layers
    even = evaluate_layout(llama, preset("h100-sxm", 4), Training(), ParallelLayout.parse("pp=4"), global_batch=8,
                           micro_batch_size=1, tokens_per_sequence=4096)
    assert result.step_time > even.step_time  # the same work, worse balanced


def test_first_and_last_layers_reach_evaluate(llama):
    lay = ParallelLayout.parse("pp=4,first_layers=5,last_layers=9")
    result = evaluate_layout(llama, preset("h100-sxm", 4), Training(), lay, global_batch=8, micro_batch_size=1,
                             tokens_per_sequence=4096)
    index = model_index(llama)
    assert [len({index.layer_of[b] for b in c} - {None}) for c in result.chunks] == [5, 9, 9, 9]
    assert "first_layers=5 last_layers=9" in str(result.layout)


def test_an_evaluated_layout_string_is_what_the_megatron_export_writes(llama):
    """DeepSeek's shape on Llama 7B: pp 2 x vpp 2 with uneven chunks; the export writes a string Megatron reads
    back into the same chunks."""
    from opsched.export.megatron import megatron_args
    from opsched.export.plan_layout import PlanLayout

    lay = ParallelLayout.parse("pp=2,pipeline_layout=Et*7|t*8|t*8|t*9L")
    result = evaluate_layout(llama, preset("h100-sxm", 2), Training(), lay, global_batch=8, micro_batch_size=1,
                             tokens_per_sequence=4096)
    index = model_index(llama)
    counts = tuple(len({index.layer_of[b] for b in c} - {None}) for c in result.chunks)
    assert counts == (7, 8, 8, 9)
    plan = PlanLayout(result.layout, "interleaved", "dp1", "model.layers", counts, ((),) * 4, 1, 8, 8, 4096,
                      "interleaved-1f1b", 2)
    written = {a.flag: a.value for a in megatron_args(plan)}["--pipeline-model-parallel-layout"]
    assert expand_pipeline_layout(written) == lay.chunk_units(32)
    megatron = megatron_layout(written, 2)
    if megatron is not None:
        assert megatron.virtual_pipeline_model_parallel_size == 2
        megatron.validate_layer_layout(num_layers=32, mtp_num_layers=None)
