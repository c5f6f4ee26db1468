"""`opsched inspect`: the summary, --json, and one clean error line for each kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from helpers import make_moe_model, moe_param_count, real_export, save
from opsched.cli import main

F = TensorProto.FLOAT


def run_cli(capsys, *argv):
    code = main(["inspect", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_summary_of_a_moe_model(tmp_path, capsys):
    path = save(make_moe_model("legacy", layers=2, experts=4, default_dims="batch=2,seq=8"), tmp_path / "m.onnx")
    code, out, err = run_cli(capsys, path, "--json")
    assert code == 0 and err == ""
    s = json.loads(out)
    for key in ("nodes", "params", "flops", "op_types", "blocks", "max_parallel_branches"):
        assert key in s
    assert s["params"] == moe_param_count()
    assert s["max_parallel_branches"] == 4
    assert s["op_types"]["NonZero"] == 8
    assert s["nodes"] == sum(s["op_types"].values())
    assert s["dims"] == {"batch": 2, "seq": 8}
    # --dim and --capacity-factor change the FLOPs; --blocks changes the block count
    code, out2, _ = run_cli(capsys, path, "--json", "--dim", "seq=16", "--capacity-factor", "2")
    assert json.loads(out2)["flops"] > s["flops"]
    code, out3, _ = run_cli(capsys, path, "--json", "--blocks", "1")
    s3 = json.loads(out3)
    assert s3["blocks"] <= s["blocks"] and s3["blocks_target_met"] is False  # experts stay apart


def test_text_summary(capsys):
    code, out, err = run_cli(capsys, real_export("clip.dynamo.onnx"))
    assert code == 0 and err == ""
    for word in ("parameters", "forward", "activations", "branches", "blocks", "op types", "LayerNormalization"):
        assert word in out
    assert "167,488" in out
    assert "at most 2 blocks in parallel" in out


def test_help_documents_routing_rule(capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    out = capsys.readouterr().out
    assert "capacity_factor * tokens * top_k / num_experts" in out
    assert "--dim NAME=VALUE" in out


def _bad_models(tmp_path):
    """name -> (path, extra args, expected words in the error line)."""
    out = {}
    out["missing file"] = (tmp_path / "nope.onnx", [], "not found")
    text = tmp_path / "text.onnx"
    text.write_text("this is not a model\n" * 20)
    out["not ONNX"] = (text, [], "not")
    good = make_moe_model("legacy", default_dims="batch=1,seq=4").SerializeToString()
    trunc = tmp_path / "trunc.onnx"
    trunc.write_bytes(good[: len(good) // 2])
    out["truncated"] = (trunc, [], "truncated")
    out["unresolved dim"] = (save(make_moe_model("legacy"), tmp_path / "dims.onnx"), ["--dim", "batch=1"],
                             "--dim seq=VALUE")
    x = helper.make_tensor_value_info("x", F, [2])
    cyc = helper.make_graph([helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
                             helper.make_node("Relu", ["a"], ["b"], name="n2")],
                            "cyc", [x], [helper.make_tensor_value_info("b", F, [2])])
    out["cycle"] = (save(helper.make_model(cyc), tmp_path / "cycle.onnx"), [], "cycle")
    dangling = helper.make_graph([helper.make_node("Add", ["x", "ghost"], ["y"], name="n1")], "d", [x],
                                 [helper.make_tensor_value_info("y", F, [2])])
    out["dangling input"] = (save(helper.make_model(dangling), tmp_path / "dangling.onnx"), [], "ghost")
    empty = helper.make_graph([], "empty", [x], [helper.make_tensor_value_info("x", F, [2])])
    out["empty graph"] = (save(helper.make_model(empty), tmp_path / "empty.onnx"), [], "empty")
    out["bad --dim"] = (trunc, ["--dim", "seq"], "NAME=VALUE")
    return out


@pytest.mark.parametrize("case", ["missing file", "not ONNX", "truncated", "unresolved dim", "cycle",
                                  "dangling input", "empty graph", "bad --dim"])
def test_bad_input_one_line_exit_2(tmp_path, capsys, case):
    path, extra, words = _bad_models(tmp_path)[case]
    code, out, err = run_cli(capsys, path, *extra)
    assert code == 2, (case, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("opsched: error: ")
    assert words in lines[0]
    assert "Traceback" not in err


def test_bad_input_through_the_console_script(tmp_path):
    """The real process: exit status 2, one stderr line, no traceback."""
    path, _, _ = _bad_models(tmp_path)["truncated"]
    proc = subprocess.run([sys.executable, "-m", "opsched.cli", "inspect", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_inspect_writes_no_files(tmp_path, capsys):
    path = save(make_moe_model("dynamo", default_dims="batch=1,seq=4"), tmp_path / "m.onnx")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, _ = run_cli(capsys, path)
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    onnx.load(str(path), load_external_data=False)  # the model file is untouched and loads


def test_batched_experts_are_shown(capsys):
    code, out, err = run_cli(capsys, real_export("mixtral_batched_experts.dynamo.onnx"))
    assert code == 0 and err == ""
    assert "47,524" in out  # every expert's weights (see test_onnx_import)
    assert "at most 4 blocks in parallel" in out
    assert "assumes      MoE routing: 2 layers of stacked [experts, ...] weights split into 4 experts each" in out
    code, out, _ = run_cli(capsys, real_export("qwen2_moe_batched_experts.dynamo.onnx"), "--json",
                           "--capacity-factor", "1.25")
    s = json.loads(out)
    assert {f["experts"] for f in s["stacked_experts"].values()} == {4}
    assert {f["rows_per_expert"] for f in s["stacked_experts"].values()} == {10}  # ceil(1.25 * 16 * 2 / 4)


def test_a_mask_is_a_warning_not_moe_routing(capsys):
    """The LLaVA-style image-token mask (a NonZero with no router) is never reported as MoE routing."""
    code, out, err = run_cli(capsys, real_export("llava_mask.legacy.onnx"))
    assert code == 0
    assert "moe routing" not in out.lower() and "assumes" not in out
    assert "warning      NonZero '/NonZero' has a data-dependent count and no MoE router" in out
    code, out, _ = run_cli(capsys, real_export("llava_mask.legacy.onnx"), "--json")
    s = json.loads(out)
    assert s["moe_nonzero_resolved"] == 0 and s["nonzero_masks"] == 1 and s["assumptions"] == []


def test_moe_routing_is_an_assumption(tmp_path, capsys):
    path = save(make_moe_model("legacy", layers=2, experts=4, default_dims="batch=2,seq=8"), tmp_path / "m.onnx")
    code, out, _ = run_cli(capsys, path)
    assert code == 0
    assert "assumes      MoE routing: 8 data-dependent expert selections (NonZero below a router TopK)" in out
