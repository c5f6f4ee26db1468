"""Cluster presets, files and validation (issue 5 item 1)."""

import json
import pytest

from opsched.cost.cluster import (
    PRESETS,
    preset_fields,
    Training,
    cluster_from_dict,
    load_cluster,
    parse_bytes,
    preset,
    resolve_cluster,
)
from opsched.errors import OpschedError


def test_presets_have_every_field_and_positive_numbers():
    for name in PRESETS:
        per_node = PRESETS[name].devices_per_node
        c = preset(name, devices=2 * per_node)
        assert c.devices == 2 * per_node and c.nodes == 2
        assert c.flops_per_second("bf16") == pytest.approx(c.peak_flops["bf16"] * c.efficiency)
        assert c.intra_node_bandwidth > c.inter_node_bandwidth


def test_presets_of_the_branch_testbeds():
    """GraphPipe's V100s (4 a node; 2-byte training runs at the fp16 peak, V100s having no bf16) and Optimus's
    Hopper at 989 dense BF16 TFLOP/s (datasheet)."""
    v100 = preset("v100-16g", devices=32)
    assert v100.nodes == 8 and v100.memory_bytes == 16e9
    assert v100.peak_flops["fp16"] == v100.peak_flops["bf16"] == 125e12
    assert preset("h100-sxm").peak_flops["bf16"] == 989e12


def test_devices_alone_picks_the_default_preset():
    c = resolve_cluster(devices=8)
    assert c.name == "h100-sxm" and c.devices == 8 and c.devices_per_node == 8


def test_link_is_intra_node_within_a_node_and_inter_node_across():
    c = preset("a100-80g", devices=16)
    assert c.link((0, 1), (6, 7)) == (c.intra_node_bandwidth, c.intra_node_latency)
    assert c.link((6, 7), (8, 9)) == (c.inter_node_bandwidth, c.inter_node_latency)


def test_json_file_round_trip(tmp_path):
    spec = dict(preset_fields("a100-80g"), devices=4, memory_bytes=40e9)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(spec))
    c = load_cluster(path)
    assert c.devices == 4 and c.memory_bytes == 40e9
    assert load_cluster(path, devices=8).devices == 8


def test_toml_file_with_preset_base(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('preset = "h200"\ndevices = 16\nefficiency = 0.4\n')
    c = load_cluster(path)
    assert c.memory_bytes == PRESETS["h200"].memory_bytes and c.efficiency == 0.4


@pytest.mark.parametrize("field", ["devices_per_node", "memory_bytes", "inter_node_latency", "peak_flops"])
def test_missing_field_names_it(field):
    spec = dict(preset_fields("h100-sxm"), devices=8)
    del spec[field]
    with pytest.raises(OpschedError, match=field):
        cluster_from_dict(spec)


@pytest.mark.parametrize("field", ["memory_bytes", "intra_node_bandwidth", "efficiency", "intra_node_latency"])
def test_negative_field_names_it(field):
    spec = dict(preset_fields("h100-sxm"), devices=8)
    spec[field] = -1.0
    with pytest.raises(OpschedError, match=field):
        cluster_from_dict(spec)


def test_unknown_preset_and_unknown_field():
    with pytest.raises(OpschedError, match="unknown preset 'tpu'"):
        preset("tpu")
    with pytest.raises(OpschedError, match="unknown field 'gpus'"):
        cluster_from_dict(dict(preset_fields("h100-sxm"), devices=8, gpus=8))


def test_bad_files(tmp_path):
    with pytest.raises(OpschedError, match="does not exist"):
        load_cluster(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{devices: 8")
    with pytest.raises(OpschedError, match="not valid JSON"):
        load_cluster(bad)


def test_training_defaults_and_validation():
    t = Training()
    assert t.bytes_per_param == 16.0  # Adam mixed precision: 2 + 2 + 12
    for bad in (0, -3):
        with pytest.raises(OpschedError, match="microbatches"):
            Training(microbatches=bad)
    with pytest.raises(OpschedError, match="dtype"):
        Training(dtype="int4")


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80 GB") == 80e9
    assert parse_bytes("8e10") == 8e10
    for bad in ("eighty", "80XB", "-1GB", "0"):
        with pytest.raises(OpschedError):
            parse_bytes(bad)


def test_error_is_one_line(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"devices": 8}))
    # the CLI prints an OpschedError as one line on stderr and exits 2
    with pytest.raises(OpschedError) as info:
        load_cluster(path)
    assert "\n" not in str(info.value) and "missing field" in str(info.value)


def test_h800_is_an_h100_with_slower_nvlink_and_gb200_a_72_gpu_nvlink_domain():
    """The presets DeepSeek-V3 and GB200 NVL72 runs need: the H800's compute is the H100's (same SXM5 part), its
    NVLink 400 GB/s bidirectional; the GB200's NVLink domain is the 72-GPU rack, so 64 ranks share NVLink."""
    h100, h800, gb200 = preset("h100-sxm", 16), preset("h800", 16), preset("gb200", 144)
    assert dict(h800.peak_flops) == dict(h100.peak_flops) and h800.memory_bytes == h100.memory_bytes
    assert h800.intra_node_bandwidth == 200e9 < h100.intra_node_bandwidth
    assert gb200.devices_per_node == 72 and gb200.peak_flops["fp8"] == 2 * gb200.peak_flops["bf16"] == 5e15
    # 64 ranks stay on NVLink in the rack, cross InfiniBand between H800 nodes
    ranks = tuple(range(64))
    assert gb200.link(ranks, ranks)[0] == 900e9 and h800.link(ranks, ranks)[0] == 50e9
