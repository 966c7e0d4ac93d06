"""Issue 13 (context parallelism): a cold search of Llama 3 70B at 128K tokens on 256 H800s, timed,
and the bf16 CP rows of the long_context_h100 suite, per row.

Run: .venv/bin/python benchmarks/long_context_bench.py   (the suite ships with the package,
echo_plan/data/validation/). The search runs in a fresh subprocess with an empty trace cache, as
`echo-plan search --model llama3-70b --cluster h800 --gpus 256 --seq-length 131072 --storage memory`
would, so the time includes starting Python and tracing. The CPU seconds are printed beside the wall
time: on a shared machine the wall time also counts waiting for a core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

SEARCH = ["search", "--model", "llama3-70b", "--cluster", "h800", "--gpus", "256", "--seq-length", "131072",
          "--storage", "memory", "--no-progress"]  # issue 13's command (default --gbs), no study stored


def cold_search() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, ECHO_PLAN_CACHE_DIR=tmp)
        import resource

        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "echo_plan.cli", *SEARCH], env=env, capture_output=True,
                             text=True, check=False)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = out.stdout.splitlines()
    print(f"1. echo-plan {' '.join(SEARCH)}")
    print(f"   cold (empty trace cache, new process): {wall:.1f} s wall, {cpu:.1f} s CPU (target: under 60 s); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; exit {out.returncode}")
    for line in lines[:4] + [ln for ln in lines if ln.startswith("Context parallelism") or " trials (" in ln]:
        print("   " + line)
    if out.returncode:
        print(out.stderr[-2000:])


def suite_rows() -> None:
    from pathlib import Path

    from echo_plan.trace.cache import TraceCache
    from echo_plan.validation.megatron import validation_dir
    from echo_plan.validation.predict import RowSimulator
    from echo_plan.validation.registry import training_rows, training_suite

    suite = training_suite(Path(validation_dir()) / "long_context_h100.csv")
    rows = training_rows(suite)
    print("\n2. long_context_h100 step-time rows, bf16 and fp8 (nothing fitted on them):")
    with tempfile.TemporaryDirectory() as tmp:
        sim = RowSimulator(suite.cluster, suite.stack, TraceCache(tmp), model_settings=suite.model_settings)
        errors = []
        for row in rows:
            if row.not_modelled or row.unit != "s/step":  # the TFLOP/s sweep is part 3
                continue
            p = sim.predict(row)
            if p.error is None:
                print(f"   {row.label:<28} {p.problem}")
                continue
            errors.append(abs(p.error))
            print(f"   {row.label:<28} measured {row.measured:7.2f} s  predicted {p.figure:7.2f} s  {p.error:+6.1%}")
        if errors:
            print(f"   mean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%} over {len(errors)} rows "
                  f"(target: mean within 6%)")
        waiting = sum(1 for r in rows if r.not_modelled)
        if waiting:
            print(f"   {waiting} rows not modelled yet")


def sweep_crossover() -> None:
    """The Llama 2 7B FP8 sweep: model TFLOP/s per GPU (NeMo's count) of the published CP plan and of the
    best fitting plan without CP among tp 1-8, pp 1-4, recompute none/full, beside the measured pair, and
    the crossover (the shortest sequence from which CP beats no CP) measured and predicted."""
    from pathlib import Path

    from echo_plan.errors import EchoPlanError
    from echo_plan.simulate import simulate
    from echo_plan.specs import PlanSpec
    from echo_plan.trace.cache import TraceCache
    from echo_plan.validation.megatron import validation_dir
    from echo_plan.validation.predict import RowSimulator
    from echo_plan.validation.registry import training_suite
    from echo_plan.validation.rows import read_step_times

    src = Path(validation_dir()) / "long_context_h100.csv"
    suite = training_suite(src)
    print("\n3. Llama 2 7B FP8 sweep: model TFLOP/s per GPU, with the published CP plan and the best plan "
          "without CP (target: within 10% per row; the crossover at the measured sequence length)")
    measured_x = predicted_x = None
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for r in read_step_times(src, "", suite.row_defaults) if r.unit.startswith("TFLOP")]
        sim = RowSimulator(suite.cluster, suite.stack, TraceCache(tmp), model_settings=suite.model_settings)
        print(f"   {'seq':>8} {'cp':>3} {'measured cp / no-cp':>20} {'predicted cp':>13} {'error':>7} "
              f"{'predicted no-cp':>16}")
        for row in rows:
            p = sim.predict(row)
            model, cluster, stack = sim.model_for(row), sim.cluster_for(row), sim.stack_for(row)
            best = None
            for tp in (1, 2, 4, 8):
                for pp in (1, 2, 4):
                    for rc in ("none", "full"):
                        gpus = row.gpus
                        if gpus % (tp * pp) or row.plan["global_batch_size"] % (gpus // (tp * pp)):
                            continue
                        try:
                            plan = PlanSpec(tp=tp, pp=pp, dp=gpus // (tp * pp), micro_batch_size=1,
                                            global_batch_size=row.plan["global_batch_size"], recompute=rc,
                                            sequence_parallel=tp > 1, distributed_optimizer=True,
                                            dtype=row.plan.get("dtype", "bf16"))
                            r = simulate(model, cluster, plan, stack=stack, cache=sim.cache, memo=sim.memo)
                        except EchoPlanError:
                            continue
                        if r.fits and (best is None or r.step_time_s < best.step_time_s):
                            best = r
            no_cp = None if best is None else row.figure(best.step_time_s)
            without = _measured_without(src, model.seq_length)
            cp = row.plan.get("cp", 1)
            cp_fig = "-" if p.step_s is None else f"{p.figure:.0f}" + ("" if p.fits else "*")
            err = "-" if p.error is None else f"{p.error:+.1%}"
            print(f"   {model.seq_length:>8} {cp:>3} {row.measured:>9.0f} / {without:>8} {cp_fig:>13} {err:>7} "
                  f"{'-' if no_cp is None else f'{no_cp:.0f}':>16}")
            if cp > 1 and measured_x is None and (without == "-" or row.measured > float(without)):
                measured_x = model.seq_length
            if cp > 1 and predicted_x is None and p.step_s is not None and (no_cp is None or p.figure > no_cp):
                predicted_x = model.seq_length
        print("   (* predicted not to fit)")
        print(f"   crossover (CP starts to pay): measured at {measured_x}, predicted at {predicted_x}")


def _measured_without(src, seq: int) -> str:
    from echo_plan.validation.rows import csv_records

    for _, rec in csv_records(src)[1]:
        if rec.get("kind") == "tflops" and rec.get("seq_length") == str(seq):
            return rec.get("tflops_per_gpu_without_cp") or "-"
    return "?"


if __name__ == "__main__":
    cold_search()
    suite_rows()
    sweep_crossover()
