"""Where studies persist: the Optuna storage URL, study names, and committing trials one by one.

The sampler works on an in-memory mirror of the study (Optuna's SQLite storage re-reads every
trial on each ask, which costs ~100 ms a trial here); every finished trial is committed to the
persistent study as soon as it finishes, with the StepResult JSON in its user attributes, so an
interrupted search loses nothing it finished and a resumed one re-simulates nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from echo_plan.errors import EchoPlanError
from echo_plan.search.results import TrialRecord, TrialState
from echo_plan.search.serialize import trial_from_json, trial_to_json
from echo_plan.errors import SpecError
from echo_plan.output_paths import check_output_file

ATTR = "echo_plan_trial"  # user attribute holding the TrialRecord JSON


def default_storage_url() -> str:
    """``sqlite:///<user data dir>/studies.db`` (platformdirs' user_data_dir for "echo-plan")."""
    from platformdirs import user_data_dir

    root = Path(user_data_dir("echo-plan"))
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'studies.db'}"


SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite 3 database file


def sqlite_file(url: str) -> str | None:
    """The database file of an ``sqlite:///PATH`` URL (None for other URLs and in-memory SQLite)."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):].split("?", 1)[0]
    return path if path and path != ":memory:" else None


def check_storage(url: str | None, option: str = "--storage", *, must_exist: bool = False) -> None:
    """Fail before any work on a storage that cannot be used: an empty URL, or an SQLite file that
    is a folder, device, FIFO or socket, sits where files cannot be created, or is an existing
    file that is not an SQLite database (which SQLite would overwrite)."""
    if url is None or url == "memory":
        return
    if not url.strip():
        raise SpecError(option, url, "a database URL (sqlite:///studies.db), or 'memory' for none")
    path = sqlite_file(url)
    if path is None:
        return
    p = Path(path)
    if must_exist:  # read: an existing regular file (SQLite would create a missing one)
        if not p.is_file():
            what = "no such database file" if not p.exists() else "not a regular file"
            raise SpecError(option, url, "an existing study database", message=f"{option} {url!r}: {what}")
    else:
        check_output_file(path, option)
    if p.is_file() and p.stat().st_size > 0:
        with open(p, "rb") as fh:
            head = fh.read(len(SQLITE_HEADER))
        if head != SQLITE_HEADER:
            raise SpecError(option, url, "not an SQLite database", message=(
                f"{option} {url!r}: {path} is not an SQLite database; an existing file is never overwritten"))


def db_error(exc: BaseException) -> str:
    """An SQLAlchemy/Optuna error as one line: no '(Background on this error ...)' lines or SQL."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.startswith(("(Background", "["))]
    text = " ".join(" ".join(lines).split())
    return f"{type(exc).__name__}: {text[:300]}"


def derive_study_name(model: dict[str, Any], cluster: dict[str, Any], gbs: int, space_digest: str,
                      sampler: str, seed: int, version: str, extra: Any = None) -> str:
    """Readable prefix (model, cluster, GPUs, gbs, sampler, seed) plus a hash of everything that
    changes the answer (full model and cluster specs, the space, the package version, and
    ``extra``: the software stack and the memory headroom)."""
    body = json.dumps([model, cluster, gbs, space_digest, sampler, seed, version] + ([extra] if extra else []),
                      sort_keys=True, default=str)
    digest = hashlib.sha256(body.encode()).hexdigest()[:10]
    gpus = int(cluster["gpus_per_node"]) * int(cluster["num_nodes"])
    label = f"{model['name']}-{cluster['name']}-{gpus}g-gbs{gbs}-{sampler}-s{seed}-{digest}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def model_code_version(root: Path | None = None) -> str:
    """A short hash of the package's source and data files (every .py and .yaml under ``root``, default the
    installed echo_plan): a stored study keeps the answers of the code that computed them, so editing the
    tracer, a cost model or a data file without a new release version starts a new study instead of reading
    trials the current code would not give."""
    base = root or Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(p for ext in ("*.py", "*.yaml") for p in base.rglob(ext) if "__pycache__" not in p.parts):
        h.update(path.relative_to(base).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


OPEN_ATTEMPTS = 6


def _lost_a_race(exc: Exception) -> bool:
    """Two searches opening one new database or study at once: one creates the tables (or the study)
    while the other tries to; the loser sees a duplicate and only has to open it again."""
    text = f"{type(exc).__name__} {exc}".lower()
    return any(k in text for k in ("integrityerror", "duplicate key", "already exists", "duplicatedstudy",
                                   "uniqueviolation", "database is locked"))


class TrialStore:
    """The persistent Optuna study of one search: load its finished trials, commit new ones."""

    def __init__(self, url: str, study_name: str, directions: list[str]) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.url = url
        self.study_name = study_name
        for attempt in range(OPEN_ATTEMPTS):
            try:
                path = sqlite_file(url)
                if path is not None:  # SQLite creates the file but not its folder
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                storage = optuna.storages.get_storage(url)
                self.study = optuna.create_study(storage=storage, study_name=study_name, directions=directions,
                                                 load_if_exists=True)
                break
            except Exception as exc:  # SQLAlchemy/Optuna errors on a bad URL or an unreachable database
                if attempt + 1 < OPEN_ATTEMPTS and _lost_a_race(exc):
                    time.sleep(0.2 * (attempt + 1))  # another search created the schema or the study first
                    continue
                raise EchoPlanError(f"cannot open study storage {url!r}: {db_error(exc)}") from None
        have = [d.name.lower() for d in self.study.directions]
        if have != [d.lower() for d in directions]:
            raise EchoPlanError(f"study {study_name!r} in {url} optimises {have}, not {directions}; "
                                f"give another --study-name")

    def load(self) -> list[TrialRecord]:
        """Finished trials written by echo-plan, in trial order."""
        out: list[TrialRecord] = []
        for ft in sorted(self.study.get_trials(deepcopy=False), key=lambda t: t.number):
            raw = ft.user_attrs.get(ATTR)
            if raw is None:
                continue
            out.append(trial_from_json(json.loads(raw)))
        if len({r.number for r in out}) == len(out):  # one writer: its own numbering
            return sorted(out, key=lambda r: r.number)
        # several searches wrote this study at once and numbered their trials alike: the storage's commit order
        return [replace(r, number=i) for i, r in enumerate(out)]

    def commit(self, record: TrialRecord, values: list[float] | None) -> None:
        """Write one finished trial now (one transaction). The plan lives in the trial's user
        attribute, not in Optuna params: each param costs SQLite ~4 ms a trial through Optuna's ORM,
        which tripled the cost of a search."""
        from optuna.trial import TrialState as OptunaState, create_trial

        state = {TrialState.COMPLETE: OptunaState.COMPLETE, TrialState.PRUNED: OptunaState.PRUNED,
                 TrialState.FAILED: OptunaState.FAIL}[record.state]
        if state is OptunaState.COMPLETE and values is None:
            state = OptunaState.PRUNED  # simulated but does not fit: no objective value
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            frozen = create_trial(
                state=state, values=values if state is OptunaState.COMPLETE else None,
                user_attrs={ATTR: json.dumps(trial_to_json(record), default=str)},
            )
        self.study.add_trial(frozen)
