"""The validation-suite runner: discovery, settings lines, format errors, the collective suite."""

from pathlib import Path

import pytest

from echo_plan.cli import main
from echo_plan.errors import FileFormatError
from echo_plan.validation.megatron import TABLE, validation_dir
from echo_plan.validation.suites import SuiteRef, check_columns, discover, read_settings, run_collective

SHARED = validation_dir()


def test_discovers_csv_and_nccl_suites(tmp_path):
    (tmp_path / "mine.csv").write_text("params_b,heads\n")
    logs = tmp_path / "nccl-tests" / "dgx-a100"
    logs.mkdir(parents=True)
    (logs / "a.log").write_text("x")
    (tmp_path / "nccl-tests" / "empty").mkdir()
    refs = discover([tmp_path])
    assert [(r.name, r.kind) for r in refs] == [("mine", "training"), ("nccl-tests/dgx-a100", "collective")]


def test_settings_line_is_read(tmp_path):
    p = tmp_path / "s.csv"
    p.write_text("# echo-plan: cluster=dgx-h100 seq_length=4096 dtype=bf16 recompute=selective attention=fused "
                 "tolerance=0.2 fit=none\nparams_b,heads\n")
    settings, tol, fit = read_settings(p)
    assert (settings.cluster, settings.seq_length, settings.dtype, settings.recompute) == ("dgx-h100", 4096, "bf16", "selective")
    assert not settings.unfused_attention and tol == 0.2 and fit == "none"


@pytest.mark.parametrize("line,needle", [("# echo-plan: colour=red", "colour"),
                                         ("# echo-plan: seq_length=long", "seq_length"),
                                         ("# echo-plan: fit=odd", "fit")])
def test_bad_settings_are_clear_errors(tmp_path, line, needle):
    p = tmp_path / "s.csv"
    p.write_text(line + "\nparams_b,heads\n")
    with pytest.raises(FileFormatError) as err:
        read_settings(p)
    assert needle in str(err.value) and "s.csv" in str(err.value)


def test_missing_columns_are_named(tmp_path):
    p = tmp_path / "s.csv"
    p.write_text("params_b,heads,hidden\n1,2,3\n")
    with pytest.raises(FileFormatError) as err:
        check_columns(p)
    assert "achieved_tflops_per_gpu" in str(err.value)


def test_cli_unknown_suite_and_missing_dir(tmp_path, capsys):
    assert main(["validate", "--dir", str(tmp_path / "nope"), "--list"]) == 2
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.skipif(not (SHARED / "nccl-tests" / "azure-nd-a100-v4").is_dir(), reason=f"no nccl-tests logs under {SHARED}")
def test_collective_suite_reports_held_out_rows_only():
    res = run_collective(SuiteRef("nccl-tests/azure-nd-a100-v4", "collective", SHARED / "nccl-tests" / "azure-nd-a100-v4"))
    assert res.rows and all(r.held_out for r in res.rows)
    assert all(r.label.startswith("16 GPUs") for r in res.rows)  # 1-8 GPUs fit, 16 held out
    assert res.passed == all(abs(r.error) <= res.tolerance for r in res.rows)
    assert res.max_abs_error >= res.mean_abs_error


@pytest.mark.skipif(not (SHARED / TABLE).exists(), reason=f"no {TABLE} under {SHARED}")
def test_user_suite_in_the_same_format_runs(tmp_path, capsys):
    """A user suite of two rows (copied from the published table) runs through the CLI with no fit."""
    import json

    src = [ln for ln in (SHARED / TABLE).read_text().splitlines() if ln and not ln.startswith("#")]
    (tmp_path / "two.csv").write_text("# echo-plan: fit=none tolerance=0.5\n" + "\n".join(src[:3]) + "\n")
    code = main(["validate", "--dir", str(tmp_path), "--suite", "two", "--json", "--cache-dir", str(tmp_path / "c")])
    out = json.loads(capsys.readouterr().out)
    (suite,) = out["suites"]
    assert [r["measured"] for r in suite["rows"]] == [137.0, 138.0]
    assert all(r["predicted"] > 0 and not r["held_out"] for r in suite["rows"])
    assert suite["passed"] == (suite["mean_abs_error"] <= 0.5)
    assert code == (0 if suite["passed"] else 1)
