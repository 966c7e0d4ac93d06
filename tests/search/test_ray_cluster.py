"""search --ray-address against a real local Ray cluster: a head and a worker node as separate processes.

Both nodes are started here (``ray start --head`` on a free port, ``ray start --address`` with its own
CPU), in their own process groups, and stopped by ending those groups (never ``ray stop``, which would
end every Ray on the machine, other tests' included). The ranking must equal the in-process one and the
plans must have run on both nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
pytestmark = pytest.mark.skipif(RAY is None, reason="the ray command is not installed")
ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([RAY, "start", "--block", "--num-cpus", "1", "--disable-usage-stats", *args], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _ray_root() -> str:
    """Ray's own folder for this cluster (not /tmp/ray: its 'current cluster' file there would make
    other tests' local Ray join this one); short, as Ray's socket paths must be."""
    import tempfile

    return tempfile.mkdtemp(prefix="eprt", dir="/tmp")


def _alive_nodes(address: str) -> int:
    code = ("import ray; ray.init(address=%r, logging_level='ERROR'); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))" % address)
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0


@pytest.fixture(scope="module")
def cluster():
    port = _free_port()
    address = f"127.0.0.1:{port}"
    root = _ray_root()
    nodes = [_node(["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={root}"])]
    try:
        deadline = time.time() + 90
        while time.time() < deadline and _alive_nodes(address) < 1:
            time.sleep(1)
        nodes.append(_node([f"--address={address}"]))
        while time.time() < deadline and _alive_nodes(address) < 2:
            time.sleep(1)
        if _alive_nodes(address) < 2:
            pytest.skip("a two-node local Ray cluster did not come up within 90 s on this machine")
        yield address
    finally:
        for p in reversed(nodes):
            try:  # a `ray start --block` node given SIGTERM took the whole 30 s wait here: 5 s, then SIGKILL
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        shutil.rmtree(root, ignore_errors=True)


def _search(tmp_path, *extra: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "echo_plan.cli", "search", "--storage", "memory", "--trials", "12",
                          "--seed", "3", "--json", "--no-progress", "--cache-dir", str(tmp_path / "cache"), *extra],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_search_on_a_ray_cluster_ranks_as_in_process_and_uses_both_nodes(cluster, tmp_path):
    remote = _search(tmp_path, "--ray-address", cluster)
    local = _search(tmp_path)
    ranking = [(r["plan"], r["step_time_s"]) for r in remote["ranked"]]
    assert ranking == [(r["plan"], r["step_time_s"]) for r in local["ranked"]]
    note = next(n for n in remote["notes"] if n.startswith("evaluated on"))
    assert note.startswith("evaluated on 2 Ray nodes"), note
