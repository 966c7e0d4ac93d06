"""ModelSpec: a decoder-only transformer (GPT-, Llama-, Nemotron-style; mixtures of experts: ``moe.py``)."""

from __future__ import annotations

from enum import Enum

from pydantic import Field, model_validator

from echo_plan import limits as L
from echo_plan.specs.base import Spec
from echo_plan.specs.moe import DENSE, LayerKind, MLASpec, MoESpec


class Activation(str, Enum):
    GELU = "gelu"
    SWIGLU = "swiglu"
    SQUARED_RELU = "squared_relu"  # relu(x)^2, ungated (Nemotron-4; So et al. 2021, Primer)
    # GPT-OSS's gated unit: gate.clamp(max=7) * sigmoid(1.702 gate) * (up.clamp(-7, 7) + 1) (OpenAI 2025 model card)
    SWIGLU_CLAMPED = "swiglu_clamped"

    @property
    def gated(self) -> bool:
        """Two input projections (gate and up) instead of one."""
        return self in (Activation.SWIGLU, Activation.SWIGLU_CLAMPED)


class Norm(str, Enum):
    LAYERNORM = "layernorm"
    LAYERNORM1P = "layernorm1p"  # LayerNorm with zero-centred gamma: scales by (1 + weight) (Nemotron-4)
    RMSNORM = "rmsnorm"

    @property
    def params(self) -> int:
        """Parameters per hidden unit: weight and bias, or weight only."""
        return 1 if self is Norm.RMSNORM else 2


class PositionEmbedding(str, Enum):
    LEARNED = "learned"
    ROTARY = "rotary"
    NONE = "none"


def llama_ffn_size(hidden_size: int, multiple_of: int = 256) -> int:
    """Llama's default FFN width: 2/3 of 4h rounded up to a multiple (Touvron et al. 2023)."""
    ffn = int(2 * 4 * hidden_size / 3)
    return multiple_of * ((ffn + multiple_of - 1) // multiple_of)


class ModelSpec(Spec):
    """Architecture of the model to train. Sizes are counts, lengths are tokens."""

    name: str = Field(min_length=1)
    num_layers: int = Field(gt=0, le=L.MAX_LAYERS)
    hidden_size: int = Field(gt=0, le=L.MAX_HIDDEN)
    num_attention_heads: int = Field(gt=0, le=L.MAX_HEADS)
    num_kv_heads: int | None = Field(default=None, gt=0, le=L.MAX_HEADS)
    ffn_hidden_size: int | None = Field(default=None, gt=0, le=L.MAX_FFN)
    vocab_size: int = Field(gt=0, le=L.MAX_VOCAB)
    seq_length: int = Field(gt=0, le=L.MAX_SEQUENCE)
    activation: Activation = Activation.GELU
    norm: Norm = Norm.LAYERNORM
    position_embedding: PositionEmbedding = PositionEmbedding.LEARNED
    tied_embeddings: bool = True
    bias: bool | None = Field(default=None, description="linear layers carry biases; default: GELU models do")
    rotary_percent: float = Field(default=1.0, gt=0.0, le=1.0, description="fraction of each head's dims rotated")
    rope_attention_factor: float = Field(
        default=1.0, gt=0.0, le=10.0,
        description="what cos and sin are multiplied by (YaRN's attention factor, 0.1 ln(factor) + 1 unless the "
                    "config gives one; GPT-OSS: 1.3466); 1: plain RoPE")
    attention_head_dim: int | None = Field(default=None, gt=0, le=4096,
                                           description="per-head width when not hidden_size / heads (Qwen3, GPT-OSS)")
    qk_norm: bool = Field(default=False, description="RMSNorm on each query and key head (Qwen3)")
    sliding_window: int | None = Field(default=None, gt=0, le=L.MAX_SEQUENCE,
                                       description="attention span of windowed layers in tokens (GPT-OSS: 128)")
    sliding_window_pattern: int = Field(default=1, gt=0, le=L.MAX_LAYERS,
                                        description="every n-th layer from layer 0 is windowed (GPT-OSS: 2)")
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    mtp_layers: int = Field(default=0, ge=0, le=16, description="multi-token prediction modules (DeepSeek-V3: 1)")
    source: str = ""

    @model_validator(mode="after")
    def _defaults_and_rules(self) -> "ModelSpec":
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_attention_heads)
        if self.ffn_hidden_size is None:
            ffn = (
                llama_ffn_size(self.hidden_size)
                if self.activation.gated
                else 4 * self.hidden_size
            )
            object.__setattr__(self, "ffn_hidden_size", ffn)
        if self.bias is None:
            object.__setattr__(self, "bias", self.activation is Activation.GELU)  # GPT-style blocks carry biases
        if self.rotary_percent < 1.0 and self.position_embedding is not PositionEmbedding.ROTARY:
            raise ValueError(f"rotary_percent {self.rotary_percent} needs position_embedding rotary")
        if self.rope_attention_factor != 1.0 and self.position_embedding is not PositionEmbedding.ROTARY:
            raise ValueError(f"rope_attention_factor {self.rope_attention_factor} needs position_embedding rotary")
        if self.position_embedding is PositionEmbedding.ROTARY and self.rotary_dims % 2:
            raise ValueError(f"rotary_percent {self.rotary_percent} of head_dim {self.head_dim} must give an even "
                             f"number of rotated dims, not {self.rotary_dims}")
        if self.moe is not None and self.moe.first_dense_layers > self.num_layers:
            raise ValueError(f"moe.first_dense_layers {self.moe.first_dense_layers} exceeds num_layers "
                             f"{self.num_layers}")
        if self.mla is not None and self.position_embedding is not PositionEmbedding.ROTARY:
            raise ValueError("multi-head latent attention (mla) needs position_embedding rotary")
        if self.attention_head_dim is None and self.mla is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_kv_heads {self.kv_heads} must divide num_attention_heads "
                f"{self.num_attention_heads}"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return int(self.ffn_hidden_size or 0)  # filled by the validator

    @property
    def head_dim(self) -> int:
        if self.attention_head_dim is not None:
            return self.attention_head_dim
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def layer_kind(self, index: int) -> LayerKind:
        """The kind of layer ``index`` (0-based): MoE or dense MLP, windowed or full attention."""
        moe = self.moe is not None and index >= self.moe.first_dense_layers
        windowed = self.sliding_window is not None and index % self.sliding_window_pattern == 0
        window = int(self.sliding_window or 0) if windowed and self.sliding_window < self.seq_length else 0
        return LayerKind(moe=moe, window=window)

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's kind, in order (all DENSE for a dense model with full attention)."""
        if self.moe is None and self.sliding_window is None:
            return (DENSE,) * self.num_layers
        return tuple(self.layer_kind(i) for i in range(self.num_layers))

    def distinct_kinds(self) -> tuple[LayerKind, ...]:
        """The layer kinds present, in order of first appearance (the MTP module's kind included)."""
        kinds = list(dict.fromkeys(self.layer_kinds()))
        if self.mtp_layers and self.mtp_kind not in kinds:
            kinds.append(self.mtp_kind)
        return tuple(kinds)

    @property
    def mtp_kind(self) -> LayerKind:
        """A multi-token prediction module's transformer layer: the model's last layer kind, full attention."""
        return LayerKind(moe=self.moe is not None, window=0)

    @property
    def has_bias(self) -> bool:
        return bool(self.bias)

    @property
    def rotary_dims(self) -> int:
        """Dims of each head that rotary embedding rotates (all of them unless rotary_percent < 1)."""
        return int(round(self.head_dim * self.rotary_percent))

    @property
    def norm_params(self) -> int:
        """Parameters of one norm."""
        return self.norm.params * self.hidden_size

    @property
    def attention_params(self) -> int:
        """Weights and biases of one layer's attention (projections, MLA norms, QK norms)."""
        h, a, d = self.hidden_size, self.num_attention_heads, self.head_dim
        if self.mla is not None:
            m = self.mla
            q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * a * m.qk_head_dim) if m.q_lora_rank \
                else h * a * m.qk_head_dim
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
                + m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + a * m.v_head_dim * h
        kv = self.kv_heads * d
        qkv = a * d + 2 * kv
        bias = (qkv + h) if self.has_bias else 0
        return h * qkv + a * d * h + bias + (2 * d if self.qk_norm else 0)

    def mlp_params(self, ffn: int) -> int:
        """One MLP of width ``ffn`` (weights and biases)."""
        h = self.hidden_size
        fc1_out = 2 * ffn if self.activation.gated else ffn
        return h * fc1_out + ffn * h + ((fc1_out + h) if self.has_bias else 0)

    @property
    def expert_params_per_layer(self) -> int:
        """Routed-expert weights of one MoE layer (sharded by expert parallelism)."""
        return 0 if self.moe is None else self.moe.num_experts * self.mlp_params(self.moe.expert_ffn_hidden_size)

    def layer_params(self, kind: LayerKind = DENSE) -> int:
        """Parameters of one transformer block of ``kind`` (norms, router and shared experts included)."""
        norms = 2 * self.norm_params
        if not kind.moe or self.moe is None:
            return self.attention_params + self.mlp_params(self.ffn_size) + norms
        router = self.moe.num_experts * self.hidden_size
        shared = self.mlp_params(self.moe.shared_ffn) if self.moe.num_shared_experts else 0
        return self.attention_params + router + shared + self.expert_params_per_layer + norms

    @property
    def params_per_layer(self) -> int:
        """Parameters of one dense transformer block (weights and biases, norms included)."""
        return self.layer_params(DENSE)

    @property
    def mtp_params(self) -> int:
        """The multi-token prediction modules: a layer, two norms and a 2h x h projection each."""
        h = self.hidden_size
        return self.mtp_layers * (self.layer_params(self.mtp_kind) + 2 * self.norm_params + 2 * h * h)

    @property
    def embedding_params(self) -> int:
        pos = self.seq_length * self.hidden_size if self.position_embedding is PositionEmbedding.LEARNED else 0
        return self.vocab_size * self.hidden_size + pos

    @property
    def output_params(self) -> int:
        """Final norm plus the output projection when it is not tied to the embedding."""
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.norm_params + head

    @property
    def num_params(self) -> int:
        layers = sum(self.layer_params(k) for k in self.layer_kinds())
        return layers + self.mtp_params + self.embedding_params + self.output_params
