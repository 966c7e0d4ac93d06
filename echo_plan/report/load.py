"""Read back what a report is made from: a saved JSON result, or a study in Optuna storage.

Saved results are what ``echo-plan search --json`` / ``compare --json`` print
(``echo_plan.search.serialize``). A study holds every finished trial as TrialRecord JSON in the
trial's user attribute ``echo_plan_trial``; the search's own settings (model, cluster, space,
pruning counts) are read from the study's user attribute ``echo_plan_outcome`` when the search
stored it, and otherwise rebuilt from the presets named in the trials' results (and said so).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from echo_plan.errors import EchoPlanError, FileFormatError
from echo_plan.files import parse_json, read_text
from echo_plan.replay.results import StepResult
from echo_plan.search.results import CompareOutcome, SearchOutcome, TrialRecord, TrialState
from echo_plan.search.storage import check_storage, db_error
from echo_plan.search.serialize import COMPARE_FORMAT, FORMAT, compare_from_json, outcome_from_json
from echo_plan.specs import load_cluster, load_model
from echo_plan.search.serialize import trial_from_json
from echo_plan.search.serialize import outcome_to_json
from echo_plan.search.storage import default_storage_url

TRIAL_ATTR = "echo_plan_trial"  # as written by echo_plan.search.storage
OUTCOME_ATTR = "echo_plan_outcome"  # a study-level SearchOutcome JSON without trials, when stored
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


def load_result_file(path: str | Path) -> SearchOutcome | CompareOutcome:
    """A saved ``--json`` result of search or compare."""
    p = Path(path)
    data = parse_json(read_text(p), str(p))
    kind = data.get("format") if isinstance(data, dict) else None
    try:
        if kind == FORMAT:
            return outcome_from_json(data)
        if kind == COMPARE_FORMAT:
            return compare_from_json(data)
    except FileFormatError as exc:
        raise FileFormatError(str(p), exc.problem) from None
    raise FileFormatError(str(p), f"not a saved echo-plan result: expected \"format\" {FORMAT!r} or "
                                  f"{COMPARE_FORMAT!r} (write one with `echo-plan search --json > FILE`)")


def storage_url(source: str) -> str:
    """An Optuna storage URL from a URL or a path to an SQLite file."""
    url = source if "://" in source else f"sqlite:///{Path(source).resolve()}"
    if "://" not in source and not Path(source).exists():
        raise FileFormatError(source, "no such file")
    check_storage(url, "--storage" if "://" in source else "study database", must_exist=True)
    return url


def _study_names(url: str) -> list[str]:
    import optuna

    try:
        return sorted(optuna.get_all_study_names(storage=url))
    except Exception as exc:  # SQLAlchemy/Optuna errors: not a database, unreachable server
        raise EchoPlanError(f"cannot open study storage {url!r}: {db_error(exc)}") from None


def _ranked(trials: list[TrialRecord]) -> tuple[StepResult, ...]:
    best: dict[str, StepResult] = {}
    for t in trials:
        r = t.result
        if t.state is TrialState.COMPLETE and r is not None and r.fits:
            key = json.dumps(t.plan, sort_keys=True)
            if key not in best or r.step_time_s < best[key].step_time_s:
                best[key] = r
    return tuple(sorted(best.values(), key=lambda r: r.step_time_s))


def _specs_from_results(trials: list[TrialRecord]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Model and cluster dicts re-read from the presets that the stored results name."""
    first = next((t.result for t in trials if t.result is not None), None)
    if first is None:
        raise EchoPlanError("the study has no simulated trial, so there is nothing to report")
    notes = ["The study stores its trials but not the search's settings: the model and cluster were "
             f"re-read from the presets {first.model!r} and {first.cluster!r} at {first.num_gpus} GPUs, "
             "and the search space and the counts of candidates pruned before sampling are unknown."]
    try:
        model = load_model(first.model).model_dump(mode="json")
        cluster = load_cluster(first.cluster, gpus=first.num_gpus).model_dump(mode="json")
    except EchoPlanError as exc:
        raise EchoPlanError(f"the study does not record its model and cluster, and its results name "
                            f"{first.model!r} on {first.cluster!r}, which are not presets here ({exc}); "
                            "report from a saved `--json` result instead") from None
    return model, cluster, notes


def load_study(url: str, study_name: str | None = None) -> SearchOutcome:
    """Rebuild a SearchOutcome from a study that echo-plan wrote (no simulation)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = _study_names(url)
    if study_name is None:
        if len(names) != 1:
            listed = ", ".join(names) if names else "none"
            raise EchoPlanError(f"give --study-name: {url} holds {len(names)} studies ({listed})")
        study_name = names[0]
    if study_name not in names:
        raise EchoPlanError(f"no study {study_name!r} in {url}; studies there: {', '.join(names) or 'none'}")
    study = optuna.load_study(study_name=study_name, storage=url)
    trials: list[TrialRecord] = []
    for ft in study.get_trials(deepcopy=False):
        raw = ft.user_attrs.get(TRIAL_ATTR)
        if raw is not None:
            try:
                trials.append(trial_from_json(json.loads(raw)))
            except (json.JSONDecodeError, FileFormatError) as exc:
                raise FileFormatError(f"{url} study {study_name}", f"trial {ft.number}: {exc}") from None
    if not trials:
        raise EchoPlanError(f"study {study_name!r} in {url} has no trials written by echo-plan")
    trials.sort(key=lambda t: t.number)
    meta = study.user_attrs.get(OUTCOME_ATTR)
    if meta is not None:
        data = json.loads(meta) if isinstance(meta, str) else dict(meta)
        data.update(trials=[], ranked=[], study_name=study_name, storage=url)
        base = outcome_from_json(data)
        return _with_trials(base, trials, ())
    model, cluster, notes = _specs_from_results(trials)
    pruned: dict[str, int] = {}
    for t in trials:
        if t.state is TrialState.PRUNED and t.pruned_reason:
            pruned[t.pruned_reason] = pruned.get(t.pruned_reason, 0) + 1
    base = SearchOutcome(model=model, cluster=cluster, space={}, sampler="unknown", seed=0, study_name=study_name, storage=url, trials=(),
                         ranked=(), pruned_counts=pruned, candidates_total=len(trials), traces_made=0,
                         trace_cache_hits=0, wall_s=sum(t.wall_s for t in trials))
    return _with_trials(base, trials, tuple(notes))


def save_settings(outcome: SearchOutcome | CompareOutcome) -> list[str]:
    """Store each search's settings (the outcome without its trials) as the study's user attribute
    ``echo_plan_outcome``, so that ``echo-plan report STUDY`` later shows the same model, cluster,
    space and pruning counts. Studies kept in memory are skipped. Returns a note per study that
    could not be written (the search's results are safe in its trials either way)."""
    import optuna

    outcomes = [r.outcome for r in outcome.rows] if isinstance(outcome, CompareOutcome) else [outcome]
    notes = []
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for o in outcomes:
        if "://" not in o.storage:
            continue
        meta = outcome_to_json(replace(o, trials=(), ranked=(), pareto=()))
        try:
            study = optuna.load_study(study_name=o.study_name, storage=o.storage)
            study.set_user_attr(OUTCOME_ATTR, json.dumps(meta, default=str))
        except Exception as exc:  # a read-only or unreachable database must not fail the search
            notes.append(f"could not store the search's settings in study {o.study_name}: {type(exc).__name__}: {exc}")
    return notes


def _with_trials(base: SearchOutcome, trials: list[TrialRecord], notes: tuple[str, ...]) -> SearchOutcome:
    return replace(base, trials=tuple(trials), ranked=_ranked(trials), notes=(*base.notes, *notes))


def load_source(source: str | None, storage: str | None = None,
                study_name: str | None = None) -> SearchOutcome | CompareOutcome:
    """What ``echo-plan report`` reads: a JSON result file, an SQLite study file, or --storage URL."""
    if storage is not None:
        if source is not None:
            raise EchoPlanError("give either a file or --storage, not both")
        return load_study(storage_url(storage), study_name)
    if source is None:
        if study_name is not None:  # a study in the default storage, where `echo-plan search` keeps them

            return load_study(default_storage_url(), study_name)
        raise EchoPlanError("give a saved result (.json), a study database (.db), or --study-name NAME "
                            "[--storage URL]")
    if "://" in source or Path(source).suffix.lower() in SQLITE_SUFFIXES:
        return load_study(storage_url(source), study_name)
    if study_name is not None:
        raise EchoPlanError(f"--study-name needs a study database or --storage, not {source!r}")
    return load_result_file(source)
