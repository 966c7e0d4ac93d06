"""A damaged Numba cache costs a recompilation, never a traceback or a wrong answer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import warnings
from echo_plan.replay.compiled.switch import CompiledSwitch, JitMode
from echo_plan.replay.engine import Task, TaskKind, replay
from echo_plan.replay.interference import load_interference
switch = CompiledSwitch(JitMode.ON)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kernels = switch.kernels()
    ok = kernels.rates is not None and kernels.build is not None
r = replay([Task(0, 0, "c", 1.0, TaskKind.GEMM), Task(1, 0, "d", 1.0, TaskKind.ALL_REDUCE)], load_interference(None),
           switch)
print(ok, repr(r.makespan_s), len(caught))
"""


def _run(cache: Path) -> str:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), ECHO_PLAN_JIT="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return out.stdout.strip()


@pytest.mark.slow
def test_corrupted_cache_is_rebuilt(tmp_path):
    first = _run(tmp_path)  # compiles and fills the cache
    ok, makespan, warned = first.split()
    assert ok == "True" and warned == "0"
    files = [p for p in tmp_path.rglob("*") if p.suffix in (".nbi", ".nbc")]
    assert files, "numba wrote no cache files"
    for p in files:  # truncate the indexes, scramble the data
        p.write_bytes(p.read_bytes()[:7] if p.suffix == ".nbi" else os.urandom(64))
    again = _run(tmp_path)
    assert again == first  # same answer, compiled loop still in use, no warning
    assert _run(tmp_path) == first  # and the rebuilt cache loads
