"""The categories a software stack chooses among (``SoftwareSpec``'s enums), apart from the spec itself."""

from __future__ import annotations

from enum import Enum


class AttentionKernel(str, Enum):
    FUSED = "fused"  # FlashAttention / cuDNN fused attention: one kernel forward, one backward
    UNFUSED = "unfused"  # batched GEMM, fused scale-mask-softmax, dropout, batched GEMM (Megatron-LM before 2023)


class AttentionLibrary(str, Enum):
    """Which library's kernels run fused attention: the same traced ops, different speed (``compute.yaml``)."""

    CUDNN = "cudnn"  # Transformer Engine's cuDNN fused attention (its Hopper default from TE 1.6 on)
    FLASH_ATTN_2 = "flash-attn-2"  # Dao's FlashAttention-2 package (TE's first choice before 1.6; PyTorch SDPA's flash)
    FLASH_ATTN_TRITON = "flash-attn-triton"  # the Triton FlashAttention of flash-attn 1.x (llm-foundry's attn_impl triton)
    FLASH_ATTN_3 = "flash-attn-3"  # Dao's FlashAttention-3 (flash-attention's hopper/ kernels): Hopper only


class KernelFamily(str, Enum):
    """Whose kernels a stack's layers run: a cluster may carry a compute calibration of its own per family
    (``calibration.compute_by_kernels``), fitted on runs of stacks of that family, where the kernels of the two reach
    a different share of the same GPU (docs/validation.md, "PyTorch's own kernels on Hopper")."""

    NVIDIA = "nvidia"  # NVIDIA's training libraries: Transformer Engine's modules, Apex's and Megatron's fused kernels
    PYTORCH = "pytorch"  # PyTorch's own: aten GEMMs through cuBLAS, SDPA, eager or Inductor-generated elementwise code


class CudaAllocator(str, Enum):
    """PyTorch's caching-allocator setting (``PYTORCH_CUDA_ALLOC_CONF``): how much of the activation memory
    it holds reserved beyond what is allocated at the peak (``memory.yaml``, measured per setting)."""

    DEFAULT = "default"  # fixed-size segments: blocks split and cached
    EXPANDABLE_SEGMENTS = "expandable_segments"  # segments that grow in place (expandable_segments:True)


class CudaGraphScope(str, Enum):
    """What Transformer Engine's CUDA graphs capture in each layer (Megatron-Core's ``--cuda-graph-scope`` with
    ``cuda_graph_impl: transformer_engine``): the host launches a captured region as one graph."""

    ATTN = "attn"  # the input norm, the attention and its residual add
    MOE_ROUTER = "moe_router"  # the pre-MLP norm and the router
    MOE_PREPROCESS = "moe_preprocess"  # the dispatcher's work before its synchronisation


class RecomputeModule(str, Enum):
    """What ``recompute: selective`` re-runs in backward (Megatron-Core's ``--recompute-modules``)."""

    CORE_ATTN = "core_attn"  # the attention core (scores, softmax, dropout, weighted sum)
    MLP = "mlp"  # a dense layer's whole MLP (its linears and activation); MoE layers are not recomputed by it
    LAYERNORM = "layernorm"  # the input and pre-MLP norms
    MLA_UP_PROJ = "mla_up_proj"  # MLA's query/key-value up-projections (their outputs freed, recomputed)
    MOE_ACT = "moe_act"  # the routed experts' activation (its output freed after FC2, recomputed)


class CheckpointUnit(str, Enum):
    """What ``recompute: full`` wraps in a checkpoint (``trace/block.py``)."""

    BLOCK = "block"  # the whole layer, its input kept (Megatron's --recompute-granularity full, torchtitan's full AC)
    SUBMODULES = "submodules"  # a dense layer's attention and MLP each (NeMo AutoModel's FSDP2 parallelizer): their
    # inputs kept, the norms run plain and keep theirs; MoE layers stay whole blocks (its MoE parallelizer's)


class TPRuntime(str, Enum):
    """The code that runs tensor and sequence parallelism, for the layout its collectives work on (``trace/parallel.py``)."""

    MEGATRON = "megatron"  # Megatron-Core's: activations sequence-first, [s, b, h], gathered and scattered on dim 0 in place
    TORCH = "torch"  # DTensor's (torchtitan): activations batch-first, [b, s, h], sharded on the sequence (dim 1), so with
    # more than one sequence a micro-batch each all-gather's output and each reduce-scatter's input is rearranged by a copy


class PipelineRuntime(str, Enum):
    """The code that runs a pipeline schedule, for what it holds between micro-batches (``cost/pipeline_buffers.py``)."""

    MEGATRON = "megatron"  # Megatron-Core's schedules: a receive buffer per transfer, each output freed by its backward
    TORCH = "torch"  # torch.distributed.pipelining (torchtitan): receive buffers for every micro-batch made up front,
    # the last stage's outputs kept until the step ends


class CrossEntropy(str, Enum):
    """How the loss over the vocabulary runs (Megatron-Core's ``--cross-entropy-loss-fusion`` and
    ``--cross-entropy-fusion-impl``)."""

    UNFUSED = "unfused"  # Megatron-LM's vocab-parallel cross entropy on an fp32 copy of the logits, softmax kept in fp32
    TE = "te"  # Transformer Engine's Triton kernels: bf16 logits read twice, the gradient written over them in place
    TORCH = "torch"  # PyTorch's F.cross_entropy on an fp32 copy (torchtitan until 2025; under TP its loss_parallel)
    TORCH_COMPILED = "torch_compiled"  # that loss under torch.compile (torchtitan from 2025 with compile): bf16 kept

    @property
    def keeps_logits(self) -> bool:
        """The loss saves the logits in their own dtype for backward (not an fp32 log-softmax): Transformer
        Engine's, which writes the gradient over them, and a compiled loss, which reads them again."""
        return self in (CrossEntropy.TE, CrossEntropy.TORCH_COMPILED)


class MoEDispatcher(str, Enum):
    """How MoE tokens reach their experts (Megatron-Core's ``--moe-token-dispatcher-type``)."""

    ALLTOALL = "alltoall"  # all-to-all over the expert-parallel group
    ALLGATHER = "allgather"  # all-gather every token, reduce-scatter the outputs
    DEEPEP = "deepep"  # DeepEP's normal kernels: once per server over the network, then NVLink (cost/expert_exchange.py)


class DeepEPRelease(str, Enum):
    """Which release of DeepEP's normal kernels runs the exchange (``moe_dispatcher: deepep``): each has its own
    published H800 bandwidths, so its own fitted shares of NVLink and the network (``data/expert_exchange.yaml``)."""

    FEB_2025 = "2025-02"  # the first release (IBRC transport): DeepSeek-V3's training and its published profile
    APR_2025 = "2025-04"  # IBGDA and a queue pair per channel (DeepEP PR #130, "up to 30%" faster across servers)


class OptimizerSharding(str, Enum):
    """What ``distributed_optimizer`` shards over the data-parallel group."""

    NONE = "none"  # the stack has no sharded optimizer
    STATES = "states"  # fp32 master weights and Adam moments (Megatron-LM's distributed optimizer, ZeRO-1)
    STATES_AND_GRADS = "states_and_grads"  # the gradient buffer too (ZeRO-2, Apex DistributedFusedAdam)
    PARAMS = "params"  # the parameters too (ZeRO-3, FSDP full shard: torchtitan, DeepSpeed ZeRO-3)


class OptimizerOffload(str, Enum):
    """How the stack runs the optimizer on the CPU when a plan offloads it (``--offload-optimizer``;
    cost/offload.py). Each value is one framework's code path, read in its source."""

    NONE = "none"  # the stack cannot (or echo-plan does not model how it does)
    # Megatron-Core's HybridDeviceOptimizer (--optimizer-cpu-offload, offload fraction 1, with
    # --overlap-cpu-optimizer-d2h-h2d): fp32 master weights and moments on the host; each parameter's fp32 main
    # gradient copied to pinned memory on a side stream, torch's fused CPU AdamW, the bf16 parameter copied back,
    # one optimizer per parameter so the three pipeline (megatron/core/optimizer/cpu_offloading)
    MEGATRON_HYBRID = "megatron-hybrid"
    # DeepSpeed ZeRO-Offload (zero_optimization.offload_optimizer.device: cpu): the fp32 partition, its moments and
    # its gradients on the host; gradients copied as each bucket is reduced, during the backward pass;
    # DeepSpeedCPUAdam after it, then the updated 16-bit partition copied back (runtime/zero/stage_1_and_2.py)
    ZERO_OFFLOAD = "zero-offload"
    # PyTorch FSDP2's CPUOffloadPolicy (torchtitan's training.enable_cpu_offload): the sharded fp32 parameters, their
    # gradients and the optimizer states live on the host; each unit's shard is copied to the GPU before its
    # all-gather (FSDPParam.all_gather_inputs), each reduced gradient shard copied back after its reduce-scatter on
    # the reduce-scatter stream (foreach_reduce, non-blocking into pinned memory), and the optimizer steps on the CPU
    # (torch/distributed/fsdp/_fully_shard, 2.13 as installed)
    FSDP2 = "fsdp2"


class GradientBuffers(str, Enum):
    """What holds the weight gradients between micro-batches, and how the sharded optimizer reduces them."""

    MEGATRON = "megatron"  # the DDP hook adds each weight gradient into the fp32 buffer (one kernel) and frees it;
    # a sharded optimizer reduce-scatters the buffer
    DEEPSPEED_BF16 = "deepspeed-bf16"  # DeepSpeed's BF16_Optimizer (runtime/bf16_optimizer.py, 2022): each bf16
    # gradient stays allocated until the next backward pass, is cast to an fp32 copy and added into the unsharded fp32
    # buffer after every micro-batch (update_hp_grads), and the whole buffer is all-reduced in fp32 before each rank
    # steps its shard (pipe/engine.py _bf16_reduce_grads)


class RecomputePolicy(str, Enum):
    """What ``recompute: selective`` means on the stack."""

    MODULES = "modules"  # Megatron-Core: the recompute_modules are checkpointed, the rest saved
    OPS = "ops"  # torchtitan's per-op policy: the whole layer checkpointed, every other matmul's and attention's outputs saved


class Fp8Recipe(str, Enum):
    """How Transformer Engine scales FP8 GEMM operands (``docs/fp8.md``)."""

    DELAYED = "delayed"  # per-tensor scale from an amax history of earlier steps; amax fused into the cast
    CURRENT = "current"  # per-tensor scale from this tensor's own amax: an amax pass before every cast
    BLOCKWISE = "blockwise"  # DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks, a scale each
    MXFP8 = "mxfp8"  # OCP microscaling: E4M3 in blocks of 32 along K, a power-of-two (E8M0) scale each; Blackwell

    @property
    def per_tensor(self) -> bool:
        return self in (Fp8Recipe.DELAYED, Fp8Recipe.CURRENT)


class Fp8Kernels(str, Enum):
    """Whose kernels surround the blockwise FP8 GEMMs (``fp8_recipe: blockwise``)."""

    TRANSFORMER_ENGINE = "transformer-engine"  # TE's quantizers: FP8 weight transposes kept for the step
    # DeepSeek's own (its published training profile): DeepGEMM's dense GEMMs read the activations' 1 x 128 scales
    # column-major, laid out by a small transpose kernel before each one; the FP8 weights' transposes for the
    # input-gradient GEMMs are made in each backward (batched_transpose), not kept for the step; a tensor needed in
    # both directions is cast by two kernels, per token and per channel, each reading it (not one pass writing both)
    DEEPSEEK = "deepseek"


BLOCK_SCALED_MIN_SM_ARCH = 100  # MXFP8 and NVFP4 GEMMs: Blackwell's block-scaled tensor cores (TE needs sm100)


class CPComm(str, Enum):
    """How context-parallel attention gets the other ranks' K/V (Megatron-Core's ``--cp-comm-type``)."""

    P2P = "p2p"  # ring attention: K/V chunks passed round the CP ring, overlapped with attention
    ALL_GATHER = "all_gather"  # all-gather K/V before attention, reduce-scatter dK/dV (Llama 3)


class CPRuntime(str, Enum):
    """The code that runs context-parallel attention (``trace/context_parallel.py``)."""

    TRANSFORMER_ENGINE = "transformer_engine"  # TE's CP attention functions (Megatron-Core): one kernel per query chunk
    # and step, the partial outputs merged by a fused correction kernel, dK/dV passed on in bf16
    TORCH = "torch"  # torch.distributed.tensor.experimental's ring attention (torchtitan): an SDPA call per ring step
    # on K/V with their heads repeated to the query heads, outputs merged in fp32 by eager ops, dQ/dK/dV accumulated
    # in fp32 and dK/dV passed round the ring after every step
