"""End to end with torch's own flight recorder: a 3-process CPU job on the Gloo process group, one
rank slowed by a sleep before each all-reduce; diagnose reads the dumps torch wrote.

Torch's Gloo group records entries (time_created_ns, sizes, groups) but never their start or end
(its state stays 'scheduled'), so diagnose judges from arrival times only."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from echo_plan.cli import main

SCRIPT = r"""
import os, sys, time
import multiprocessing as mp
import torch, torch.distributed as dist

def work(rank, world, out, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.ones(256)
    for _ in range(12):
        time.sleep(0.002)
        if rank == 1:
            time.sleep(0.03)
        dist.all_reduce(t)
    from torch._C._distributed_c10d import _dump_fr_trace
    with open(os.path.join(out, f"nccl_trace_rank_{rank}"), "wb") as fh:
        fh.write(_dump_fr_trace())
    dist.destroy_process_group()

if __name__ == "__main__":
    os.environ["TORCH_FR_BUFFER_SIZE"] = "200"
    ctx = mp.get_context("fork")  # the children share the parent's imported torch: seconds faster
    procs = [ctx.Process(target=work, args=(r, 3, sys.argv[1], int(sys.argv[2]))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    sys.exit(max(abs(p.exitcode or 0) for p in procs))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_gloo_flight_recorder_dumps_name_the_slow_rank(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    c10d = pytest.importorskip("torch._C._distributed_c10d")
    if not hasattr(c10d, "_dump_fr_trace") or not torch.distributed.is_gloo_available():
        pytest.skip("this torch has no Gloo flight recorder")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "dumps"
    out.mkdir()
    run = subprocess.run([sys.executable, str(script), str(out), str(_free_port())], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert main(["diagnose", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["syndrome"] == "non_communication_slow", d["verdict"]
    assert (d["suspects"][0]["rank"], d["suspects"][0]["component"]) == (1, "gpu")
    assert d["evidence"]["last_arriving"]["rank"] == 1
