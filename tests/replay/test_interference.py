"""The interference model: defaults with sources, combination rules, user files and their errors."""

from __future__ import annotations

import pytest

from echo_plan.errors import FileFormatError
from echo_plan.replay.interference import FORMAT, InterferenceModel, load_interference
from echo_plan.replay.kinds import COMM_KINDS, COMPUTE_KINDS, TaskKind

G, A, M = TaskKind.GEMM, TaskKind.ATTENTION, TaskKind.MEMORY
AR, AG, P2P = TaskKind.ALL_REDUCE, TaskKind.ALL_GATHER, TaskKind.P2P


def test_defaults_cover_every_pair_with_a_source():
    m = load_interference(None)
    assert "arXiv" in m.source and m.provenance
    for k in COMPUTE_KINDS:
        for c in COMM_KINDS:
            assert m.compute_slowdown[(k, c)] >= 1.0
            assert m.comm_slowdown[(c, k)] >= 1.0
    # a memory-bound kernel competes for HBM directly: it suffers at least as much as a GEMM
    assert m.compute_factor(M, [AR]) >= m.compute_factor(G, [AR]) > 1.0
    assert not m.is_none


def test_none_and_scaled():
    none = InterferenceModel.none()
    assert none.is_none
    assert none.compute_factor(G, [AR, AG]) == 1.0
    assert none.task_factor(G, None, [(G, None), (AR, None)]) == 1.0
    m = load_interference(None)
    assert m.scaled(0.0).compute_factor(G, [AR]) == 1.0
    assert m.scaled(2.0).compute_factor(G, [AR]) - 1 == pytest.approx(2 * (m.compute_factor(G, [AR]) - 1))
    with pytest.raises(ValueError):
        m.scaled(-1.0)


def test_combination_rules():
    m = InterferenceModel({(G, AR): 1.2, (G, AG): 1.1, (M, AR): 1.4}, {(AR, G): 1.3, (AR, M): 1.5},
                          share_compute=True)
    assert m.compute_factor(G, [AR, AG]) == pytest.approx(1.3)  # excesses add
    assert m.compute_factor(G, [P2P]) == 1.0  # missing pair: no slowdown
    assert m.comm_factor(AR, [G, M]) == pytest.approx(1.8)
    # a mixed compute task: work-weighted blend
    assert m.task_factor(G, ((G, 0.5), (M, 0.5)), [(AR, None)]) == pytest.approx(1.3)
    # a collective beside a mixed compute task: blended excess
    assert m.task_factor(AR, None, [(G, ((G, 0.5), (M, 0.5)))]) == pytest.approx(1.4)
    # two compute tasks at once share the SMs
    assert m.task_factor(G, None, [(A, None)]) == pytest.approx(2.0)
    assert m.task_factor(G, None, [(A, None), (AR, None)]) == pytest.approx(2.4)
    assert m.task_factor(TaskKind.DELAY, None, [(AR, None)]) == 1.0
    assert m.task_factor(G, None, [(TaskKind.DELAY, None)]) == 1.0


def test_factors_below_one_rejected():
    with pytest.raises(ValueError):
        InterferenceModel({(G, AR): 0.9}, {})
    with pytest.raises(ValueError):
        InterferenceModel({(AR, G): 1.2}, {})  # wrong orientation


def test_user_file_overrides_entry_by_entry(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text(
        f"format: {FORMAT}\n"
        "source: measured on our H100 box\n"
        "share_compute: false\n"
        "compute_slowdown:\n"
        "  gemm:\n"
        "    all_reduce: 1.5\n"
    )
    base = load_interference(None)
    m = load_interference(str(f))
    assert m.compute_slowdown[(G, AR)] == 1.5
    assert m.compute_slowdown[(M, AR)] == base.compute_slowdown[(M, AR)]
    assert m.share_compute is False
    assert "our H100" in m.source


def test_round_trip(tmp_path):
    import yaml

    m = load_interference(None).with_factors(compute={(G, AR): 1.33})
    f = tmp_path / "rt.yaml"
    f.write_text(yaml.safe_dump(m.to_mapping(), sort_keys=False))
    back = load_interference(str(f))
    assert dict(back.compute_slowdown) == pytest.approx(dict(m.compute_slowdown))
    assert dict(back.comm_slowdown) == pytest.approx(dict(m.comm_slowdown))


@pytest.mark.parametrize("body, line, words", [
    ("source: x\ncompute_slowdown:\n  gemm:\n    all_reduce: 0.8\n", 4, "factor"),
    ("source: x\ncompute_slowdown:\n  gemm:\n    all_reduce: fast\n", 4, "factor"),
    ("source: x\ncompute_slowdown:\n  matmul:\n    all_reduce: 1.2\n", 3, "compute kind"),
    ("source: x\ncompute_slowdown:\n  gemm:\n    allreduce: 1.2\n", 4, "communication kind"),
    ("source: x\ncomm_slowdown:\n  gemm:\n    all_reduce: 1.2\n", 3, "communication kind"),
    ("source: x\nbogus: 1\n", 2, "unknown key"),
    ("source: x\ncompute_slowdown: [1, 2]\n", 2, "must map"),
    ("source: x\nshare_compute: maybe\n", 2, "true or false"),
    ("compute_slowdown:\n  gemm:\n    all_reduce: 1.2\n", 1, "source"),
    ("source: x\ncompute_slowdown:\n  gemm: {all_reduce: 1.2\n", None, "malformed YAML"),
    ("format: other/2\nsource: x\n", 1, "format"),
])
def test_malformed_files_name_the_line(tmp_path, body, line, words):
    f = tmp_path / "bad.yaml"
    f.write_text(body)
    with pytest.raises(FileFormatError) as info:
        load_interference(str(f))
    assert words in str(info.value)
    if line is not None:
        assert info.value.line == line


def test_missing_file(tmp_path):
    with pytest.raises(FileFormatError, match="no such file"):
        load_interference(str(tmp_path / "nope.yaml"))


def test_an_exchange_holding_sms_slows_tensor_core_kernels_at_least_by_the_sms_it_takes():
    base = load_interference(None)
    shared = base.with_sm_share(TaskKind.ALL_TO_ALL, 132, 20)
    for k in (TaskKind.GEMM, TaskKind.ATTENTION):
        f = shared.compute_factor(k, [TaskKind.ALL_TO_ALL])
        assert f >= 132 / 112 and f >= base.compute_factor(k, [TaskKind.ALL_TO_ALL])
    assert shared.compute_factor(TaskKind.MEMORY, [TaskKind.ALL_TO_ALL]) == \
        base.compute_factor(TaskKind.MEMORY, [TaskKind.ALL_TO_ALL])
    assert shared.compute_factor(TaskKind.GEMM, [TaskKind.ALL_REDUCE]) == \
        base.compute_factor(TaskKind.GEMM, [TaskKind.ALL_REDUCE])  # other collectives keep their factors
    with pytest.raises(ValueError, match="comm_sms 132"):
        base.with_sm_share(TaskKind.ALL_TO_ALL, 132, 132)
