"""SoftwareSpec: what the training framework does, beside the model, the cluster and the plan.

Two runs of the same model, cluster and layout differ by their software stack: whether attention
is one fused kernel or four, whether dropout is on (its masks are saved and its kernels cost
time), whether tensor-parallel communication hides behind the GEMMs (Transformer Engine's
userbuffers), in which dtype data-parallel gradients are reduced, what the distributed optimizer
shards, which modules selective recomputation re-runs. The tracer, the replay and the memory
model read these settings; presets live in ``stacks/*.yaml`` and cite where each setting comes
from. A plan switch that the stack cannot honour (overlapping the gradient reduction on a stack
that has no such overlap) is switched off and the simulation says so.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from echo_plan.specs.base import Spec
from echo_plan.specs.cluster import DType
from echo_plan.specs.plan import Schedule
from echo_plan.specs.software_signature import fp8_signature, precision_signature, trace_signature
from echo_plan.specs.software_kinds import (BLOCK_SCALED_MIN_SM_ARCH, AttentionKernel, AttentionLibrary, CPComm,
                                            CheckpointUnit, CPRuntime, CrossEntropy, CudaAllocator, CudaGraphScope, DeepEPRelease,
                                            Fp8Kernels, Fp8Recipe, GradientBuffers, KernelFamily, MoEDispatcher,
                                            OptimizerOffload, OptimizerSharding, PipelineRuntime, RecomputeModule,
                                            RecomputePolicy, TPRuntime)

# the enums live in software_kinds.py; importing them from here keeps working
__all__ = ["AttentionKernel", "AttentionLibrary", "BLOCK_SCALED_MIN_SM_ARCH", "CPComm", "CPRuntime", "CrossEntropy",
           "CudaAllocator", "CudaGraphScope", "DeepEPRelease", "Fp8Kernels", "Fp8Recipe", "GRAD_REDUCE_DTYPES",
           "GradientBuffers", "KernelFamily", "MoEDispatcher", "OptimizerOffload", "OptimizerSharding", "PipelineRuntime",
           "RecomputeModule", "RecomputePolicy", "SoftwareSpec", "TPRuntime", "CheckpointUnit"]

GRAD_REDUCE_DTYPES = (DType.FP32, DType.BF16, DType.FP16)


def _capability(what: str) -> Any:
    """A feature the framework has unless its preset says otherwise."""
    return Field(default=True, description=f"the framework can {what}")


class SoftwareSpec(Spec):
    """The training framework's behaviour. Probabilities are fractions in [0, 1)."""

    name: str = Field(min_length=1)
    base: str = Field(default="", description="the preset this stack derives from (its own name for a preset)")
    description: str = ""
    attention: AttentionKernel = AttentionKernel.FUSED
    attention_library: AttentionLibrary = Field(
        default=AttentionLibrary.CUDNN, description="whose fused-attention kernels run (fused attention only)")
    kernels: KernelFamily = Field(
        default=KernelFamily.NVIDIA, description="whose kernels the layers run (nvidia: Transformer Engine, Apex; pytorch: "
        "aten, SDPA, Inductor): the cluster's compute calibration for that family where it carries one")
    hidden_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout after attention, MLP, embedding")
    attention_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout on attention probabilities")
    fused_elementwise: bool = Field(
        default=True, description="bias+activation and bias+dropout+residual-add as one kernel each")
    torch_compile: bool | None = Field(
        default=None, description="PyTorch-native stacks: torch.compile on (true) or eager (false); what it fuses here "
                                  "is the elementwise chains (SwiGLU, RoPE, residual adds), so it sets "
                                  "fused_elementwise, and the norms inside the compiled blocks (fused_norm says what "
                                  "the norm module runs eagerly); None: fused_elementwise as given")
    fused_projections: bool = Field(
        default=True,
        description="Q, K and V as one GEMM and a gated MLP's gate and up projections as one (Megatron-Core's "
                    "linear_qkv and linear_fc1); false: a GEMM and a weight each (torchtitan's wq/wk/wv and w1/w3, "
                    "Hugging Face's q_proj/k_proj/v_proj and gate_proj/up_proj), which changes what torchtitan's "
                    "per-op checkpointing keeps; their input is gathered once for all of them (with TP communication "
                    "overlap as one ring beside every weight's GEMM)")
    gradient_accumulation_fusion: bool = Field(
        default=True, description="weight-gradient GEMMs accumulate into the fp32 main-grad buffer themselves")
    tp_comm_overlap: bool = Field(
        default=False, description="TP all-gather / reduce-scatter pipelined with the GEMMs (needs sequence parallel)")
    overlap_grad_reduce: bool = Field(default=True, description="the framework can overlap DP gradient reduction")
    overlap_param_gather: bool = Field(default=True, description="the framework can overlap the parameter all-gather")
    overlap_p2p: bool = Field(default=False, description="pipeline sends do not block the sender's next compute")
    grad_reduce_dtype: DType | None = Field(
        default=None, description="dtype of the DP gradient buffer and its reduction; None: fp32 for bf16, fp16 for fp16")
    optimizer_sharding: OptimizerSharding = OptimizerSharding.STATES
    gradient_buffers: GradientBuffers = Field(
        default=GradientBuffers.MEGATRON,
        description="megatron (each weight gradient added into the fp32 buffer and freed; a sharded optimizer "
                    "reduce-scatters it) or deepspeed-bf16 (DeepSpeed's BF16_Optimizer: bf16 gradients kept between "
                    "backward passes, added through an fp32 copy, the buffer all-reduced before the sharded step)")
    optimizer_state_bytes: float | None = Field(
        default=None, gt=0, le=64,
        description="bytes per parameter of master weights + Adam moments before sharding; None: memory.yaml's "
                    "(12 for bf16: three fp32 tensors)")
    sharded_param_bytes: float = Field(
        default=2.0, ge=0, le=16,
        description="parameters sharding: bytes per parameter the sharded parameters hold beside the optimizer "
                    "states (0: the shards are the fp32 master weights themselves, as FSDP2 with mixed precision "
                    "keeps them; 2: bf16 shards beside fp32 masters, as DeepSpeed ZeRO-3)")
    sequence_parallel: bool = Field(default=True, description="the framework has sequence parallelism")
    recompute_modules: tuple[RecomputeModule, ...] = (RecomputeModule.CORE_ATTN,)
    recompute_policy: RecomputePolicy = Field(
        default=RecomputePolicy.MODULES,
        description="selective recompute by modules (Megatron-Core's recompute_modules) or by ops (torchtitan's "
                    "per-op policy: the layer checkpointed, the outputs of every other matmul and of attention kept)")
    moe_dispatcher: MoEDispatcher = MoEDispatcher.ALLTOALL
    moe_grouped_gemm: bool = Field(default=True, description="local experts as one grouped GEMM (else a GEMM each)")
    moe_permute_fusion: bool = Field(default=True, description="TE's fused token permute/unpermute kernels")
    moe_probs_in_activation: bool = Field(
        default=True, description="MoE: the router probabilities travel with the token copies and weight the experts' "
                                  "activation (Megatron-Core >= 0.12.1, 'memory efficient token permutation'), so "
                                  "un-permutation keeps no expert output for backward; false: Megatron-Core <= 0.12.0, "
                                  "the probabilities weight the copies at un-permutation")
    moe_act_input_fp8: bool = Field(
        default=False, description="MoE with the moe_act recompute: the experts' activation keeps its input in FP8 "
                                   "(1x128 tiles with their scales) instead of bf16, and its backward reads that "
                                   "(DeepSeek-V3 report 3.3.3: the SwiGLU inputs cached in FP8)")
    moe_dispatch_fp8: bool = Field(
        default=False, description="MoE with FP8 GEMMs and expert parallelism: the tokens are cast to FP8 (1x128 "
                                   "tiles) before the dispatch, which moves FP8 rows with their scales to experts "
                                   "that take them as they are, and the gradients before the experts' FC2 are "
                                   "dispatched in FP8 too; the combines stay bf16 (DeepSeek-V3 report 3.3.3, DeepEP)")
    deepep_release: DeepEPRelease = Field(
        default=DeepEPRelease.APR_2025,
        description="MoE with the deepep dispatcher: the DeepEP release whose kernels run the exchange, each costed "
                    "with what its own published H800 benchmark reaches of NVLink and the network: 2025-04 (IBGDA, "
                    "the current figures) or 2025-02 (the first release, what DeepSeek-V3 trained with)")
    moe_comm_sms: int | None = Field(
        default=None, ge=1, le=1024,
        description="MoE with the deepep dispatcher: streaming multiprocessors the exchange's kernels hold while "
                    "they run (DeepSeek-V3: 20 of the H800's 132), which GEMMs and attention beside them lose; "
                    "None: the interference model's own all-to-all factors")
    fp8_gemms_leave_comm_sms: bool = Field(
        default=False,
        description="MoE with the deepep dispatcher and moe_comm_sms: the stack's FP8 GEMMs are persistent kernels "
                    "launched on the SMs the exchange leaves, for the whole step, whether the exchange runs or not "
                    "(DeepSeek-V3: DeepGEMM-style kernels on 112 of the H800's 132 SMs, the grids of its published "
                    "profile); False: they take every SM and lose moe_comm_sms only while the exchange runs")
    moe_a2a_overlap: bool = Field(
        default=False, description="MoE: in the steady state each forward runs paired with the next backward, one "
                                   "micro-batch's all-to-all under the other's compute (Megatron-Core "
                                   "--overlap-moe-expert-parallel-comm, Megatron-Bridge moe_a2a_overlap)")
    fp8_recipe: Fp8Recipe = Field(default=Fp8Recipe.DELAYED,
                                  description="FP8 scaling recipe of the GEMMs when the plan's dtype is fp8")
    fp8_kernels: Fp8Kernels = Field(
        default=Fp8Kernels.TRANSFORMER_ENGINE,
        description="blockwise FP8: whose kernels surround the GEMMs. deepseek (DeepSeek-V3's stack, as its published "
                    "profile shows): a column-major layout of the activations' scales before each dense GEMM of "
                    "activations (forward and input gradient), the FP8 weights' transposes made in each backward, "
                    "and a tensor needed in both directions cast by two kernels (per token, per channel)")
    fp8_attention_output_e5m6: bool = Field(
        default=False,
        description="blockwise FP8: the attention output (the output projection's input, which attention's backward "
                    "reads too) is kept for backward only in DeepSeek's 12-bit E5M6 format, not in bf16 and FP8: one "
                    "cast in forward, one back in backward, the projection's weight-gradient operand cast per "
                    "channel from it (DeepSeek-V3 report 3.3.3); multi-head latent attention, as DeepSeek's")
    fsdp_copy_kernels: bool = Field(
        default=False,
        description="sharding parameters: the data-parallel runtime is PyTorch's FSDP2 (fully_shard), which copies "
                    "each all-gather's output into the unsharded parameters (split_with_sizes_copy) and each unit's "
                    "gradients into the reduce-scatter buffer in the reduce dtype (chunk_cat), both on the compute "
                    "stream; false: runtimes that gather into and reduce from the parameters' own buffers (FSDP1's "
                    "flat parameters, DeepSpeed ZeRO-3, Megatron's distributed optimizer)")
    optimizer_in_backward: bool = Field(
        default=False,
        description="each parameter's optimizer step runs in the backward as soon as its sharded gradient is reduced, "
                    "which is then freed (torchtitan's optimizer.early_step_in_backward): no sharded gradients held "
                    "for the step; with FSDP, one micro-batch a step, no pipeline or expert parallelism, as torchtitan "
                    "takes it. Its time is counted after the backward, as without it (JUDGEMENT: the same work on the "
                    "same stream, a few ms a step)")
    optimizer_offload: OptimizerOffload = Field(
        default=OptimizerOffload.NONE,
        description="how the stack runs the optimizer on the CPU when a plan offloads it (--offload-optimizer): "
                    "megatron-hybrid (Megatron-Core's HybridDeviceOptimizer), zero-offload (DeepSpeed's "
                    "offload_optimizer); none: the stack cannot, or its way (FSDP2's CPUOffloadPolicy, which moves the "
                    "parameters too) is not modelled")
    fp8_param_gather: bool = Field(
        default=False, description="weights kept and all-gathered in FP8 (no bf16 copy; Megatron --fp8-param-gather)")
    fp4_param_gather: bool = Field(
        default=False, description="dtype fp4: weights kept and all-gathered in NVFP4 (no bf16 copy; Megatron "
                                   "--fp4-param-gather, Megatron-Bridge's NVFP4 recipe from 26.06)")
    fp8_transposes: bool | None = Field(
        default=None, description="per-tensor FP8 (delayed, current): Transformer Engine keeps FP8 transposes of "
                                  "weights, gradients and saved inputs, because Hopper's FP8 tensor cores take only "
                                  "the TN layout; false: the GEMMs take any layout and no transpose is made (TE on "
                                  "sm100 and newer); None: as the GPU has it (simulate decides from the cluster)")
    fp8_save_original_input: bool = Field(
        default=False, description="fp8: a linear whose bf16 input is kept anyway, or is recomputed, saves that input "
                                   "instead of its own FP8 copy and re-casts it in backward (Megatron-Core >= 0.14 "
                                   "with Transformer Engine >= 2.6, set_save_original_input: the attention output "
                                   "projection and the shared experts' FC1 under non-delayed recipes, the linears "
                                   "after a recomputed norm, the experts' FC2 under moe_act recompute)")
    moe_host_sync: bool = Field(
        default=False,
        description="MoE: the dispatcher copies each expert's token count to the host before the token permutation "
                    "and the host waits for the GPU there (Megatron-Core's dropless alltoall, allgather and flex "
                    "dispatchers: Transformer Engine's grouped GEMM takes its splits as a host list), so the kernels "
                    "after it are released at the host's pace (replay/host.py, with the cluster's calibrated host "
                    "issue time); false: the host always runs ahead of the GPU")
    cuda_graph_scope: tuple[CudaGraphScope, ...] = Field(
        default=(), description="parts of each layer captured in CUDA graphs (launched by the host as one); "
                                "read with moe_host_sync")
    cuda_allocator: CudaAllocator = Field(
        default=CudaAllocator.DEFAULT,
        description="PyTorch's caching allocator as the framework's launch sets it: default or expandable_segments "
                    "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which fragments less")
    cp_comm: CPComm = Field(default=CPComm.P2P, description="context-parallel attention: ring p2p or all-gather")
    cp_runtime: CPRuntime = Field(
        default=CPRuntime.TRANSFORMER_ENGINE,
        description="what runs context-parallel attention: transformer_engine (Megatron-Core's: a kernel per query "
                    "chunk and step, a fused merge) or torch (torch's ring attention, torchtitan's: an SDPA call per "
                    "ring step on K/V repeated to the query heads, eager fp32 merges, fp32 dQ/dK/dV accumulators, "
                    "dK/dV sent round the ring after each step; cp_comm all_gather is its rotate method allgather, "
                    "p2p its alltoall)")
    cross_entropy: CrossEntropy = Field(
        default=CrossEntropy.UNFUSED,
        description="the loss kernels: unfused (Megatron-Core's default: the logits upcast to fp32, the fp32 softmax "
                    "kept for backward) or te (--cross-entropy-loss-fusion with --cross-entropy-fusion-impl te, "
                    "which Megatron-Bridge's recipes set: the bf16 logits keep their own gradient, no fp32 copy), "
                    "torch (PyTorch's F.cross_entropy on an fp32 copy of the logits, torchtitan's loss until 2025; "
                    "with TP its loss_parallel) or torch_compiled (that loss under torch.compile, torchtitan's from "
                    "2025 when it compiles: the bf16 logits kept, a bf16 gradient written; an eager run "
                    "(torch_compile false) gets torch)")
    fused_norm: bool = Field(
        default=True,
        description="RMSNorm as one fused kernel each way (Transformer Engine, Apex, torchtitan's fused_rmsnorm); "
                    "false: the eager PyTorch module (torchtitan's norm_type rmsnorm, Hugging Face's LlamaRMSNorm): "
                    "an fp32 copy, its square, mean and reciprocal square root, the product, the cast back and the "
                    "weight's product, each a kernel. torch_compile fuses the norms inside the compiled blocks (not "
                    "the final norm, which torchtitan leaves outside them)")
    fused_bias_dropout_add: bool | None = Field(
        default=None,
        description="bias + dropout + residual add as one kernel; None: as fused_elementwise says (Megatron-Core's "
                    "bias_dropout_fusion apart from bias_activation_fusion: Megatron-Bridge's GPT-OSS provider turns "
                    "only the first off)")
    full_recompute_unit: CheckpointUnit = Field(
        default=CheckpointUnit.BLOCK, description="what recompute full checkpoints: block (the whole layer, its input "
        "kept) or submodules (a dense layer's attention and MLP each, NeMo AutoModel's: their inputs and the norms' "
        "saved tensors kept, the same GEMMs recomputed; MoE layers stay blocks)")
    tp_runtime: TPRuntime = Field(
        default=TPRuntime.MEGATRON,
        description="what runs tensor/sequence parallelism: megatron (sequence-first activations, no copies) or torch "
                    "(DTensor's batch-first ones: with more than one sequence a micro-batch, a copy after each "
                    "sequence-parallel all-gather and before each reduce-scatter; with tp_comm_overlap, async TP's "
                    "fused kernels, the reduce-scatters' copies only)")
    pipeline_runtime: PipelineRuntime = Field(
        default=PipelineRuntime.MEGATRON,
        description="what runs the pipeline schedule: megatron (Megatron-Core's schedules) or torch "
                    "(torch.distributed.pipelining, torchtitan's: every stage but the first holds a receive buffer "
                    "for each micro-batch's activations and every stage but the last one for its gradients, made "
                    "before the step; the last stage keeps each micro-batch's output until the step ends)")
    fused_rope_scales: bool = Field(
        default=True,
        description="the fused RoPE kernel also applies a model's rope_attention_factor (YaRN); false "
                    "(Megatron-Core: Transformer Engine's fused RoPE takes no such factor, so apply_rotary_pos_emb "
                    "falls back to its unfused ops, scaling cos and sin on every call): a model whose factor is not "
                    "1 runs the unfused RoPE whatever fused_elementwise says")
    # what the framework can do at all (false: a plan asking for it is refused, and the search prunes it)
    pipeline_parallel: bool = _capability("split the model into pipeline stages (false: DeepSpeed ZeRO-2/3, whose "
                                          "PipelineEngine takes ZeRO stage 0 or 1 only)")
    tensor_parallel: bool = _capability("shard layers over tensor parallelism (false: llm-foundry 0.3)")
    context_parallel: bool = _capability("split the sequence over context parallelism (false: llm-foundry 0.3)")
    partial_recompute: bool = _capability("checkpoint some of a stage's layers whole (--recompute-layers; false: "
                                          "every layer or none, llm-foundry 0.3's activation_checkpointing)")
    pipeline_schedules: tuple[Schedule, ...] = Field(
        default=(), description="the pipeline schedules the framework can run (its runtime's); empty: every schedule "
                                "the replay has (docs/schedules.md)")
    sources: tuple[str, ...] = ()

    @field_validator("grad_reduce_dtype")
    @classmethod
    def _grad_dtype(cls, value: DType | None) -> DType | None:
        if value is not None and value not in GRAD_REDUCE_DTYPES:
            raise ValueError(f"must be one of {', '.join(d.value for d in GRAD_REDUCE_DTYPES)}")
        return value

    @model_validator(mode="after")
    def _library_needs_fused(self) -> "SoftwareSpec":
        if self.attention is not AttentionKernel.FUSED and self.attention_library is not AttentionLibrary.CUDNN:
            raise ValueError(f"attention_library {self.attention_library.value} needs attention: fused "
                             f"(this stack's attention is {self.attention.value})")
        return self

    @model_validator(mode="after")
    def _deepspeed_buffers(self) -> "SoftwareSpec":
        if self.gradient_buffers is GradientBuffers.DEEPSPEED_BF16 and self.gradient_accumulation_fusion:
            raise ValueError("gradient_buffers deepspeed-bf16 adds the weight gradients after their GEMMs: it needs "
                             "gradient_accumulation_fusion: false")
        return self

    @model_validator(mode="after")
    def _compile_fuses(self) -> "SoftwareSpec":
        if self.torch_compile is not None and self.fused_elementwise != self.torch_compile:
            object.__setattr__(self, "fused_elementwise", self.torch_compile)
        if self.torch_compile is False and self.cross_entropy is CrossEntropy.TORCH_COMPILED:
            object.__setattr__(self, "cross_entropy", CrossEntropy.TORCH)  # no compiled loss in an eager run
        return self

    @model_validator(mode="after")
    def _deepep_only(self) -> "SoftwareSpec":
        for name in ("moe_dispatch_fp8", "moe_comm_sms", "fp8_gemms_leave_comm_sms"):
            if getattr(self, name) and self.moe_dispatcher is not MoEDispatcher.DEEPEP:
                raise ValueError(f"{name} is DeepEP's (moe_dispatcher: deepep); this stack's dispatcher is "
                                 f"{self.moe_dispatcher.value}")
        if self.deepep_release is not DeepEPRelease.APR_2025 and self.moe_dispatcher is not MoEDispatcher.DEEPEP:
            raise ValueError(f"deepep_release {self.deepep_release.value} is DeepEP's (moe_dispatcher: deepep); this stack's dispatcher is "
                             f"{self.moe_dispatcher.value}")
        if self.fp8_gemms_leave_comm_sms and not self.moe_comm_sms:
            raise ValueError("fp8_gemms_leave_comm_sms needs moe_comm_sms (how many SMs the FP8 GEMMs leave)")
        return self

    @property
    def deepseek_fp8_kernels(self) -> bool:
        """DeepSeek's own kernels surround the FP8 GEMMs: ``fp8_kernels: deepseek`` beside its blockwise recipe."""
        return self.fp8_recipe is Fp8Recipe.BLOCKWISE and self.fp8_kernels is Fp8Kernels.DEEPSEEK

    def fp8_gemm_sms_held(self, is_moe: bool, ep: int, dtype: DType) -> int:
        """SMs this stack's FP8 GEMMs leave to the expert exchange for a plan's whole step (0: they take every
        SM): moe_comm_sms where fp8_gemms_leave_comm_sms says so, the plan exchanges experts and its GEMMs are
        FP8."""
        on = self.fp8_gemms_leave_comm_sms and is_moe and ep > 1 and DType(dtype) is DType.FP8
        return (self.moe_comm_sms or 0) if on else 0

    @field_validator("recompute_modules")
    @classmethod
    def _modules(cls, value: tuple[RecomputeModule, ...]) -> tuple[RecomputeModule, ...]:
        return tuple(dict.fromkeys(value))  # order-preserving de-duplication

    @property
    def dropout(self) -> bool:
        return self.hidden_dropout > 0.0 or self.attention_dropout > 0.0

    def grad_bytes(self, param_dtype: DType) -> int:
        """Bytes per element of the DP gradient buffer (and of what the DP collectives move)."""
        if self.grad_reduce_dtype is not None:
            return self.grad_reduce_dtype.nbytes
        return 4 if param_dtype is DType.BF16 else 2  # Megatron-LM: fp32 main grads with bf16, fp16 grads with fp16

    def rope_scale_per_call(self, factor: float) -> float | None:
        """A model's RoPE attention factor when this stack's fused RoPE cannot apply it (so RoPE runs as unfused
        ops scaling cos and sin on every call: Megatron-Core's fallback), else None."""
        return factor if factor != 1.0 and not self.fused_rope_scales else None

    @property
    def block_norm_fused(self) -> bool:
        """Whether the norms inside a transformer block run as one kernel (fused, or compiled with the block)."""
        return self.fused_norm or self.torch_compile is True

    @property
    def bias_dropout_add_fused(self) -> bool:
        """Whether bias + dropout + residual add runs as one kernel."""
        return self.fused_elementwise if self.fused_bias_dropout_add is None else self.fused_bias_dropout_add

    def copies_tp_layout(self, micro_batch_size: int) -> bool:
        """Whether this stack's tensor parallelism copies around its sequence-parallel collectives: DTensor's
        batch-first layout (``tp_runtime`` torch) with more than one sequence a micro-batch (``trace/parallel.py``)."""
        return self.tp_runtime is TPRuntime.TORCH and micro_batch_size > 1

    def trace_signature(self) -> str:
        """The settings that change what the tracer records (part of every trace's cache key)."""
        return trace_signature(self)

    def fp8_signature(self) -> str:
        """The FP8 settings that change an fp8 trace (appended to its cache key; bf16 traces ignore them)."""
        return fp8_signature(self)

    def precision_signature(self, dtype: DType) -> str:
        """What the plan's precision adds to a trace's cache key: the FP8 or NVFP4 settings, nothing for bf16."""
        return precision_signature(self, dtype)

    def as_run(self, plan: Any, sm_arch: int) -> "SoftwareSpec":
        """The stack as ``plan`` runs it on a GPU of compute capability ``sm_arch`` x10 (``for_plan``, ``on_gpu``)."""
        return self.for_plan(plan).on_gpu(sm_arch)

    def on_gpu(self, sm_arch: int) -> "SoftwareSpec":
        """The stack as Transformer Engine runs it on a GPU of compute capability ``sm_arch`` x10: per-tensor FP8
        keeps transposes only where the FP8 GEMMs take the TN layout alone (TE's
        ``nvte_is_non_tn_fp8_gemm_supported``: sm100-119 and sm130 onwards take any layout)."""
        if self.fp8_transposes is not None:
            return self
        any_layout = 100 <= sm_arch < 120 or sm_arch >= 130
        return self.replace(fp8_transposes=not any_layout)

    def for_plan(self, plan: Any) -> "SoftwareSpec":
        """The stack as ``plan`` runs it: Megatron keeps FP8 parameters (``fp8_param_gather``) only with the
        distributed optimizer (Megatron-LM's ``validate_args`` refuses them otherwise), so without it the
        weights stay bf16 beside their FP8 copies."""
        if self.fp8_param_gather and plan.dtype is DType.FP8 and not plan.distributed_optimizer:
            return self.replace(fp8_param_gather=False)
        return self

