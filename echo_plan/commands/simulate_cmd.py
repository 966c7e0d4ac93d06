"""``echo-plan simulate``: predict one plan's step time, throughput, MFU, memory, and a timeline."""

from __future__ import annotations

from typing import Optional

import typer

from echo_plan.commands.common import (
    CacheDirOpt, CkptBwOpt, DetectOpt, FailRateOpt, FlowsOpt, HeadroomOpt, JsonOpt, RestartOpt, RoutingOpt,
    failure_model, print_json,
)
from echo_plan.commands.launch_cmd import FromLaunchOpt, LaunchFormatOpt, job_inputs
from echo_plan.commands.plan_flags import PlanFlags, PlanInputs, build_plan, plan_options
from echo_plan.commands.common import check_cache_dir, parse_headroom
from echo_plan.errors import SpecError
from echo_plan.output_paths import check_output_file
from echo_plan.replay.interference import InterferenceModel, load_interference
from echo_plan.simulate import simulate
from echo_plan.trace.cache import TraceCache
from echo_plan.resilience.files import read_faults
from echo_plan.specs.faults import check_faults
from echo_plan.commands.simulate_view import print_result


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    @plan_options
    def simulate_cmd(
        flags: PlanFlags,
        from_launch: Optional[str] = FromLaunchOpt,
        launch_format: Optional[str] = LaunchFormatOpt,
        memory_headroom: Optional[str] = HeadroomOpt,
        fault: Optional[list[str]] = typer.Option(
            None, "--fault", help="a fault, repeatable: straggler:rank=R,compute=F | link:node=N,nic=I,bw=F | "
                                  "nvlink:node=N,bw=F | node:node=N,compute=F | uplink:leaf=L,down=C | "
                                  "gpu-hang:rank=R | nic-hang:node=N,nic=I (hangs: with --emit-records)"),
        fault_file: Optional[str] = typer.Option(None, "--fault-file", help="YAML list of faults (kind + keys)"),
        routing: Optional[str] = RoutingOpt,
        flows_per_connection: Optional[int] = FlowsOpt,
        failures_per_gpu_day: Optional[float] = FailRateOpt,
        checkpoint_gbps_per_gpu: Optional[float] = CkptBwOpt,
        restart_min: Optional[float] = RestartOpt,
        detect_min: Optional[float] = DetectOpt,
        interference_file: Optional[str] = typer.Option(None, "--interference", help="interference factors YAML"),
        no_interference: bool = typer.Option(False, "--no-interference", help="ignore compute/comm interference"),
        as_json: bool = JsonOpt,
        trace: Optional[str] = typer.Option(None, "--trace", help="write a Chrome/Perfetto trace JSON of the step"),
        cache_dir: Optional[str] = CacheDirOpt,
        emit_records: Optional[str] = typer.Option(
            None, "--emit-records", help="write the per-rank collective records of the simulated job (with its "
                                         "faults) into this new folder, for echo-plan diagnose"),
        record_format: str = typer.Option("flight-recorder", "--record-format",
                                          help="flight-recorder (torch's pickle dumps) | jsonl | csv"),
        record_noise: float = typer.Option(0.0, "--record-noise",
                                           help="timing noise of the records, a share (0.03: 3%)"),
        record_seed: int = typer.Option(0, "--record-seed", help="seed of the records' noise"),
        record_steps: int = typer.Option(3, "--record-steps", help="training steps the records cover"),
        record_buffer: int = typer.Option(2000, "--record-buffer",
                                          help="records kept per rank (torch's TORCH_NCCL_TRACE_BUFFER_SIZE default)"),
        collective_algorithm: Optional[list[str]] = typer.Option(
            None, "--collective-algorithm",
            help="time a collective with an MSCCL-IR XML algorithm, e.g. all_reduce=ring.xml (repeatable; "
                 "used where the group size fits the file, NCCL otherwise)"),
    ) -> None:
        """Predict the training step of one plan: time, throughput, MFU, memory per stage, breakdown."""
        check_output_file(trace, "--trace", (".json",))
        fmt = None
        if emit_records is not None:
            from echo_plan.resilience.diagnose.emit import check_emit_options  # deferred: only with --emit-records

            fmt = check_emit_options(emit_records, record_format, record_steps, record_noise, record_seed,
                                     record_buffer)
        check_cache_dir(cache_dir)
        if no_interference and interference_file:
            raise SpecError("--interference", interference_file, "not together with --no-interference")
        if from_launch is not None:
            inputs, job = job_inputs(from_launch, flags, launch_format)
            for note in job.notes:
                typer.echo(f"note: {note}", err=True)
            inputs = PlanInputs(inputs.model, inputs.cluster.with_routing(routing, flows_per_connection), inputs.stack,
                                inputs.plan)
        else:
            if launch_format is not None:
                raise SpecError("--launch-format", launch_format, "needs --from-launch")
            inputs = build_plan(flags, routing=routing, flows_per_connection=flows_per_connection)
        model_spec, cluster_spec, stack_spec, plan = inputs.model, inputs.cluster, inputs.stack, inputs.plan
        headroom = parse_headroom(memory_headroom, cluster_spec)

        interference = InterferenceModel.none() if no_interference else load_interference(interference_file)
        comm = None
        if collective_algorithm:
            from echo_plan.cost.collectives import collective_model_for  # deferred: only with --collective-algorithm
            from echo_plan.interop.msccl_model import MscclCollectiveModel, parse_algorithm_options  # deferred: likewise

            comm = MscclCollectiveModel(collective_model_for(cluster_spec),
                                        parse_algorithm_options(collective_algorithm))

        faults = read_faults(fault or (), fault_file)
        hangs = tuple(f for f in faults if f.kind.hang)
        if hangs and emit_records is None:
            raise SpecError("--fault", hangs[0].label(), "a hang stops the job and has no step time; give it with "
                                                         "--emit-records DIR to write the hung job's records")
        if hangs:
            check_faults(faults, plan, cluster_spec)
            faults = tuple(f for f in faults if not f.kind.hang)
        fm = failure_model(failures_per_gpu_day, checkpoint_gbps_per_gpu, restart_min, detect_min)
        result = simulate(model_spec, cluster_spec, plan, stack=stack_spec, cache=TraceCache(cache_dir), faults=faults,
                          failure_model=fm,
                          interference=interference, timeline=trace is not None, comm=comm,
                          memory_headroom_bytes=headroom, traffic=True)
        if trace is not None:
            from echo_plan.replay.timeline import write_chrome_trace  # deferred: only with --trace

            write_chrome_trace(trace, result)
        emitted = None
        if emit_records is not None:
            from echo_plan.resilience.diagnose.emit import emit_records as write_records  # deferred: only with --emit-records

            emitted = write_records(model_spec, cluster_spec, plan, stack=stack_spec, cache=TraceCache(cache_dir),
                                    faults=faults + hangs, out=emit_records, fmt=fmt, steps=record_steps,
                                    noise=record_noise, seed=record_seed, buffer=record_buffer)
        if as_json:
            out = result.as_json()
            if emitted is not None:
                out["emitted_records"] = emitted
            print_json(out)
        else:
            print_result(result, trace)
            if emitted is not None:
                typer.echo(f"records: {emitted['files']} {emitted['format']} files in {emitted['folder']} "
                        f"({emitted['steps']} steps, up to {emitted['records_per_rank_max']} records per rank"
                        + (f", faults {', '.join(emitted['faults'])}" if emitted['faults'] else "") + ")")
