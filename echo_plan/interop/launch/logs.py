"""Step times from the logs training frameworks write (for ``calibrate steps --from-log``).

* Megatron-LM and Megatron-Bridge (its training loop prints Megatron's line):
  ``iteration 20/ 100 | consumed samples: ... | elapsed time per iteration (ms): 1234.5 | ...``
  (the mean over the log interval ending at that iteration);
* NeMo (Lightning): ``... global_step: 20 | ... | train_step_timing in s: 1.234``;
* torchtitan: ``step: 20  loss: ...  tps: 1,234  tflops: ...`` (tokens per second per GPU; the
  step time is the job's tokens per step over tps x GPUs, so its config must be known).

Warm-up (the first ``skip`` iterations: compilation, allocator growth, the first all-gathers) is
left out; the step time is the median of the rest, so one slow interval (a checkpoint save, an
evaluation) does not move it.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from echo_plan.errors import EchoPlanError

MEGATRON = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*([0-9.]+)")
NEMO = re.compile(r"(?:global_step|iteration)[:=\s]+(\d+).*?train_step_timing(?: in s)?[:=\s]+([0-9.]+)")
TITAN = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([0-9,]+)")
DEFAULT_SKIP = 10


@dataclass(frozen=True)
class LogSteps:
    framework: str  # megatron | nemo | torchtitan
    steps: tuple[tuple[int, float], ...]  # (iteration, seconds per step), warm-up included
    skip: int

    @property
    def kept(self) -> tuple[float, ...]:
        return tuple(s for i, s in self.steps if i > self.skip)

    @property
    def step_s(self) -> float:
        return statistics.median(self.kept)


def read_log_steps(text: str, source: str, *, skip: int = DEFAULT_SKIP, tokens_per_step: float | None = None,
                   gpus: int | None = None) -> LogSteps:
    """The per-step times of a log; torchtitan's need ``tokens_per_step`` and ``gpus`` (from its config)."""
    if skip < 0:
        raise EchoPlanError(f"--skip-steps {skip}: 0 or more warm-up iterations")
    found: list[tuple[str, list[tuple[int, float]]]] = []
    mega = [(int(i), float(ms) / 1e3) for i, ms in MEGATRON.findall(text)]
    nemo = [(int(i), float(s)) for i, s in NEMO.findall(text)]
    titan = [(int(i), float(t.replace(",", ""))) for i, t in TITAN.findall(text)]
    if mega:
        found.append(("megatron", mega))
    if nemo:
        found.append(("nemo", nemo))
    if titan:
        if tokens_per_step is None or not gpus:
            raise EchoPlanError(f"{source}: a torchtitan log gives tokens per second per GPU; its job config (with "
                                "--launch) is needed to turn them into step times")
        found.append(("torchtitan", [(i, tokens_per_step / (tps * gpus)) for i, tps in titan if tps > 0]))
    if not found:
        raise EchoPlanError(f"{source}: no step times found (expected Megatron's 'elapsed time per iteration (ms)', "
                            "NeMo's 'train_step_timing in s' or torchtitan's 'step: N ... tps: T' lines)")
    framework, steps = max(found, key=lambda f: len(f[1]))
    out = LogSteps(framework, tuple(steps), skip)
    if not out.kept:
        last = max(i for i, _ in steps)
        raise EchoPlanError(f"{source}: every logged step is warm-up (the last is iteration {last}, --skip-steps "
                            f"{skip}); log a longer run or lower --skip-steps")
    return out
