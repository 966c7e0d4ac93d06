"""`echo-plan report` on the command line: a file in, a report out, one-line errors with exit 2."""

import json

from report_synthetic import search_outcome

from echo_plan.cli import main
from echo_plan.search.serialize import outcome_to_json


def test_report_from_saved_json(tmp_path, capsys):
    src = tmp_path / "result.json"
    src.write_text(json.dumps(outcome_to_json(search_outcome(30, seed=6, gbs=256))))
    out = tmp_path / "out" / "report.html"
    assert main(["report", str(src), "-o", str(out), "--no-simulate"]) == 0
    assert out.exists() and out.stat().st_size > 1_000_000
    assert "report written" in capsys.readouterr().out


def test_report_errors_are_one_line_with_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope.json"), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "no such file" in err and "\n" not in err
    src = tmp_path / "result.json"
    src.write_text(json.dumps(outcome_to_json(search_outcome(10, seed=6, gbs=256))))
    assert main(["report", str(src), "-o", str(tmp_path / "r.txt"), "--no-simulate"]) == 2
    assert ".html" in capsys.readouterr().err
    assert not (tmp_path / "r.txt").exists()


def test_report_takes_the_same_output_flag_as_search(tmp_path, capsys):
    """--report names the HTML file in every command that writes one; -o / --output stay as aliases."""
    src = tmp_path / "result.json"
    src.write_text(json.dumps(outcome_to_json(search_outcome(10, seed=6, gbs=256))))
    for flag in ("--report", "--output", "-o"):
        out = tmp_path / f"r{flag.strip('-')}.html"
        assert main(["report", str(src), flag, str(out), "--no-simulate"]) == 0
        assert out.stat().st_size > 1_000_000
    assert main(["report", str(src), "--report", str(tmp_path / "r.txt"), "--no-simulate"]) == 2
    assert "--report" in capsys.readouterr().err
