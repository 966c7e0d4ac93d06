"""nccl-tests log parsing: the real Azure logs, MPI tags mid-line, other collectives, corrupt files."""

from __future__ import annotations

import pytest

from echo_plan.errors import FileFormatError
from echo_plan.interop.nccl_tests import parse_nccl_tests, parse_nccl_tests_text, render_nccl_tests
from echo_plan.trace.records import CollectiveKind
from echo_plan.validation.megatron import validation_dir

LOGS = validation_dir() / "nccl-tests" / "azure-nd-a100-v4"  # shipped with the package


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_real_logs_parse(n):
    log = parse_nccl_tests(LOGS / f"nccl_allreduce_{n}gpu.log")
    assert log.kind is CollectiveKind.ALL_REDUCE and log.nranks == n
    sizes = [r.size_bytes for r in log.rows]
    assert sizes == sorted(sizes) and len(sizes) >= 25
    for r in log.rows:  # every row consistent: algbw = size / time
        assert abs(r.size_bytes / r.time_us_oop / 1e3 - r.algbw_oop) <= 0.03 * r.algbw_oop + 0.02
    if n == 16:
        assert log.num_nodes == 2 and log.ranks_per_node == 8
        assert log.rows[-1].size_bytes == 17179869184 and log.rows[-1].time_us_oop == 251757


def _synthetic(kind=CollectiveKind.ALL_GATHER, hosts=("a",) * 4 + ("b",) * 4, mpi_tag=False):
    rows = [(1 << k, 10.0 + (1 << k) / 5e4, 10.5 + (1 << k) / 5e4) for k in range(10, 24)]
    return render_nccl_tests(kind, list(hosts), rows, mpi_tag=mpi_tag)


def test_mpi_tag_mid_line_and_noise():
    text = _synthetic(mpi_tag=True)
    lines = text.splitlines()
    # a row written in two pieces: the tag appears again in the middle of the line
    i = next(k for k, ln in enumerate(lines) if ln.strip().endswith("0") and "65536" in ln)
    head, tail = lines[i][:60], lines[i][60:]
    lines[i] = head + "[1,0]<stdout>:" + tail
    lines.insert(i, "[1,3]<stderr>:node-b:123:456 [3] NCCL INFO Channel 00/02 : 0 1 2 3")
    lines.insert(3, "--------------------------------------------------------------------------")
    log = parse_nccl_tests_text("\r\n".join(lines) + "\r\n", source="alltoall_perf.log")
    assert log.kind is CollectiveKind.ALL_TO_ALL  # from the file name
    assert log.nranks == 8 and log.num_nodes == 2
    assert any(r.size_bytes == 65536 for r in log.rows)


@pytest.mark.parametrize("kind", list(CollectiveKind))
def test_kind_from_file_name_and_ratio_is_checked(kind):
    text = _synthetic(kind)
    log = parse_nccl_tests_text(text, source=f"{kind.value}_perf.log")
    assert log.kind is kind
    if kind is CollectiveKind.ALL_REDUCE:
        assert parse_nccl_tests_text(text, source="run.log").kind is kind  # redop sum + ratio 2(n-1)/n
    if kind is CollectiveKind.SEND_RECV:
        with pytest.raises(FileFormatError, match="busbw/algbw"):
            parse_nccl_tests_text(text, source="all_reduce_perf.log")


def test_old_layout_without_root_column():
    text = _synthetic(CollectiveKind.ALL_REDUCE)
    text = text.replace("  redop    root  ", "  redop  ").replace("    sum     -1 ", "    sum ")
    log = parse_nccl_tests_text(text, source="all_reduce_perf.log")
    assert len(log.rows) == 14


@pytest.mark.parametrize("damage, message", [
    (lambda t: t[: t.index("# Out of bounds")].rstrip("\n")[:-30], "columns"),  # cut mid-row
    (lambda t: t[: t.index("# Out of bounds")], "truncated"),  # cut after a row
    (lambda t: t.replace("  1048576", "  10x8576", 1), "integer"),
    (lambda t: t.replace(" 1048576      262144", " 1048576      262144   ", 1).replace("float", "float 7", 1), "columns"),
    (lambda t: _garble_time(t), "does not match"),
    (lambda t: "hello world\nthis is not a log\n", "not nccl-tests"),
    (lambda t: "\n".join(ln for ln in t.splitlines() if not ln[:1].isspace() or ln.strip().startswith("#")), "no result"),
])
def test_corrupted_logs_raise_with_line(tmp_path, damage, message):
    path = tmp_path / "all_reduce_perf.log"
    path.write_text(damage(_synthetic(CollectiveKind.ALL_REDUCE)))
    with pytest.raises(FileFormatError, match=message) as info:
        parse_nccl_tests(path)
    assert str(path) in str(info.value)


def _garble_time(text: str) -> str:
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.strip().startswith("4194304"))
    toks = lines[i].split()
    toks[5] = f"{float(toks[5]) * 3:.2f}"  # out-of-place time tripled, algbw left as printed
    lines[i] = "  ".join(toks)
    return "\n".join(lines) + "\n"


def test_missing_file_and_binary(tmp_path):
    with pytest.raises(FileFormatError, match="no such file"):
        parse_nccl_tests(tmp_path / "nope.log")
    b = tmp_path / "x.log"
    b.write_bytes(b"\x00\x01\x02")
    with pytest.raises(FileFormatError, match="binary"):
        parse_nccl_tests(b)
