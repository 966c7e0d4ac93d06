"""Reading back saved results and stored studies for `echo-plan report`."""

import json
from dataclasses import replace

import pytest
from report_synthetic import compare_outcome, search_outcome

from echo_plan.errors import EchoPlanError, FileFormatError
from echo_plan.report.load import OUTCOME_ATTR, load_result_file, load_source, load_study
from echo_plan.search.results import CompareOutcome, SearchOutcome
from echo_plan.search.serialize import compare_to_json, outcome_to_json


@pytest.fixture(scope="module")
def outcome():
    return search_outcome(40, seed=7, gbs=256)


def steps(results):
    return [round(r.step_time_s, 9) for r in results]


def test_saved_search_and_compare_results_round_trip(outcome, tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(outcome_to_json(outcome)))
    back = load_result_file(f)
    assert isinstance(back, SearchOutcome)
    assert steps(back.ranked) == steps(outcome.ranked)
    assert len(back.trials) == len(outcome.trials)
    assert back.best.timeline == outcome.best.timeline
    c = tmp_path / "c.json"
    c.write_text(json.dumps(compare_to_json(compare_outcome(n_trials=15, gbs=256))))
    assert isinstance(load_source(str(c)), CompareOutcome)


def test_bad_files_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "format": \n}')
    with pytest.raises(FileFormatError, match=r"bad\.json, line 3"):
        load_result_file(bad)
    other = tmp_path / "other.json"
    other.write_text('{"format": "something-else"}')
    with pytest.raises(FileFormatError, match="not a saved echo-plan result"):
        load_result_file(other)
    with pytest.raises(FileFormatError, match="no such file"):
        load_source(str(tmp_path / "missing.json"))


def write_study(url, name, outcome):
    from echo_plan.search.storage import TrialStore

    store = TrialStore(url, name, ["minimize"])
    for t in outcome.trials:
        fits = t.result is not None and t.result.fits
        store.commit(t, [t.result.step_time_s] if fits else None)
    return store


def test_study_rebuilds_ranking_from_trials(outcome, tmp_path):
    db = tmp_path / "studies.db"
    url = f"sqlite:///{db}"
    write_study(url, "s1", outcome)
    back = load_source(str(db))  # the only study: no name needed
    assert back.study_name == "s1"
    assert steps(back.ranked) == steps(outcome.ranked)
    assert [t.number for t in back.trials] == [t.number for t in outcome.trials]
    # the search's settings were not stored: model and cluster come from the presets, and it says so
    assert back.model["name"] == "gpt3-175b" and back.cluster["num_nodes"] == 12
    assert any("not the search's settings" in n for n in back.notes)
    assert sum(back.pruned_counts.values()) == sum(1 for t in outcome.trials if t.pruned_reason)


def test_study_with_stored_settings_uses_them(outcome, tmp_path):
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    store = write_study(url, "s2", outcome)
    meta = outcome_to_json(replace(outcome, trials=(), ranked=()))
    store.study.set_user_attr(OUTCOME_ATTR, json.dumps(meta))
    back = load_study(url, "s2")
    assert back.space == outcome.space and back.candidates_total == outcome.candidates_total
    assert back.pruned_counts == outcome.pruned_counts
    assert steps(back.ranked) == steps(outcome.ranked)
    assert back.notes == ()


def test_study_choice_errors(outcome, tmp_path):
    db = tmp_path / "two.db"
    url = f"sqlite:///{db}"
    write_study(url, "a", outcome)
    write_study(url, "b", outcome)
    with pytest.raises(EchoPlanError, match="give --study-name.*a, b"):
        load_source(str(db))
    with pytest.raises(EchoPlanError, match="no study 'c'"):
        load_source(None, storage=url, study_name="c")
    with pytest.raises(EchoPlanError, match="--study-name needs"):
        load_source(str(tmp_path / "x.json"), study_name="a")
    with pytest.raises(EchoPlanError, match="give a saved result"):
        load_source(None)
