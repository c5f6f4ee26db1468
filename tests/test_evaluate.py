"""opsched evaluate: a given Megatron-style layout costed by the one cost model and simulator (issue 12 item 1)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from opsched.cli import main
from opsched.cost.cluster import Training, preset
from opsched.model.coarsen import coarsen
from opsched.errors import OpschedError
from opsched.plan.layouts import ParallelLayout, evaluate_layout, layer_chunks, model_index
from opsched.model.onnx_import import import_onnx
from opsched.schedule import device_param_bytes

MODELS = Path(__file__).resolve().parents[1] / "models"


@pytest.fixture(scope="module")
def llama():
    return coarsen(import_onnx(MODELS / "llama_7b.onnx"))


@pytest.fixture(scope="module")
def mixtral():
    return coarsen(import_onnx(MODELS / "mixtral_8x7b.onnx"))


def run(bg, devices, layout, global_batch=64, **kw):
    return evaluate_layout(bg, preset("h100-sxm", devices), Training(), ParallelLayout.parse(layout),
                           global_batch=global_batch, micro_batch_size=1, tokens_per_sequence=4096, **kw)


@pytest.mark.parametrize("text, message", [
    ("tp=2,foo=1", "not KEY=VALUE"),
    ("tp=0", "at least 1"),
    ("tp=2,tp=4", "twice"),
    ("recompute=some", "choose one of none, selective, full"),
    ("attention=flash", "choose one of fused, unfused"),
    ("zero=4", "one of 0, 1, 2, 3"),
    ("tp=x", "whole number"),
])
def test_malformed_layouts_are_refused(text, message):
    with pytest.raises(OpschedError, match=message):
        ParallelLayout.parse(text)


@pytest.mark.parametrize("text, devices, message", [
    ("tp=3", 8, "not the 8 devices"),
    ("tp=2,pp=2,dp=4", 8, "= 16, not the 8 devices"),
    ("pp=1,vpp=2", 8, "vpp > 1 needs pp >= 2"),
    ("ep=3", 8, "must divide tp x cp x dp = 1 x 1 x 8 = 8"),
    ("tp=2,etp=4", 8, "etp=4 must divide tp x cp = 2"),
    ("tp=2,cp=3", 8, "tp x pp x cp x dp = 2 x 1 x 3 x 1 = 6, not the 8"),
])
def test_layouts_that_do_not_match_the_devices_are_refused(text, devices, message):
    with pytest.raises(OpschedError, match=message):
        ParallelLayout.parse(text).resolved(devices)


@pytest.mark.parametrize("layout, schedule, fix", [("pp=2", "dualpipev", "set vpp=2 for dualpipev"),
                                                    ("pp=2,vpp=2", "dualpipe", "set vpp=1 for dualpipe"),
                                                    ("pp=2", "interleaved-1f1b", "set vpp=2 for interleaved-1f1b")])
def test_a_schedule_that_regroups_the_chunks_says_the_vpp_it_runs(llama, layout, schedule, fix):
    """Before, the refusal only named other schedules, not the vpp that runs the one asked for."""
    with pytest.raises(OpschedError, match=fix):
        run(llama, 8, layout, schedule=schedule)


def test_the_json_layout_says_the_expert_tensor_parallel_size_costed(mixtral):
    """etp left out is tp (Megatron's default): --json said "etp": 0, a size no layout has."""
    layout = run(mixtral, 16, "tp=2,pp=1,ep=8").to_dict()["layout"]
    assert (layout["tp"], layout["ep"], layout["etp"]) == (2, 8, 2)
    assert run(mixtral, 16, "tp=2,pp=1,ep=8,etp=1").to_dict()["layout"]["etp"] == 1


def test_context_parallel_needs_a_sequence_of_two_cp_equal_chunks(llama):
    """seq 777 over cp=2: Megatron and torchtitan cut a sequence into 2 x cp chunks; before, evaluate costed it."""
    with pytest.raises(OpschedError, match="777 tokens does not split into 2 x cp = 4 equal chunks"):
        evaluate_layout(llama, preset("h100-sxm", 8), Training(), ParallelLayout.parse("tp=1,pp=2,cp=2"),
                        global_batch=64, micro_batch_size=1, tokens_per_sequence=777)


def test_layouts_the_model_cannot_take_are_refused(llama, mixtral):
    with pytest.raises(OpschedError, match="no experts"):
        run(llama, 8, "ep=2")
    # the expert layers' keys on a dense model: refused like ep, not ignored while the layout line shows them
    with pytest.raises(OpschedError, match="etp=1, max_nodes=2 but the model has no experts; leave etp and max_nodes"):
        run(llama, 8, "tp=2,etp=1,max_nodes=2")
    with pytest.raises(OpschedError, match="does not divide the 8 experts"):
        run(mixtral, 48, "pp=4,ep=3,dp=12", global_batch=48)
    with pytest.raises(OpschedError, match="does not divide the 32 layers"):
        run(llama, 8, "pp=2,vpp=3")


def test_layers_split_evenly_with_embedding_first_and_head_last(llama):
    assert len(model_index(llama).layers) == 32 and model_index(llama).experts == 0
    chunks = layer_chunks(llama, 8)
    names = [[llama.nodes[b]["block"].name for b in c] for c in chunks]
    assert all(sum("layers." in n for n in c) == 4 for c in names)
    ops_of = [[op for b in c for op in llama.nodes[b]["block"].ops] for c in chunks]
    assert any("embed_tokens" in op for op in ops_of[0]) and any("lm_head" in op for op in ops_of[-1])
    assert sum(len(c) for c in chunks) == llama.number_of_nodes()


def test_mixtral_has_eight_experts_per_layer(mixtral):
    assert model_index(mixtral).experts == 8 and len(model_index(mixtral).layers) == 32


def test_each_setting_moves_time_and_memory_the_right_way(llama):
    base = run(llama, 8, "tp=1,pp=2")
    zero1 = run(llama, 8, "tp=1,pp=2,zero=1")
    zero3 = run(llama, 8, "tp=1,pp=2,zero=3")
    full = run(llama, 8, "tp=1,pp=2,recompute=full")
    tp2 = run(llama, 8, "tp=2,pp=2")
    # ZeRO shards optimizer state (then gradients, weights) over the 4 replicas: less memory each time
    assert base.peak_memory_bytes > zero1.peak_memory_bytes > zero3.peak_memory_bytes
    assert zero3.step_time > zero1.step_time  # FSDP gathers the weights in every pass
    # full recomputation keeps only layer inputs and runs the forward again
    assert full.peak_memory_bytes < base.peak_memory_bytes and full.step_time > base.step_time
    assert full.mfu < base.mfu  # model FLOPs leave the recomputed forward out
    # tensor parallelism adds its all-reduces: the same work on 2 devices takes more than half the time
    assert tp2.breakdown["compute_and_exposed_parallel_comm"] > 0.5 * 2 * base.breakdown["compute_and_exposed_parallel_comm"] / 2
    for e in (base, zero1, zero3, full, tp2):
        # nothing beats the cost model's fastest compute rate, its matmuls'
        c = preset("h100-sxm")
        assert 0 < e.mfu < max(c.matmul_efficiency.values(), default=c.efficiency)
        assert e.step_time == pytest.approx(sum(e.breakdown.values()), rel=1e-9)


def test_expert_parallel_shards_the_experts_and_pays_all_to_alls(mixtral):
    no_ep = run(mixtral, 64, "pp=4,vpp=8,zero=1", global_batch=256)
    ep8 = run(mixtral, 64, "pp=4,vpp=8,ep=8,zero=1", global_batch=256)
    params = [max(device_param_bytes(e.schedule.stage_graph)) for e in (no_ep, ep8)]
    assert params[1] < 0.3 * params[0]  # 45 of Mixtral's 47 B parameters are experts, 1/8 of them held
    busy = "compute_and_exposed_parallel_comm"
    assert ep8.breakdown[busy] > no_ep.breakdown[busy]  # the token all-to-alls
    # but each expert's gradients are reduced over 2 replicas, not 16: far less sync left exposed
    assert ep8.breakdown["exposed_gradient_sync"] < no_ep.breakdown["exposed_gradient_sync"]
    assert ep8.microbatches == 256 // 16 and ep8.fits


def test_bf16_optimizer_state_lowers_memory_by_six_bytes_per_parameter_held(llama):
    """Each device of pp2 x dp4 with ZeRO-1 holds its rank's parameters at 2 + 2 + 12/4 bytes in FP32 state and
    2 + 2 + 6/4 in BF16 state; the activations and the pipeline are the same."""
    layout = ParallelLayout.parse("tp=1,pp=2,zero=1")
    fp32, bf16 = (evaluate_layout(llama, preset("h100-sxm", 8), Training(optimizer_state=state), layout,
                                  global_batch=64, micro_batch_size=1, tokens_per_sequence=4096)
                  for state in ("fp32", "bf16"))
    held = [device_param_bytes(e.schedule.stage_graph) for e in (fp32, bf16)]
    assert held[1] == pytest.approx([b * (2 + 2 + 6 / 4) / (2 + 2 + 12 / 4) for b in held[0]])
    saved = [a - b for a, b in zip(*held)]  # the peak device saves what it holds less
    assert min(saved) * (1 - 1e-9) <= fp32.peak_memory_bytes - bf16.peak_memory_bytes <= max(saved) * (1 + 1e-9)
    # the Adam step moves 18 bytes per parameter updated, not 28; nothing else changes
    assert bf16.breakdown["optimizer_step"] == pytest.approx(fp32.breakdown["optimizer_step"] * 18 / 28)
    assert bf16.step_time < fp32.step_time


def test_command_refuses_recompute_modules_the_model_has_none_of(capsys):
    """mla_up_proj on Llama (no multi-latent attention): before, costed as nothing and the step printed as if
    recomputed; Megatron-Core refuses it."""
    assert main(["evaluate", str(MODELS / "llama_7b.onnx"), "--devices", "8", "--layout",
                 "tp=2,pp=2,recompute_modules=layernorm+mla_up_proj", "--seq-len", "2048", "--global-batch", "32",
                 "-q"]) == 2
    err = capsys.readouterr().err
    assert "recompute_modules names mla_up_proj, but opsched finds no operators of it" in err, err


def test_command_prints_json_and_refuses_bad_input_before_the_import(tmp_path, capsys):
    code = main(["evaluate", str(MODELS / "llama_7b.onnx"), "--devices", "8", "--layout", "tp=2,pp=2,zero=1",
                 "--seq-len", "2048", "--global-batch", "32", "--json", "-q"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("step_time", "tokens_per_second_per_device", "mfu", "peak_memory_bytes", "fits", "breakdown"):
        assert key in doc
    assert doc["seq_len"] == 2048 and doc["microbatches"] == 16 and doc["layout"]["dp"] == 2
    assert doc["optimizer_state"] == "fp32"
    assert main(["evaluate", str(MODELS / "llama_7b.onnx"), "--devices", "8", "--layout", "tp=2,pp=2,zero=1",
                 "--seq-len", "2048", "--global-batch", "32", "--optimizer-state", "bf16", "--json", "-q"]) == 0
    lighter = json.loads(capsys.readouterr().out)
    assert lighter["optimizer_state"] == "bf16" and lighter["peak_memory_bytes"] < doc["peak_memory_bytes"]
    assert main(["evaluate", str(tmp_path / "missing.onnx"), "--devices", "8", "--layout", "tp=2",
                 "--global-batch", "8", "--optimizer-state", "fp8"]) == 2
    assert "--optimizer-state: invalid choice: 'fp8'" in capsys.readouterr().err
    # a layout that does not match the devices is found before the (missing) model is read
    assert main(["evaluate", str(tmp_path / "missing.onnx"), "--devices", "8", "--layout", "tp=3",
                 "--global-batch", "8"]) == 2
    assert "not the 8 devices" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "missing.onnx"), "--devices", "8", "--layout", "tp=2",
                 "--global-batch", "6"]) == 2
    assert "not a multiple of dp x --micro-batch-size = 4 x 1" in capsys.readouterr().err


def test_layout_search_prunes_without_losing_the_best(llama):
    """Skipping layouts whose busiest rank's work alone cannot win never changes the best layout found."""
    from opsched.plan.layout_search import layout_grid, search_layouts

    c = preset("h100-sxm", 8)
    pruned = search_layouts(llama, c, Training(), global_batch=32, tokens_per_sequence=4096)
    every = search_layouts(llama, c, Training(), global_batch=32, tokens_per_sequence=4096, keep=1000)
    assert len(pruned) == 1 and len(every) > 5
    assert pruned[0].step_time == every[0].step_time and str(pruned[0].layout) == str(every[0].layout)
    assert all(e.fits for e in every)
    assert [e.step_time for e in every] == sorted(e.step_time for e in every)
    grid = {str(l) for l in layout_grid(8, 8, layers=32, experts=0)}
    assert "tp1 pp4 vpp8 dp2 zero1" in grid and "tp8 pp1 dp1 sp zero1" in grid


def test_the_layout_grid_tries_every_virtual_pipeline_degree_that_divides_not_only_powers_of_two():
    """Megatron takes any vpp dividing the layers per rank: Mixtral-8x22B's published TP2 PP8 VPP7 EP8 on 128
    devices (56 layers, one a chunk; benchmarks/bench_published.py row 40) is in the grid, and no vpp that does
    not divide the layers per rank is."""
    from opsched.plan.layout_search import layout_grid

    grid = layout_grid(128, 8, layers=56, experts=8)
    assert "tp2 pp8 vpp7 ep8 dp8 sp zero1" in {str(lay) for lay in grid}
    assert all(56 % (lay.pp * lay.vpp) == 0 for lay in grid if not lay.pipeline_layout)
    assert {lay.vpp for lay in grid if lay.pp == 2} == {1, 2, 4, 7}
    # a pp dividing no layer count is split unevenly (a layout string), and only such a pp
    assert {lay.pp for lay in grid if lay.pipeline_layout} == {16}


def test_layout_search_with_tp_comm_overlap_overlaps_every_tensor_parallel_layout_and_is_never_slower(llama):
    """``Training.tp_comm_overlap`` (`plan --tp-comm-overlap on`): every layout with tp > 1 is evaluated with
    Megatron's --tp-comm-overlap, each exactly as `evaluate --layout ...,tp_overlap=1` gives it, none slower than
    without, and the tp = 1 layouts unchanged."""
    from opsched.plan.layout_search import search_layouts

    c = preset("h100-sxm", 8)
    kw = dict(global_batch=32, tokens_per_sequence=4096, keep=1000)
    exposed = {str(e.layout): e for e in search_layouts(llama, c, Training(), **kw)}
    hidden = search_layouts(llama, c, Training(tp_comm_overlap=True), **kw)
    assert {e.layout.tp_overlap for e in hidden} == {True, False}
    for e in hidden:
        assert e.layout.tp_overlap == (e.layout.tp > 1)
        before = exposed[str(e.layout).replace(" tp-overlap", "")]
        assert e.step_time <= before.step_time and (e.layout.tp > 1 or e.step_time == before.step_time)
    assert min(e.step_time for e in hidden if e.layout.tp > 1) < min(e.step_time for e in exposed.values()
                                                                     if e.layout.tp > 1)
    best = min((e for e in hidden if e.layout.tp > 1), key=lambda e: e.step_time)
    same = evaluate_layout(llama, c, Training(), best.layout, global_batch=32, micro_batch_size=1,
                           tokens_per_sequence=4096)  # the layout as given: the training's flag is not needed
    assert same.step_time == pytest.approx(best.step_time)


@pytest.mark.parametrize("devices, global_batch", [(8, 32), (16, 16), pytest.param(32, 64, marks=pytest.mark.slow)])
def test_the_layout_floor_is_below_every_evaluated_step_and_the_best_first_search_finds_the_best(llama, devices,
                                                                                               global_batch):
    """:func:`layout_floor` (what the search ranks and prunes by, without simulating) is never above the step
    :func:`evaluate_layout` gives the layout, with any recomputation, pipelines of 1 to 32 ranks and interleaving;
    so the best-first search returns the fastest of all the layouts."""
    from opsched.plan.layout_search import search_layouts
    from opsched.plan.layouts import _held_param_bytes, layout_floor

    c = preset("h100-sxm", devices)
    every = search_layouts(llama, c, Training(), global_batch=global_batch, tokens_per_sequence=4096, keep=10_000,
                           recompute=("none",))
    assert len({e.layout.pp for e in every}) >= 3
    for e in every:
        for mode in ("none", "selective", "full"):
            lay = dataclasses.replace(e.layout, recompute=mode)
            evaluated = evaluate_layout(llama, c, Training(), lay, global_batch=global_batch, micro_batch_size=1,
                                        tokens_per_sequence=4096)
            for whole_sync, step in ((False, evaluated.step_time), (True, evaluated.planner_step)):
                floor = layout_floor(llama, c, Training(), lay, global_batch=global_batch, micro_batch_size=1,
                                     memory_limit=1e30, whole_sync=whole_sync)
                assert floor <= step * (1 + 1e-12), (str(lay), whole_sync, floor, step)
        # the floor's memory check counts each rank's parameter state as the costed stages hold it
        chunks = layer_chunks(llama, e.layout.pp * e.layout.vpp, model_index(llama), e.layout.ends_as_layers)
        from opsched.plan.chunk_cost import chunk_classes
        classes = [chunk_classes(model_index(llama), members) for members in chunks]
        held = _held_param_bytes(llama, model_index(llama), classes, e.layout.resolved(devices), Training())
        sg = e.schedule.stage_graph
        assert held == pytest.approx([sum(s.param_bytes for s in sg.stages if s.devices == (r,))
                                      for r in range(e.layout.pp)])
    fits = search_layouts(llama, c, Training(), global_batch=global_batch, tokens_per_sequence=4096, keep=10_000)
    best = search_layouts(llama, c, Training(), global_batch=global_batch, tokens_per_sequence=4096)
    assert best[0].step_time == fits[0].step_time and str(best[0].layout) == str(fits[0].layout)
    # ranked as the planner counts a step (the whole sync, no optimizer step): the fastest by that count
    planned = search_layouts(llama, c, Training(), global_batch=global_batch, tokens_per_sequence=4096,
                             whole_sync=True)
    assert planned[0].planner_step == pytest.approx(min(e.planner_step for e in fits), rel=1e-9)


def test_a_layout_over_memory_is_refused_from_its_order_with_the_simulated_peak(llama):
    """``memory_first``: the peak of Megatron's schedules follows from each rank's order, so a layout over the
    limit is not timed, and that peak equals the simulated one; every layout under it is evaluated as before."""
    from opsched.plan.layout_search import layout_grid

    c = preset("h100-sxm", 8)
    limit = 30 * 2**30
    untimed = 0
    for lay in layout_grid(8, 8, layers=32, experts=0):
        for mode in ("none", "full"):
            kw = dict(global_batch=32, micro_batch_size=1, tokens_per_sequence=4096, memory_limit=limit)
            lay = dataclasses.replace(lay, recompute=mode)
            timed = evaluate_layout(llama, c, Training(), lay, **kw)
            quick = evaluate_layout(llama, c, Training(), lay, memory_first=True, **kw)
            assert quick.fits == timed.fits and quick.peak_memory_bytes == pytest.approx(timed.peak_memory_bytes)
            if quick.fits:
                assert quick.step_time == timed.step_time
            else:
                untimed += 1
                assert quick.step_time == float("inf") and not quick.schedule.events
    assert untimed >= 3


def test_layout_search_keeps_only_accepted_layouts_and_still_the_fastest_of_them(llama):
    """``accept`` (a runtime that cannot run a layout, for `plan --runtime`) leaves layouts out before pruning
    against them, so the result is the fastest accepted layout, as the unpruned search ranks them."""
    from opsched.plan.layout_search import search_layouts

    c = preset("h100-sxm", 8)
    every = search_layouts(llama, c, Training(), global_batch=32, tokens_per_sequence=4096, keep=1000)
    banned = str(every[0].layout)  # the fastest layout, refused
    best = search_layouts(llama, c, Training(), global_batch=32, tokens_per_sequence=4096,
                          accept=lambda e: str(e.layout) != banned)
    assert len(best) == 1 and str(best[0].layout) == str(every[1].layout) != banned


def test_layout_search_at_least_matches_mixtrals_published_layout(mixtral):
    """Megatron-Core's Mixtral run (TP1 EP8 PP4 VPP8 on 64 H100, GBS 256): the search the planner runs (ranked as
    it counts a step: the whole gradient sync) finds a layout no slower than that one, and keeps the experts
    spread over devices (since DualPipe joined the search its best is DualPipe on tp4 pp2 ep8). Ranked by evaluate's step time instead, the
    search returned PP2 x DP32, slower on the planner's count: its 32 replicas sync more."""
    from opsched.plan.layout_search import search_layouts

    bg = coarsen(import_onnx(MODELS / "mixtral_8x7b.onnx", dims={"batch": 1, "seq": 4096}))
    cluster = preset("h100-sxm", 64)
    published = evaluate_layout(bg, cluster, Training(), ParallelLayout.parse("tp=1,pp=4,vpp=8,ep=8,zero=1"),
                                global_batch=256, micro_batch_size=1, tokens_per_sequence=4096)
    planned = search_layouts(bg, cluster, Training(), global_batch=256, tokens_per_sequence=4096, whole_sync=True)
    assert published.fits and planned[0].fits
    assert planned[0].planner_step <= published.planner_step
    assert planned[0].layout.ep > 1


def test_layout_search_on_fewer_devices_never_loses_to_the_search_on_all(llama):
    """With ``fewer_devices`` the best layout is at least as fast as the best on every device, and as the best on
    half of them: devices may idle, so adding them never makes the plan slower."""
    from opsched.plan.layout_search import search_layouts

    def best(devices, global_batch, fewer):
        found = search_layouts(llama, preset("h100-sxm", devices), Training(), global_batch=global_batch,
                               tokens_per_sequence=4096, fewer_devices=fewer)
        return found[0] if found else None

    # one sequence per step on 128 H100s: no replicas, tp stays within a node, so every device means a
    # 16-stage pipeline; 8 stages on half the devices are faster (fewer transfers in a microbatch's path)
    on_128, on_64 = best(128, 1, fewer=True), best(64, 1, fewer=True)
    on_all = best(128, 1, fewer=False)
    assert on_all.layout.devices == 128 and on_128.layout.devices < 128
    assert on_128.step_time < on_all.step_time and on_128.step_time <= on_64.step_time


def test_import_marks_the_residual_stream_and_the_attention_keys_and_values(llama):
    """Per Llama layer the tensors kept whole on every tensor rank are the 2 norms' inputs and outputs (row-parallel
    outputs and residual adds are written whole, but their backward reads neither)."""
    hidden = 4096 * 4096 * 2  # one [seq, d] bf16 activation
    layers = [llama.nodes[b]["block"] for b in model_index(llama).order if "layers." in llama.nodes[b]["block"].name]
    assert len(layers) == 32
    for block in layers[1:-1]:  # the first holds the embedding too, the last the final norm
        assert block.tp_replicated_bytes == 4 * hidden  # Korthikanti's "10 sbh" counts dropout masks we do not have
        assert block.attention_kv_bytes == 2 * hidden  # 32 key and 32 value heads of 128
        assert block.tp_replicated_bytes < block.saved_bytes < block.output_bytes


def test_selective_recomputation_repeats_the_attention_core(llama):
    base, selective, full = (run(llama, 8, f"tp=1,pp=2,recompute={r}") for r in ("none", "selective", "full"))
    assert base.step_time < selective.step_time < full.step_time
    assert selective.mfu < base.mfu  # the recomputed attention is not model FLOPs
    # the fused Attention stores no scores: selective keeps what no recomputation keeps
    assert selective.peak_memory_bytes == base.peak_memory_bytes > full.peak_memory_bytes


def test_unfused_attention_costs_time_and_keeps_its_scores_until_recomputed(llama):
    """attention=unfused (Megatron-LM before FlashAttention): every pass is longer; without recomputation each
    layer keeps 5 bytes a score, so at least the first pipeline rank's layers' scores of one microbatch show."""
    assert str(ParallelLayout.parse("tp=2,pp=1,attention=unfused").resolved(2)) == "tp2 pp1 dp1 attention=unfused"
    for recompute in ("none", "selective", "full"):
        fused = run(llama, 8, f"tp=1,pp=2,recompute={recompute}")
        unfused = run(llama, 8, f"tp=1,pp=2,recompute={recompute},attention=unfused")
        assert unfused.step_time > fused.step_time and unfused.mfu < fused.mfu
        if recompute == "none":
            scores = 32 * 4096 * 4096  # heads x s x s of one sequence
            assert unfused.peak_memory_bytes >= fused.peak_memory_bytes + 16 * 5 * scores
        else:
            assert unfused.peak_memory_bytes == fused.peak_memory_bytes


def test_sequence_parallelism_saves_activation_memory_not_time(llama):
    plain, sp = run(llama, 8, "tp=2,pp=2"), run(llama, 8, "tp=2,pp=2,sp=1")
    assert sp.step_time == plain.step_time
    assert sp.peak_memory_bytes < plain.peak_memory_bytes
    # and nothing to split without tensor parallelism
    assert run(llama, 8, "tp=1,pp=2,sp=1").peak_memory_bytes == run(llama, 8, "tp=1,pp=2").peak_memory_bytes


def test_context_parallelism_splits_each_sequence_and_passes_keys_and_values_round(llama):
    alone = run(llama, 4, "tp=1,pp=2")  # dp 2
    cp2 = run(llama, 8, "tp=1,pp=2,cp=2")  # dp 2 as well: the same microbatches, each sequence split in two
    assert cp2.layout.dp == 2 and cp2.microbatches == alone.microbatches
    assert 0.45 < cp2.step_time / alone.step_time < 0.6
    assert cp2.peak_memory_bytes < alone.peak_memory_bytes  # activations halved, weights the same
    assert "context_comm" not in alone.breakdown and cp2.breakdown["context_comm"] >= 0.0
    # eight context ranks strided over two nodes: the ring crosses the slow link and far outlasts the attention
    wide = run(llama, 16, "tp=2,pp=1,cp=8")
    assert wide.breakdown["context_comm"] > 10 * cp2.breakdown["context_comm"]
    assert wide.breakdown["context_comm"] > 0.2 * wide.step_time
    for e in (cp2, wide):
        assert e.step_time == pytest.approx(sum(e.breakdown.values()), rel=1e-9)


def test_selective_recomputation_drops_the_scores_of_attention_written_as_operators():
    from helpers import real_export

    bg = coarsen(import_onnx(real_export("deepseek_lm_2L_sh1_r4.dynamo.onnx")))
    scores = sum(bg.nodes[b]["block"].attention_scores_bytes for b in bg)

    def evaluate(recompute):
        return evaluate_layout(bg, preset("h100-sxm", 2), Training(), ParallelLayout(pp=2, recompute=recompute),
                               global_batch=4, micro_batch_size=1, tokens_per_sequence=8)

    none, selective, full = evaluate("none"), evaluate("selective"), evaluate("full")
    stored = [sum(s.act_bytes for s in e.schedule.stage_graph.stages) for e in (none, selective, full)]
    assert scores > 0 and stored[0] - stored[1] == pytest.approx(scores)  # one microbatch's scores, no more
    assert stored[1] > stored[2]
    assert none.step_time < selective.step_time < full.step_time


@pytest.mark.parametrize("layout, message", [
    ("tp=2,cp=3", "tp x pp x cp x dp = 2 x 1 x 3 x 1 = 6, not the 8 devices"),
    ("cp=2,ep=3", "ep x etp = 3 x 1 must divide tp x cp x dp"),
])
def test_command_refuses_context_parallel_layouts_it_cannot_cost_before_the_import(tmp_path, capsys, layout, message):
    assert main(["evaluate", str(tmp_path / "missing.onnx"), "--devices", "8", "--layout", layout,
                 "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_layout_search_keeps_the_cheapest_recomputation_that_fits(llama, monkeypatch):
    """Each layout tries none, selective, then full recomputation and keeps the first that fits."""
    import opsched.plan.layout_search as ev

    real = ev.evaluate_layout
    memory = {"none": 3.0, "selective": 2.0, "full": 1.0}  # what each setting needs, in units of the limit below

    def stub(bg, cluster, training, layout, **kw):
        e = real(bg, cluster, training, layout, **kw)
        return dataclasses.replace(e, peak_memory_bytes=memory[layout.recompute] * e.memory_limit / 2.5)

    real_floor = ev.layout_floor

    def floor(*a, **kw):  # the stub's peaks are not the stages' activations: no setting is skipped as storing no less
        return real_floor(*a, **{**kw, "than": None})

    monkeypatch.setattr(ev, "evaluate_layout", stub)
    monkeypatch.setattr(ev, "layout_floor", floor)
    found = ev.search_layouts(llama, preset("h100-sxm", 8), Training(), global_batch=32, tokens_per_sequence=4096,
                              keep=1000)
    assert found and all(e.layout.recompute == "selective" for e in found)
    memory["selective"] = 2.6  # selective no longer fits: full is next
    found = ev.search_layouts(llama, preset("h100-sxm", 8), Training(), global_batch=32, tokens_per_sequence=4096)
    assert found[0].layout.recompute == "full"


def test_a_recomputation_that_stores_no_less_than_one_that_overflowed_is_not_simulated(llama, monkeypatch):
    """Megatron's schedules run a fixed order per rank, so a setting whose stages hold no fewer activations peaks
    the same: with a fused attention (no stored scores) selective holds what none holds, so where none overflows
    the search goes straight to full, and finds what simulating selective too would."""
    import opsched.plan.layout_search as ev

    c = preset("h100-sxm", 8)
    tried = []
    real = ev.evaluate_layout

    def spy(bg, cluster, training, layout, **kw):
        tried.append(layout.recompute)
        return real(bg, cluster, training, layout, **kw)

    limit = 24 * 2**30  # none overflows on most layouts
    monkeypatch.setattr(ev, "evaluate_layout", spy)
    found = ev.search_layouts(llama, c, Training(), global_batch=32, tokens_per_sequence=4096, memory_limit=limit,
                              keep=1000)
    assert "selective" not in tried and "full" in tried and found
    for e in found[:3]:  # simulated with each setting in turn, the first that fits is the one kept
        for mode in ("none", "selective", "full"):
            lay = dataclasses.replace(e.layout, recompute=mode)
            if real(llama, c, Training(), lay, global_batch=32, micro_batch_size=1, tokens_per_sequence=4096,
                    memory_limit=limit).fits:
                break
        assert mode == e.layout.recompute


# --------------------------------------------------------------------------- context parallelism in the search


def test_the_layout_grid_tries_context_parallelism_on_long_sequences_only():
    """cp 2, 4, 8 from 8192 tokens, within a node with tp, dividing a pipeline rank's devices; none with ep."""
    from opsched.plan.layout_search import CP_MIN_SEQ_LEN, layout_grid

    short = layout_grid(16, 8, layers=32, experts=0, seq_len=CP_MIN_SEQ_LEN - 1)
    assert short and all(l.cp == 1 for l in short)
    long = layout_grid(16, 8, layers=32, experts=0, seq_len=65536)
    cps = {l.cp for l in long}
    assert cps == {1, 2, 4, 8}
    assert all(l.tp * l.cp <= 8 and l.devices == 16 for l in long)
    assert {str(l) for l in long} >= {"tp1 pp1 cp8 dp2 zero1", "tp2 pp1 cp4 dp2 sp zero1", "tp1 pp2 cp2 dp4 zero1"}
    assert not any(l.tp == 4 and l.cp == 4 for l in long)  # 16 ranks would split a sequence across two nodes
    assert all(l.cp == 1 for l in layout_grid(16, 8, layers=32, experts=8, seq_len=65536) if l.ep > 1)


@pytest.fixture(scope="module")
def llama3_64k():
    return coarsen(import_onnx(MODELS / "llama3_8b.onnx", dims={"batch": 1, "seq": 65536}))


def test_the_search_picks_context_parallelism_for_a_64k_sequence(llama3_64k):
    """Llama 3 8B, 64K tokens, global batch 4 on 8 H100s: the fastest layout that fits splits the sequence."""
    from opsched.plan.layout_search import search_layouts

    best, *rest = search_layouts(llama3_64k, preset("h100-sxm", 8), Training(), global_batch=4,
                                 tokens_per_sequence=65536, keep=50)
    assert best.layout.cp > 1 and best.fits
    plain = [e for e in rest if e.layout.cp == 1]
    assert plain and best.step_time < min(e.step_time for e in plain)  # strictly: a cp layout wins
    assert best.breakdown["context_comm"] >= 0.0


def test_a_context_parallel_layout_round_trips_through_plan_json(llama3_64k, tmp_path):
    """The layout's baseline row names its stages tp.cp.dp; plan.json's fields read back to the same cp."""
    from opsched.plan.policy import layout_row
    from opsched.export.megatron import MEGATRON, megatron_args
    from opsched.export.plan_json import read_plan, write_plan
    from opsched.export.plan_layout import plan_layout
    from opsched.export.runtimes import layout_fields, refusal

    cluster = preset("h100-sxm", 8)
    layout = ParallelLayout.parse("tp=2,cp=2,sp=1,zero=1,recompute=full").resolved(8)
    e = evaluate_layout(llama3_64k, cluster, Training(), layout, global_batch=4, micro_batch_size=1,
                        tokens_per_sequence=65536)
    row = layout_row(e, llama3_64k, cluster, 0.0)
    assert "cp2" in row.layout
    assert {c.config for c in row.contents.values()} == {"tp2.cp2.dp2"}
    fields = layout_fields(row.contents, row.microbatch_size, layout.zero, row.recompute) | {"dims": {"seq": 65536}}
    write_plan(tmp_path / "plan.json", row.schedule, extra=fields)
    schedule, doc = read_plan(tmp_path / "plan.json")
    read = plan_layout(schedule, doc, MEGATRON)
    assert read.parallel == dataclasses.replace(layout, etp=0)
    assert ("--context-parallel-size", "2") in [(a.flag, a.value) for a in megatron_args(read)]
    assert "context-parallel ranks (tp2.cp2.dp2)" in refusal("torch", schedule, doc)


def test_dualpipev_hides_the_expert_all_to_alls_of_another_microbatch_in_its_pairs(mixtral):
    """DualPipeV's F&B pairs on an ep8 layout: timed from the chunks' stream operations, they hide part of the
    all-to-alls, which makes DualPipeV beat ZB-V at 32 microbatches per pipeline (5.58 s against 5.63 s; at 16,
    on 64 devices, ZB-V's shorter warm-up wins); a runtime that does not overlap pairs (torch) gets no gain."""
    layout = "pp=4,vpp=2,ep=8,zero=1"
    overlapped = run(mixtral, 32, layout, global_batch=256, schedule="dualpipev")
    sequential = evaluate_layout(mixtral, preset("h100-sxm", 32), Training(overlap_pairs=False),
                                 ParallelLayout.parse(layout), global_batch=256, micro_batch_size=1,
                                 tokens_per_sequence=4096, schedule="dualpipev")
    zb_v = run(mixtral, 32, layout, global_batch=256, schedule="zb-v")
    assert any(s.streams is not None for s in overlapped.schedule.stage_graph.stages)
    assert overlapped.step_time < zb_v.step_time < sequential.step_time


def test_ends_as_layers_gives_the_first_and_last_chunks_one_layer_fewer(llama):
    """32 layers + embedding + head = 34 units over 2 chunks: 16 layers, then 16 (a layer each end gives way);
    over 17 chunks of 2 units: the first and last chunks hold one layer, the others two."""
    layout = ParallelLayout.parse("pp=2,ends_as_layers=1")
    assert layout.ends_as_layers and "ends-as-layers" in str(layout.resolved(2))
    chunks = layer_chunks(llama, 17, ends_as_layers=True)
    per_chunk = [sum("layers." in llama.nodes[b]["block"].name for b in c) for c in chunks]
    assert per_chunk == [1] + [2] * 15 + [1]
    assert sum(len(c) for c in chunks) == llama.number_of_nodes()
    with pytest.raises(OpschedError, match="does not divide the 32 layers \\+ embedding \\+ head"):
        run(llama, 8, "pp=8,ends_as_layers=1")
    assert run(llama, 17, "pp=17,ends_as_layers=1", global_batch=17).chunks == chunks  # evaluate splits the same way
    with pytest.raises(OpschedError, match="ends_as_layers=2: 0 or 1"):
        ParallelLayout.parse("ends_as_layers=2")


def test_tp_comm_overlap_hides_the_tensor_parallel_collectives_up_to_the_compute(llama):
    """Megatron's --tp-comm-overlap: each pass takes max(compute, tensor-parallel communication), never more than
    without it, and the layout needs tp > 1 with sequence parallelism."""
    plain = run(llama, 8, "tp=8,sp=1,zero=1")
    overlapped = run(llama, 8, "tp=8,sp=1,zero=1,tp_overlap=1")
    assert overlapped.step_time < plain.step_time
    assert overlapped.peak_memory_bytes == plain.peak_memory_bytes
    for text in ("tp=1,tp_overlap=1", "tp=2,tp_overlap=1"):
        with pytest.raises(OpschedError, match="needs tp > 1 and sp=1"):
            ParallelLayout.parse(text).resolved(8 if "tp=1" in text else 2)


def test_the_layout_grid_counts_the_ends_as_layers_where_no_depth_divides_the_layers():
    """BLOOM-176B's 70 layers on 384 devices (3 x 128): no pp dividing 70 takes the factor 3, so only the
    depths that count the embedding and the head as layers (72 units) use every device with dp a power of 2
    (a global batch of 2048 needs that) beside the uneven splits (layout strings) of the depths no even split
    takes; the published tp4 pp12 is one of them."""
    from opsched.plan.layout_search import layout_grid

    grid = layout_grid(384, 8, layers=70, experts=0)
    assert "tp4 pp12 dp8 sp zero1 ends-as-layers" in {str(l) for l in grid}
    whole_batch = [l for l in grid if 2048 % l.dp == 0]
    assert whole_batch and all(l.ends_as_layers or l.pipeline_layout for l in whole_batch)
    assert all(l.devices == 384 and (70 + 2 * l.ends_as_layers) % (l.pp * l.vpp) == 0 for l in grid
               if not l.pipeline_layout)
    assert all(70 % l.pp and 72 % l.pp for l in grid if l.pipeline_layout)
    assert {l.pp for l in grid if l.pipeline_layout} == {16, 32}  # 16 x vpp 2 and 32 chunks: 2 units or more each
    assert not any(l.ends_as_layers and 70 % l.pp == 0 for l in grid)  # a depth dividing the layers: as before
    assert not any(l.ends_as_layers for l in layout_grid(8, 8, layers=32, experts=0))


def test_layout_search_past_its_deadline_skips_the_layouts_not_yet_tried(llama, caplog):
    """The plan command gives the layout search a share of --time-limit: past it nothing more is evaluated."""
    import time

    from opsched.plan.layout_search import search_layouts

    caplog.set_level("INFO", logger="opsched.plan.layout_search")
    kwargs = dict(global_batch=64, tokens_per_sequence=4096)
    found = search_layouts(llama, preset("h100-sxm", 16), Training(), deadline=time.monotonic() - 1, **kwargs)
    assert found == [] and "the time limit was spent" in caplog.text
    assert search_layouts(llama, preset("h100-sxm", 16), Training(), deadline=time.monotonic() + 600, **kwargs)


def _moe_layer(split: bool):
    """One MoE layer of 8 experts after a router, exported as 8 expert blocks or as one block holding all 8."""
    import networkx as nx

    from opsched.model.graph import Block

    g = nx.DiGraph(kind="BlockGraph")
    g.add_node(0, block=Block(0, "model/layers.0/router", (), (), flops=1e6))
    parts = [(f"model/layers.0/mlp/experts.{e}", (), 1) for e in range(8)] if split else \
        [("model/layers.0/mlp/experts", tuple(f"l0/experts.{e}/w1" for e in range(8)), 8)]
    for k, (name, ops, n) in enumerate(parts, start=1):
        g.add_node(k, block=Block(k, name, (), ops, flops=n * 1e9, matmul_flops=n * 1e9, param_count=n * 1e6,
                                  param_bytes=n * 2e6, io_bytes=n * 3e6, matmul_io_bytes=n * 3e6))
        g.add_edge(0, k, bytes=n * 1e6)
    return g


def test_a_moe_layers_collectives_cost_the_same_whatever_blocks_its_experts_were_exported_as():
    """DeepSeek-V3's export has a block per expert (256 a layer): a layer's dispatch and combine are one all-to-all
    each, so its experts' blocks share the latency of one call; split or stacked, the layer costs the same, and
    folded over ep=8 each expert's weights are read once for 8 replicas' tokens (1/8 of the weight traffic)."""
    from opsched.plan.chunk_cost import _chunk_cost, _cluster_key, _weights_read_once_per_ep

    cluster = preset("h100-sxm", 64)
    layout = ParallelLayout.parse("pp=1,ep=8,zero=1").resolved(64)
    costs = []
    for split in (True, False):
        bg = _moe_layer(split)
        index = model_index(bg)
        assert {index.expert_share[b] for b in bg if b} == ({1 / 8} if split else {1.0})
        costs.append(_chunk_cost(bg, index, list(bg), layout, cluster, _cluster_key(cluster), Training(), rank=0))
    split, stacked = costs
    assert split.F == pytest.approx(stacked.F) and split.I == pytest.approx(stacked.I)
    # the layer's one dispatch and one combine are still paid, over 8 ranks of one node
    assert split.F > 2 * 7 * cluster.intra_node_latency
    expert = _moe_layer(True).nodes[1]["block"]
    assert _weights_read_once_per_ep(expert, 8).io_bytes == pytest.approx(3e6 - 2e6 * 7 / 8)


def test_the_layout_search_splits_a_pipeline_unevenly_where_no_depth_divides_the_layers(llama):
    """Llama 7B's 32 layers on 6 devices: pp 3 and 6 divide neither 32 nor 34, so the search tries them as
    Megatron-Core layout strings (the balanced split, the embedding first and the loss last); each evaluated as
    `evaluate --layout ...,pipeline_layout=...` gives it, and the search's best is never slower than any layout
    of the grid evaluated the same way (the published layout among them)."""
    from opsched.plan.layout_search import layout_grid, search_layouts

    c = preset("h100-sxm", 6)
    kw = dict(global_batch=12, tokens_per_sequence=4096, memory_limit=1e30, recompute=("none",))
    every = search_layouts(llama, c, Training(), keep=10_000, whole_sync=True, **kw)
    uneven = [e for e in every if e.layout.pipeline_layout]
    assert {e.layout.pp for e in uneven} == {3, 6}
    for e in uneven:
        counts = [len({index_layer for index_layer in map(model_index(llama).layer_of.get, chunk)} - {None})
                  for chunk in e.chunks]
        assert sum(counts) == 32 and max(counts) - min(counts) <= 2  # balanced, the ends a layer lighter
        again = evaluate_layout(llama, c, Training(), ParallelLayout.parse(
            f"tp={e.layout.tp},pp={e.layout.pp},pipeline_layout={e.layout.pipeline_layout}"),
            global_batch=12, micro_batch_size=1, tokens_per_sequence=4096)
        assert again.planner_step == pytest.approx(e.planner_step, rel=1e-12)
    best = search_layouts(llama, c, Training(), whole_sync=True, **kw)[0]
    assert best.planner_step <= min(e.planner_step for e in every) * (1 + 1e-12)
    assert {str(e.layout) for e in uneven} <= {str(lay) for lay in layout_grid(6, 8, layers=32, experts=0)}


def test_dualpipe_joins_the_moe_layout_search_with_a_floor_below_its_step(mixtral):
    """On a MoE model the search runs DualPipe beside Megatron's 1F1B where the layout allows it (even pp, vpp 1):
    each DualPipe row is what `evaluate --schedule dualpipe` gives, its floor (what the search ranks and prunes
    by) is under its step, its parameters are held twice, and the best found is the fastest of all."""
    from opsched.plan.layout_search import search_layouts
    from opsched.plan.layouts import layout_floor

    c = preset("h100-sxm", 8)
    kw = dict(global_batch=16, tokens_per_sequence=4096, memory_limit=1e30, recompute=("none",))
    every = search_layouts(mixtral, c, Training(), keep=10_000, whole_sync=True, **kw)
    dual = [e for e in every if e.schedule_name == "dualpipe"]
    for e in every:
        floor = layout_floor(mixtral, c, Training(), e.layout, global_batch=16, micro_batch_size=1,
                             memory_limit=1e30, whole_sync=True,
                             schedule="dualpipe" if e.schedule_name == "dualpipe" else None)
        assert floor <= e.planner_step * (1 + 1e-12), (str(e.layout), e.schedule_name)
    assert dual and all(e.layout.pp % 2 == 0 and e.layout.vpp == 1 for e in dual)
    assert {e.schedule_name for e in every} >= {"1f1b", "dualpipe"}
    for e in dual:
        again = evaluate_layout(mixtral, c, Training(), e.layout, global_batch=16, micro_batch_size=1,
                                tokens_per_sequence=4096, schedule="dualpipe")
        assert again.planner_step == pytest.approx(e.planner_step, rel=1e-12)
        one = evaluate_layout(mixtral, c, Training(), e.layout, global_batch=16, micro_batch_size=1,
                              tokens_per_sequence=4096)
        assert max(device_param_bytes(e.schedule.stage_graph)) == pytest.approx(
            2 * max(device_param_bytes(one.schedule.stage_graph)), rel=0.35)  # two copies (ends differ)
    best = search_layouts(mixtral, c, Training(), whole_sync=True, **kw)[0]
    assert best.planner_step <= min(e.planner_step for e in every) * (1 + 1e-12)
