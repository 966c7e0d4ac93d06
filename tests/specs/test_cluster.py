import pytest

from echo_plan.errors import FileFormatError, SpecError, UnknownPresetError
from echo_plan.specs import DType, cluster_names, load_cluster


def test_presets_exist_and_cite_sources():
    assert {"h800", "dgx-a100", "dgx-h100"} <= set(cluster_names())
    for name in cluster_names():
        c = load_cluster(name)
        assert c.sources, f"{name} must cite its sources"


def test_h800_matches_the_echo_paper():
    c = load_cluster("h800")
    assert (c.num_nodes, c.gpus_per_node, c.num_gpus) == (12, 8, 96)
    assert c.gpu.nvlink_bw_GBps == 400 and c.network.nic_bw_Gbps == 400 and c.network.nics_per_node == 8
    assert c.gpu.peak_tflops(DType.BF16) == pytest.approx(989.4)


def test_resize_by_nodes_and_gpus():
    assert load_cluster("h800", nodes=128).num_gpus == 1024
    assert load_cluster("h800", gpus=1024).num_nodes == 128
    small = load_cluster("dgx-a100", gpus=4)
    assert (small.gpus_per_node, small.num_nodes) == (4, 1)


@pytest.mark.parametrize("kwargs", [dict(gpus=12), dict(gpus=0), dict(nodes=0), dict(nodes=2, gpus=16)])
def test_bad_resize_is_a_clear_error(kwargs):
    with pytest.raises(SpecError):
        load_cluster("h800", **kwargs)


def test_unknown_cluster_lists_known():
    with pytest.raises(UnknownPresetError) as err:
        load_cluster("tpu-v5")
    assert "h800" in str(err.value)


def test_cluster_file_errors(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("name: mine\ngpus_per_node: 8\nnum_nodes: 2\n")
    with pytest.raises(SpecError) as err:
        load_cluster(str(f))
    assert "gpu" in str(err.value)
    f.write_text("name: mine\n  gpus_per_node: 8\n")
    with pytest.raises(FileFormatError) as err:
        load_cluster(str(f))
    assert "line" in str(err.value)


def test_user_cluster_file_roundtrip(tmp_path):
    import yaml

    data = load_cluster("dgx-h100").model_dump(mode="json")
    data["name"] = "my-h100"
    data["network"]["oversubscription"] = 2.0
    f = tmp_path / "my.yaml"
    f.write_text(yaml.safe_dump(data))
    c = load_cluster(str(f), nodes=4)
    assert c.name == "my-h100" and c.num_gpus == 32
    assert c.network.node_GBps == pytest.approx(load_cluster("dgx-h100").network.node_GBps / 2)
