"""``echo-plan simulate``: predict one plan's step time, throughput, MFU, memory, and a timeline."""

from __future__ import annotations

from typing import Optional

import typer

from echo_plan.commands.common import (
    CkptBwOpt, DetectOpt, FlowsOpt, RoutingOpt, DTypeHelp, Fp8ParamGatherOpt, Fp8RecipeOpt, FailRateOpt, RestartOpt, failure_model, DensityOpt, DpCommOpt, EpOpt, CpOpt, SeqOpt, EtpOpt, ImbalanceOpt, dp_comm_fields, expert_fields, CacheDirOpt, ClusterOpt, GpusOpt, HeadroomOpt, JsonOpt, ModelOpt, NodesOpt, StackOpt, print_json,
)


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate_cmd(
        model: str = ModelOpt,
        cluster: str = ClusterOpt,
        nodes: Optional[int] = NodesOpt,
        gpus: Optional[int] = GpusOpt,
        stack: Optional[str] = StackOpt,
        memory_headroom: Optional[str] = HeadroomOpt,
        tp: int = typer.Option(1, "--tp", help="tensor-parallel degree"),
        pp: int = typer.Option(1, "--pp", help="pipeline-parallel degree"),
        cp: int = CpOpt,
        seq_length: Optional[int] = SeqOpt,
        dp: Optional[int] = typer.Option(None, "--dp", help="data-parallel degree (default: GPUs / (tp x cp x pp))"),
        mbs: int = typer.Option(1, "--mbs", help="micro-batch size"),
        gbs: Optional[int] = typer.Option(None, "--gbs", help="global batch size (default: mbs x dp)"),
        vpp: int = typer.Option(1, "--vpp", help="virtual pipeline stages per rank; above 1 implies interleaved"),
        schedule: Optional[str] = typer.Option(None, "--schedule", help="gpipe | 1f1b | interleaved | zb-h1 | zb-v | dualpipe (docs/schedules.md)"),
        recompute: str = typer.Option("none", "--recompute", help="none | selective | full"),
        sequence_parallel: bool = typer.Option(False, "--sequence-parallel", help="Megatron-LM sequence parallelism"),
        distributed_optimizer: bool = typer.Option(False, "--distributed-optimizer",
                                                   help="shard optimizer states over DP (reduce-scatter + all-gather)"),
        dtype: str = typer.Option("bf16", "--dtype", help=DTypeHelp),
        fp8_recipe: Optional[str] = Fp8RecipeOpt,
        fp8_param_gather: Optional[bool] = Fp8ParamGatherOpt,
        no_overlap_grad_reduce: bool = typer.Option(False, "--no-overlap-grad-reduce",
                                                    help="reduce gradients after the backward pass, not during it"),
        no_overlap_param_gather: bool = typer.Option(False, "--no-overlap-param-gather",
                                                     help="gather parameters after the optimizer, not during the forward"),
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
        dp_comm: str = DpCommOpt,
        density: Optional[float] = DensityOpt,
        ep: int = EpOpt,
        etp: Optional[int] = EtpOpt,
        expert_imbalance: float = ImbalanceOpt,
        layer_split: Optional[str] = typer.Option(None, "--layer-split", help="layers per stage, e.g. 13,12,12,11 (with --vpp: one per stage or one per virtual stage), or auto (as even as possible, "
                                                 "fewer on the first and last stage)"),
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
        from echo_plan.commands.common import (
            check_cache_dir, check_tp_pp, data_parallel, fp8_stack, parse_headroom, resolve_specs, resolve_stack,
        )
        from echo_plan.errors import SpecError
        from echo_plan.output_paths import check_output_file
        from echo_plan.specs import PlanSpec

        check_output_file(trace, "--trace", (".json",))
        fmt = None
        if emit_records is not None:
            from echo_plan.resilience.diagnose.emit import check_emit_options

            fmt = check_emit_options(emit_records, record_format, record_steps, record_noise, record_seed,
                                     record_buffer)
        check_cache_dir(cache_dir)
        check_tp_pp(tp, pp)
        model_spec, cluster_spec = resolve_specs(model, cluster, nodes, gpus, seq_length=seq_length, routing=routing,
                                                 flows_per_connection=flows_per_connection)
        stack_spec = fp8_stack(resolve_stack(stack), dtype, fp8_recipe, fp8_param_gather)
        headroom = parse_headroom(memory_headroom, cluster_spec)
        dp = data_parallel(cluster_spec.num_gpus, tp, pp, dp, cp)
        if no_interference and interference_file:
            raise SpecError("--interference", interference_file, "not together with --no-interference")
        fields = dict(
            tp=tp, cp=cp, pp=pp, dp=dp, micro_batch_size=mbs, global_batch_size=gbs if gbs is not None else mbs * dp,
            virtual_stages=vpp, recompute=recompute, sequence_parallel=sequence_parallel,
            distributed_optimizer=distributed_optimizer, dtype=dtype,
            overlap_grad_reduce=not no_overlap_grad_reduce, overlap_param_gather=not no_overlap_param_gather,
        )
        if schedule is not None:
            fields["schedule"] = schedule
        elif vpp > 1:
            fields["schedule"] = "interleaved"
        if layer_split == "auto":
            from echo_plan.specs.plan import balanced_split

            chunks = 2 if schedule == "zb-v" and vpp == 1 else vpp  # ZB-V is two chunks per rank
            fields["layer_split"] = balanced_split(model_spec.num_layers, pp * chunks)  # per virtual stage
        elif layer_split:
            try:
                fields["layer_split"] = tuple(int(x) for x in layer_split.split(","))
            except ValueError:
                raise SpecError("--layer-split", layer_split, "comma-separated layer counts, e.g. 13,12,12,11") from None
        fields.update(expert_fields(ep, etp, expert_imbalance))
        fields.update(dp_comm_fields(dp_comm, density))
        plan = PlanSpec.build(fields, context="plan")

        from echo_plan.replay.interference import InterferenceModel, load_interference
        from echo_plan.simulate import simulate
        from echo_plan.trace.cache import TraceCache

        interference = InterferenceModel.none() if no_interference else load_interference(interference_file)
        comm = None
        if collective_algorithm:
            from echo_plan.cost.collectives import collective_model_for
            from echo_plan.interop.msccl_model import MscclCollectiveModel, parse_algorithm_options

            comm = MscclCollectiveModel(collective_model_for(cluster_spec),
                                        parse_algorithm_options(collective_algorithm))
        from echo_plan.resilience.files import read_faults

        faults = read_faults(fault or (), fault_file)
        hangs = tuple(f for f in faults if f.kind.hang)
        if hangs and emit_records is None:
            raise SpecError("--fault", hangs[0].label(), "a hang stops the job and has no step time; give it with "
                                                         "--emit-records DIR to write the hung job's records")
        if hangs:
            from echo_plan.specs.faults import check_faults

            check_faults(faults, plan, cluster_spec)
            faults = tuple(f for f in faults if not f.kind.hang)
        fm = failure_model(failures_per_gpu_day, checkpoint_gbps_per_gpu, restart_min, detect_min)
        result = simulate(model_spec, cluster_spec, plan, stack=stack_spec, cache=TraceCache(cache_dir), faults=faults,
                          failure_model=fm,
                          interference=interference, timeline=trace is not None, comm=comm,
                          memory_headroom_bytes=headroom, traffic=True)
        if trace is not None:
            from echo_plan.replay.timeline import write_chrome_trace

            write_chrome_trace(trace, result)
        emitted = None
        if emit_records is not None:
            from echo_plan.resilience.diagnose.emit import emit_records as write_records

            emitted = write_records(model_spec, cluster_spec, plan, stack=stack_spec, cache=TraceCache(cache_dir),
                                    faults=faults + hangs, out=emit_records, fmt=fmt, steps=record_steps,
                                    noise=record_noise, seed=record_seed, buffer=record_buffer)
        if as_json:
            out = result.as_json()
            if emitted is not None:
                out["emitted_records"] = emitted
            print_json(out)
        else:
            from echo_plan.commands.simulate_view import print_result

            print_result(result, trace)
            if emitted is not None:
                typer.echo(f"records: {emitted['files']} {emitted['format']} files in {emitted['folder']} "
                        f"({emitted['steps']} steps, up to {emitted['records_per_rank_max']} records per rank"
                        + (f", faults {', '.join(emitted['faults'])}" if emitted['faults'] else "") + ")")
