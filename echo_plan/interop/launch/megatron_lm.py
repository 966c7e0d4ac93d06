"""Megatron-LM's ``pretrain_gpt.py`` command line, both ways.

One table (:data:`FLAGS`) says for each flag which Megatron-Core field it sets and how (a value, a
switch that sets true or false, a constant), so export and import cannot disagree. The export is a
``torchrun`` command for a timing run on mock data (NullTokenizer with the model's vocabulary);
the lines to change for real data are said in its comments. Import reads a command line (or a
script holding one, with ``export VAR=...`` lines and backslash continuations), or the argument
dump Megatron-LM prints at the top of its log; flags of data, logging, checkpoints and the learning
rate are read past, and any other flag it does not know is refused with one line.
"""

from __future__ import annotations

import ast
import shlex
from dataclasses import dataclass, replace
from typing import Any, Mapping

from echo_plan.interop.launch.job import (ALLOC_CONF, EXPANDABLE, CannotImport, LaunchExport, LaunchFormat, LaunchJob,
                                          allocator_of)
from echo_plan.interop.launch.mcore import FLASH_LIBRARIES, to_mcore
from echo_plan.interop.launch.mcore_read import job_from_mcore
from echo_plan.interop.launch.megatron_ignored import IGNORED_FLAGS
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec
from echo_plan.specs.software import CudaAllocator

FMT = LaunchFormat.MEGATRON_LM


@dataclass(frozen=True)
class Flag:
    flag: str
    section: str
    key: str
    kind: str  # int | float | str | list | true (store_true) | false (store_false) | const
    const: Any = None
    dest: str = ""  # its name in Megatron-LM's argument dump, when not the flag's

    @property
    def arg_name(self) -> str:
        return self.dest or self.flag[2:].replace("-", "_")


def _f(flag: str, key: str = "", kind: str = "int", section: str = "model", const: Any = None, dest: str = "") -> Flag:
    return Flag(flag, section, key or flag[2:].replace("-", "_"), kind, const, dest)


FLAGS: tuple[Flag, ...] = (
    _f("--num-layers"), _f("--hidden-size"), _f("--ffn-hidden-size"), _f("--num-attention-heads"),
    _f("--num-query-groups"), _f("--kv-channels"), _f("--seq-length"), _f("--max-position-embeddings"),
    _f("--vocab-size"),
    _f("--swiglu", "activation", "const", const="swiglu"), _f("--squared-relu", "activation", "const", const="squared_relu"),
    _f("--normalization", kind="str"), _f("--apply-layernorm-1p", "layernorm_zero_centered_gamma", "true"),
    _f("--position-embedding-type", kind="str"), _f("--rotary-percent", kind="float"),
    _f("--untie-embeddings-and-output-weights", "share_embeddings_and_output_weights", "false",
       dest="untie_embeddings_and_output_weights"),
    _f("--disable-bias-linear", "add_bias_linear", "false", dest="add_bias_linear"),
    _f("--qk-layernorm", kind="true"), _f("--mtp-num-layers"),
    _f("--multi-latent-attention", kind="true"), _f("--q-lora-rank"), _f("--kv-lora-rank"), _f("--qk-head-dim"),
    _f("--qk-pos-emb-head-dim"), _f("--v-head-dim"),
    _f("--num-experts", "num_moe_experts"), _f("--moe-router-topk"), _f("--moe-ffn-hidden-size"),
    _f("--moe-router-score-function", kind="str"), _f("--moe-layer-freq", kind="str"),
    _f("--moe-shared-expert-intermediate-size"), _f("--moe-router-num-groups"), _f("--moe-router-group-topk"),
    _f("--moe-expert-capacity-factor", kind="float"),
    _f("--tensor-model-parallel-size"), _f("--pipeline-model-parallel-size"), _f("--context-parallel-size"),
    _f("--expert-model-parallel-size"), _f("--expert-tensor-parallel-size"),
    _f("--num-virtual-stages-per-pipeline-rank", "virtual_pipeline_model_parallel_size"),
    _f("--num-layers-per-virtual-pipeline-stage"), _f("--pipeline-model-parallel-layout", kind="str"),
    _f("--decoder-first-pipeline-num-layers", "num_layers_in_first_pipeline_stage"),
    _f("--decoder-last-pipeline-num-layers", "num_layers_in_last_pipeline_stage"),
    _f("--sequence-parallel", kind="true"),
    _f("--micro-batch-size", section="train"), _f("--global-batch-size", section="train"),
    _f("--recompute-granularity", kind="str"), _f("--recompute-modules", kind="list"),
    _f("--recompute-method", kind="str"), _f("--recompute-num-layers"),
    _f("--bf16", kind="true"), _f("--fp16", kind="true"),
    _f("--fp8-format", "fp8", "str", dest="fp8"), _f("--fp8-recipe", kind="str"),
    _f("--fp8-param-gather", "fp8_param", "true", dest="fp8_param_gather"),
    _f("--fp4-format", "fp4", "str", dest="fp4"), _f("--fp4-recipe", kind="str"),
    _f("--fp4-param-gather", "fp4_param", "true", dest="fp4_param_gather"),
    _f("--attention-backend", kind="str"), _f("--hidden-dropout", kind="float"), _f("--attention-dropout", kind="float"),
    _f("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", "false",
       dest="gradient_accumulation_fusion"),
    _f("--no-bias-swiglu-fusion", "bias_activation_fusion", "false", dest="bias_swiglu_fusion"),
    _f("--no-bias-gelu-fusion", "bias_activation_fusion", "false", dest="bias_gelu_fusion"),
    _f("--no-bias-dropout-fusion", "bias_dropout_fusion", "false", dest="bias_dropout_fusion"),
    _f("--no-masked-softmax-fusion", "masked_softmax_fusion", "false", dest="masked_softmax_fusion"),
    _f("--tp-comm-overlap", kind="true"),
    _f("--no-overlap-p2p-communication", "overlap_p2p_comm", "false", dest="overlap_p2p_comm"),
    _f("--cp-comm-type", kind="str"),
    _f("--moe-grouped-gemm", kind="true"), _f("--moe-permute-fusion", kind="true"),
    _f("--moe-token-dispatcher-type", kind="str"), _f("--moe-flex-dispatcher-backend", kind="str"),
    _f("--moe-enable-deepep", kind="true"), _f("--moe-deepep-num-sms"),
    _f("--overlap-moe-expert-parallel-comm", kind="true"),
    _f("--use-distributed-optimizer", section="ddp", kind="true"),
    _f("--overlap-grad-reduce", section="ddp", kind="true"), _f("--overlap-param-gather", section="ddp", kind="true"),
    _f("--reuse-grad-buf-for-mxfp8-param-ag", section="ddp", kind="true"),
    _f("--accumulate-allreduce-grads-in-fp32", "grad_reduce_in_fp32", "true", "ddp"),
    _f("--grad-reduce-in-bf16", "grad_reduce_in_fp32", "false", "ddp", dest="grad_reduce_in_bf16"),
    _f("--use-precision-aware-optimizer", section="optimizer", kind="true"),
    _f("--exp-avg-dtype", section="optimizer", kind="str"), _f("--exp-avg-sq-dtype", section="optimizer", kind="str"),
    _f("--optimizer-cpu-offload", section="optimizer", kind="true"),
    _f("--optimizer-offload-fraction", section="optimizer", kind="float"),
    _f("--overlap-cpu-optimizer-d2h-h2d", section="optimizer", kind="true"),
)
BY_FLAG = {f.flag: f for f in FLAGS}
# Megatron-LM's defaults for the fields an import reads (arguments.py), where they differ from "absent"
DEFAULTS = {"model": {"hidden_dropout": 0.1, "attention_dropout": 0.1, "normalization": "LayerNorm",
                      "position_embedding_type": "learned_absolute", "share_embeddings_and_output_weights": True,
                      "add_bias_linear": True, "activation": "gelu", "bias_activation_fusion": True,
                      "bias_dropout_fusion": True, "masked_softmax_fusion": True, "gradient_accumulation_fusion": True,
                      "overlap_p2p_comm": True, "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False,
                      "moe_permute_fusion": False},
            "ddp": {"overlap_grad_reduce": False, "use_distributed_optimizer": False}}


def _render_value(flag: Flag, value: Any) -> list[str] | None:
    """The tokens of ``flag`` for ``value``, or None when the flag is not written for it."""
    if value is None:
        return None
    if flag.kind == "const":
        return [flag.flag] if value == flag.const else None
    if flag.kind in ("true", "false"):
        return [flag.flag] if bool(value) == (flag.kind == "true") else None
    if flag.kind == "list":
        return [flag.flag, *map(str, value)]
    if flag.key == "moe_layer_freq" and isinstance(value, list):
        first = value.index(1) if 1 in value else len(value)  # to_mcore writes leading dense layers only
        return [flag.flag, f"([0]*{first}+[1]*{len(value) - first})"]
    return [flag.flag, str(value)]


def environment(stack: SoftwareSpec, plan: PlanSpec) -> dict[str, str]:
    """The environment the stack relies on (Transformer Engine's attention backend, Megatron's stream rule)."""
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # Megatron-LM: TP/SP communication issued in program order
    if stack.attention_library in FLASH_LIBRARIES:
        env.update(NVTE_FLASH_ATTN="1", NVTE_FUSED_ATTN="0")
    else:
        env.update(NVTE_FLASH_ATTN="0", NVTE_FUSED_ATTN="1")
    if stack.cuda_allocator is CudaAllocator.EXPANDABLE_SEGMENTS:  # the memory predicted counts on it (memory.yaml)
        env[ALLOC_CONF] = EXPANDABLE
    return env


def export_megatron_lm(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec, cluster: ClusterSpec) -> LaunchExport:
    """The torchrun command of ``pretrain_gpt.py`` that runs ``plan`` as simulated (a timing run on mock data)."""
    sections = to_mcore(model, plan, stack, FMT)
    tokens: list[list[str]] = []
    written: set[tuple[str, str]] = set()
    for flag in FLAGS:
        if flag.flag == "--num-query-groups" and sections["model"]["num_query_groups"] != model.num_attention_heads:
            tokens.append(["--group-query-attention"])
        if flag.flag == "--no-bias-gelu-fusion" and model.activation.gated:
            continue
        if flag.flag == "--no-bias-swiglu-fusion" and not model.activation.gated:
            continue
        if flag.flag == "--num-query-groups" and sections["model"]["num_query_groups"] == model.num_attention_heads:
            continue
        value = sections[flag.section].get(flag.key)
        if flag.kind == "const" and (flag.section, flag.key) in written:
            continue
        rendered = _render_value(flag, value)
        if rendered:
            tokens.append(rendered)
            written.add((flag.section, flag.key))
    env = environment(stack, plan)
    nodes, per_node = cluster.num_nodes, cluster.gpus_per_node
    lines = [f"# echo-plan: {model.name}, {plan.short()}, stack {stack.name}, {plan.world_size} GPUs",
             "# A timing run on mock data; for real training replace --mock-data, --tokenizer-type and --vocab-size",
             "# with your data and tokenizer, and set --train-iters and the learning-rate schedule."]
    lines += [f"export {k}={v}" for k, v in env.items()]
    lines.append(f"torchrun --nnodes {nodes} --nproc-per-node {per_node} pretrain_gpt.py \\")
    body = [" ".join(shlex.quote(t) for t in tok) for tok in tokens]
    body += ["--mock-data --tokenizer-type NullTokenizer", "--train-iters 50 --lr 3e-4 --log-interval 1 --eval-iters 0"]
    lines += [f"    {b} \\" for b in body[:-1]] + [f"    {body[-1]}"]
    notes = ()
    if plan.expert_imbalance > 1.0:
        notes = (f"expert_imbalance {plan.expert_imbalance:g} is a simulation assumption; the job's routing decides",)
    return LaunchExport(FMT, "\n".join(lines) + "\n", env, notes)


def command_tokens(text: str, source: str) -> tuple[list[str], dict[str, str]]:
    """The argument tokens of a command line or script (what follows the training script when named) and
    the environment it sets (``VAR=value`` before the command, ``export VAR=value`` lines)."""
    env: dict[str, str] = {}
    joined = text.replace("\\\r\n", " ").replace("\\\n", " ")
    tokens: list[str] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise CannotImport(source, "command line", None, f"cannot be split into words ({exc})") from None
        if words and words[0] == "export":
            words = words[1:]
        while words and "=" in words[0] and not words[0].startswith("-"):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        tokens += words
    return tokens, env


def launcher_gpus(tokens: list[str], source: str) -> tuple[int | None, int | None, list[str]]:
    """(nodes, GPUs per node, the training script's arguments) from a torchrun/python command."""
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    head, args = (tokens[:script], tokens[script + 1:]) if script is not None else ([], tokens)
    nodes = per_node = None
    for i, t in enumerate(head):
        key, eq, value = t.partition("=")
        if key in ("--nnodes", "--nproc-per-node", "--nproc_per_node"):
            value = value if eq else (head[i + 1] if i + 1 < len(head) else "")
            if not value.isdigit():
                raise CannotImport(source, key, value or None, "a whole number (elastic ranges are not read)")
            if key == "--nnodes":
                nodes = int(value)
            else:
                per_node = int(value)
    return nodes, per_node, args


def sections_from_flags(args: list[str], source: str) -> dict[str, dict[str, Any]]:
    """Megatron-Core sections from ``pretrain_gpt.py`` arguments (Megatron-LM's defaults under them)."""
    sec: dict[str, dict[str, Any]] = {s: dict(DEFAULTS.get(s, {})) for s in ("model", "train", "ddp", "optimizer")}
    i = 0
    while i < len(args):
        token = args[i]
        flag, eq, inline = token.partition("=")
        values: list[str] = [inline] if eq else []
        j = i + 1
        while not eq and j < len(args) and not args[j].startswith("--"):
            values.append(args[j])
            j += 1
        i = j
        if not flag.startswith("--"):
            raise CannotImport(source, token, None, "expected a --flag here")
        if flag in IGNORED_FLAGS or flag == "--group-query-attention":
            continue
        spec = BY_FLAG.get(flag)
        if spec is None:
            raise CannotImport(source, flag, None, "not a Megatron-LM setting echo-plan reads; it may change the job "
                                                   "(docs/launch.md lists what is read)")
        sec[spec.section][spec.key] = _flag_value(spec, values, source)
    per_chunk = sec["model"].pop("num_layers_per_virtual_pipeline_stage", None)
    if per_chunk:  # the older flag: layers per chunk instead of chunks per rank
        layers, pp = int(sec["model"].get("num_layers", 0)), int(sec["model"].get("pipeline_model_parallel_size", 1))
        if per_chunk < 1 or layers % (pp * per_chunk):
            raise CannotImport(source, "--num-layers-per-virtual-pipeline-stage", per_chunk,
                               f"must divide the {layers} layers into pp {pp} x chunks")
        sec["model"]["virtual_pipeline_model_parallel_size"] = layers // (pp * per_chunk)
    return sec


def _flag_value(spec: Flag, values: list[str], source: str) -> Any:
    if spec.kind in ("true", "false", "const"):
        if values:
            raise CannotImport(source, spec.flag, " ".join(values), "a switch takes no value")
        return spec.const if spec.kind == "const" else spec.kind == "true"
    if spec.kind == "list":
        return list(values)
    if len(values) != 1:
        raise CannotImport(source, spec.flag, " ".join(values) or None, "expected one value")
    value = values[0]
    try:
        return int(value) if spec.kind == "int" else float(value) if spec.kind == "float" else value
    except ValueError:
        raise CannotImport(source, spec.flag, value, f"expected {'an integer' if spec.kind == 'int' else 'a number'}") from None


def import_megatron_lm(text: str, source: str, base_stack: SoftwareSpec, gpus: int | None = None) -> LaunchJob:
    """The job a ``pretrain_gpt.py`` command line (or script) describes; ``gpus`` when the launcher does not say."""
    tokens, env = command_tokens(text, source)
    nodes, per_node, args = launcher_gpus(tokens, source)
    world = gpus if gpus is not None else (nodes * per_node if nodes and per_node else None)
    if world is None:
        raise CannotImport(source, "GPUs", None, "the command has no torchrun --nnodes and --nproc-per-node; give "
                                                 "the job's GPU count with --gpus")
    sec = sections_from_flags(args, source)
    return _job(sec, env, base_stack, world, per_node, source)


def _job(sec: dict[str, dict[str, Any]], env: Mapping[str, str], base_stack: SoftwareSpec, world: int,
         per_node: int | None, source: str) -> LaunchJob:
    m = sec["model"]
    if not m.get("num_moe_experts"):  # a dense model: Megatron's MoE defaults say nothing of its stack
        for key in ("moe_token_dispatcher_type", "moe_grouped_gemm", "moe_permute_fusion"):
            m.pop(key, None)
    if not (m.get("bf16") or m.get("fp16")):
        raise CannotImport(source, "precision", "fp32", "training in fp32 is not modelled; the job needs --bf16 or "
                                                        "--fp16")
    if env.get("NVTE_FLASH_ATTN") == "1" and env.get("NVTE_FUSED_ATTN") == "0" and m.get("attention_backend") in (
            None, "auto"):
        m["attention_backend"] = "flash"
    if "grad_reduce_in_fp32" not in sec["ddp"]:
        sec["ddp"]["grad_reduce_in_fp32"] = bool(m.get("bf16"))  # Megatron-LM: fp32 main grads with bf16
    job = job_from_mcore(sec, base_stack, world, source, gpus_per_node=per_node)
    allocator = allocator_of(env)
    if allocator is not None and allocator is not job.stack.cuda_allocator:
        job = replace(job, stack=job.stack.model_copy(update={"cuda_allocator": allocator}))
    return job


def parse_argument_dump(text: str) -> dict[str, str] | None:
    """The ``name ..... value`` lines of Megatron-LM's argument dump in a log, or None when there is none."""
    start = text.find("------------------------ arguments ------------------------")
    if start < 0:
        return None
    out: dict[str, str] = {}
    for line in text[start:].splitlines()[1:]:
        if "-------------------- end of arguments" in line:
            break
        name, dots, value = line.strip().partition(" ")
        rest = value.lstrip(". ")
        if dots and name:
            out[name] = rest.strip()
    return out


def import_argument_dump(dump: Mapping[str, str], source: str, base_stack: SoftwareSpec) -> LaunchJob:
    """The job of a Megatron-LM log's argument dump (every argument with its value, defaults included)."""
    sec: dict[str, dict[str, Any]] = {s: {} for s in ("model", "train", "ddp", "optimizer")}
    for spec in FLAGS:
        raw = dump.get(spec.arg_name)
        if raw is None or raw == "None":
            continue
        value = _dump_value(raw)
        if spec.kind == "false":
            value = not value if spec.dest.startswith(("untie", "grad_reduce_in_bf16")) else value
            sec[spec.section].setdefault(spec.key, bool(value))
        elif spec.kind == "true":
            sec[spec.section][spec.key] = bool(value)
        elif spec.kind == "const":
            if value is True:
                sec[spec.section][spec.key] = spec.const
        else:
            sec[spec.section][spec.key] = value
    sec["model"].setdefault("activation", "gelu")
    world = int(_dump_value(dump.get("world_size", "0")) or 0)
    if world < 1:
        raise CannotImport(source, "world_size", dump.get("world_size"), "the argument dump has no world size")
    return _job(sec, {}, base_stack, world, None, source)


def _dump_value(raw: str) -> Any:
    if raw in ("True", "False"):
        return raw == "True"
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw
