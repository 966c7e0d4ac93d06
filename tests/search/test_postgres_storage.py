"""A study shared through a real PostgreSQL server: two searches at once lose no trial.

The server is started by the test in a temporary folder (initdb + pg_ctl on a free port, trust
authentication on 127.0.0.1) and stopped after. Skipped, with the reason, where no PostgreSQL
server binaries are installed (``.ci/run`` installs Debian's ``postgresql``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return versions[-1] if versions else None


INITDB, PG_CTL = _binary("initdb"), _binary("pg_ctl")
pytestmark = pytest.mark.skipif(INITDB is None or PG_CTL is None,
                                reason="no PostgreSQL server binaries (apt-get install postgresql)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_server_user(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run it as nobody then (CI runs as root)."""
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            pytest.skip("running as root and no runuser to start PostgreSQL as another user")
        return [runuser, "-u", "nobody", "--", *cmd]
    return cmd


@pytest.fixture(scope="module")
def postgres_url():
    pytest.importorskip("psycopg", reason="psycopg not installed (pip install -e '.[postgres]')")
    root = Path(tempfile.mkdtemp(prefix="echo-plan-pg-"))  # a folder the server's user can reach
    os.chmod(root, 0o777)
    data, port = root / "db", _free_port()
    subprocess.run(_as_server_user([INITDB, "-D", str(data), "-U", "echo", "--auth=trust"]), check=True,
                   capture_output=True)
    subprocess.run(_as_server_user([PG_CTL, "-D", str(data), "-l", str(root / "log"), "-w", "-o",
                                    f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start"]),
                   check=True, capture_output=True)
    try:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={port} user=echo dbname=postgres", autocommit=True) as c:
            c.execute("CREATE DATABASE studies")
        yield f"postgresql://echo@127.0.0.1:{port}/studies"
    finally:
        subprocess.run(_as_server_user([PG_CTL, "-D", str(data), "-m", "immediate", "stop"]), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def _search(url: str, seed: int, cache: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "echo_plan.cli", "search", "--storage", url, "--study-name",
                             "shared", "--trials", "6", "--seed", str(seed), "--json", "--no-progress",
                             "--cache-dir", cache], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_searches_at_once_share_one_study_and_lose_no_trial(postgres_url, tmp_path):
    import optuna

    runs = [_search(postgres_url, seed, str(tmp_path / "cache")) for seed in (1, 2)]
    outs = [p.communicate(timeout=600) for p in runs]
    for p, (out, err) in zip(runs, outs):
        assert p.returncode == 0, err
    def key(t: dict) -> str:  # a trial's content, whatever number a process gave it
        return json.dumps({k: v for k, v in t.items() if k not in ("number", "wall_s")}, sort_keys=True)

    reported = set()
    for out, _ in outs:
        reported |= {key(t) for t in json.loads(out)["trials"]}
    study = optuna.load_study(study_name="shared", storage=postgres_url)
    stored = [json.loads(t.user_attrs["echo_plan_trial"]) for t in study.trials]
    states = Counter(t.state.name for t in study.trials)
    assert reported <= {key(t) for t in stored}  # every trial either search reported is in the shared study
    assert len(stored) >= max(len(json.loads(out)["trials"]) for out, _ in outs)
    assert states.get("RUNNING", 0) == 0 and states.get("FAIL", 0) == 0
    # a third search on the same study resumes it: it reads back every trial, uniquely numbered
    again = subprocess.run([sys.executable, "-m", "echo_plan.cli", "search", "--storage", postgres_url,
                            "--study-name", "shared", "--trials", "6", "--seed", "1", "--json", "--no-progress",
                            "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    numbers = [t["number"] for t in json.loads(again.stdout)["trials"]]
    assert len(numbers) >= len(stored) and len(set(numbers)) == len(numbers)
