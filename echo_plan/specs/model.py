"""ModelSpec: a dense decoder-only transformer (GPT-style, Llama-style, Nemotron-style)."""

from __future__ import annotations

from enum import Enum

from pydantic import Field, model_validator

from echo_plan import limits as L
from echo_plan.specs.base import Spec


class Activation(str, Enum):
    GELU = "gelu"
    SWIGLU = "swiglu"
    SQUARED_RELU = "squared_relu"  # relu(x)^2, ungated (Nemotron-4; So et al. 2021, Primer)

    @property
    def gated(self) -> bool:
        """Two input projections (gate and up) instead of one."""
        return self is Activation.SWIGLU


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
    source: str = ""

    @model_validator(mode="after")
    def _defaults_and_rules(self) -> "ModelSpec":
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_attention_heads)
        if self.ffn_hidden_size is None:
            ffn = (
                llama_ffn_size(self.hidden_size)
                if self.activation is Activation.SWIGLU
                else 4 * self.hidden_size
            )
            object.__setattr__(self, "ffn_hidden_size", ffn)
        if self.bias is None:
            object.__setattr__(self, "bias", self.activation is Activation.GELU)  # GPT-style blocks carry biases
        if self.rotary_percent < 1.0 and self.position_embedding is not PositionEmbedding.ROTARY:
            raise ValueError(f"rotary_percent {self.rotary_percent} needs position_embedding rotary")
        if self.position_embedding is PositionEmbedding.ROTARY and self.rotary_dims % 2:
            raise ValueError(f"rotary_percent {self.rotary_percent} of head_dim {self.head_dim} must give an even "
                             f"number of rotated dims, not {self.rotary_dims}")
        if self.hidden_size % self.num_attention_heads:
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
        return self.hidden_size // self.num_attention_heads

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
    def params_per_layer(self) -> int:
        """Parameters of one transformer block (weights and biases, norms included)."""
        h, f = self.hidden_size, self.ffn_size
        kv = self.kv_heads * self.head_dim
        bias = self.has_bias
        attn = h * (h + 2 * kv) + h * h + ((h + 2 * kv) + h if bias else 0)
        fc1_out = 2 * f if self.activation.gated else f
        mlp = h * fc1_out + f * h + ((fc1_out + h) if bias else 0)
        return attn + mlp + 2 * self.norm_params

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
        return self.num_layers * self.params_per_layer + self.embedding_params + self.output_params
