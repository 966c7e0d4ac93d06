"""Mixture-of-experts and multi-head latent attention parts of a ModelSpec, and layer kinds.

An MoE model replaces the MLP of some layers with a router and ``num_experts`` expert MLPs of
``expert_ffn_hidden_size`` of which each token visits ``top_k`` (Shazeer et al. 2017; Fedus et al.
2021), optionally plus always-on shared experts (DeepSeekMoE, Dai et al. 2024). DeepSeek-V3 keeps
its first three layers dense (``first_dense_layers``). ``capacity_factor`` None is dropless
(Megatron-Core's default and the published NeMo benchmarks'); a number caps (and pads) each
expert at that multiple of the balanced share of tokens.

Multi-head latent attention (DeepSeek-V2/V3) projects queries through a rank ``q_lora_rank``
bottleneck and keys/values through a joint ``kv_lora_rank`` latent, with a rope part of
``qk_rope_head_dim`` per head (one rope key shared by all heads) and a no-rope part.

A model's layers fall into a few *kinds* (dense or MoE MLP; full or sliding-window attention);
one trace per kind serves every layer of that kind.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from pydantic import Field, model_validator

from echo_plan import limits as L
from echo_plan.specs.base import Spec


class RouterKind(str, Enum):
    SOFTMAX = "softmax"  # softmax over experts, then top-k (Mixtral, Qwen3, GPT-OSS)
    SIGMOID = "sigmoid"  # sigmoid scores, top-k, renormalised (DeepSeek-V3's auxiliary-loss-free gating)


def server_limit(groups: int, per_token: int, servers: int) -> int:
    """The most of ``servers`` servers a token reaches when its experts lie in ``groups`` equal groups, at most
    ``per_token`` of them per token, spread over the servers in order (a group spanning k servers: k each)."""
    return min(servers, per_token * max(1, servers // groups))


class MoESpec(Spec):
    num_experts: int = Field(gt=1, le=4096, description="routed experts per MoE layer")
    top_k: int = Field(gt=0, le=4096, description="experts each token is routed to")
    expert_ffn_hidden_size: int = Field(gt=0, le=L.MAX_FFN)
    num_shared_experts: int = Field(default=0, ge=0, le=64)
    shared_expert_ffn_hidden_size: int | None = Field(
        default=None, gt=0, le=L.MAX_FFN, description="default: num_shared_experts x expert_ffn_hidden_size")
    first_dense_layers: int = Field(default=0, ge=0, le=L.MAX_LAYERS,
                                    description="leading layers with a dense MLP (DeepSeek-V3: 3)")
    router: RouterKind = RouterKind.SOFTMAX
    capacity_factor: float | None = Field(default=None, gt=0.0, le=64.0, description="None: dropless")
    routing_groups: int | None = Field(
        default=None, gt=0, le=4096, description="group-limited routing: the experts in this many equal groups "
                                                 "(Hugging Face n_group; DeepSeek-V3: 8)")
    groups_per_token: int | None = Field(
        default=None, gt=0, le=4096, description="at most this many groups per token (topk_group; DeepSeek-V3: 4); "
                                                 "with one group per server, the servers a token reaches")

    @model_validator(mode="after")
    def _rules(self) -> "MoESpec":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} must not exceed num_experts {self.num_experts}")
        if self.num_shared_experts and self.shared_expert_ffn_hidden_size is None:
            object.__setattr__(self, "shared_expert_ffn_hidden_size",
                               self.num_shared_experts * self.expert_ffn_hidden_size)
        if not self.num_shared_experts:
            object.__setattr__(self, "shared_expert_ffn_hidden_size", None)
        if (self.routing_groups is None) != (self.groups_per_token is None):
            raise ValueError("routing_groups and groups_per_token go together (group-limited routing)")
        if self.routing_groups is not None:
            if self.num_experts % self.routing_groups:
                raise ValueError(f"routing_groups {self.routing_groups} must divide num_experts {self.num_experts}")
            if not self.groups_per_token <= self.routing_groups:
                raise ValueError(f"groups_per_token {self.groups_per_token} exceeds routing_groups {self.routing_groups}")
        return self

    def server_limit(self, servers: int) -> int | None:
        """The most servers a token reaches when its experts lie on ``servers`` servers in order (each holds
        num_experts / servers of them); None without group-limited routing."""
        if self.routing_groups is None or self.groups_per_token is None:
            return None
        return server_limit(self.routing_groups, self.groups_per_token, servers)

    @property
    def shared_ffn(self) -> int:
        return int(self.shared_expert_ffn_hidden_size or 0)


class MLASpec(Spec):
    q_lora_rank: int | None = Field(default=None, gt=0, le=L.MAX_HIDDEN, description="None: no query compression")
    kv_lora_rank: int = Field(gt=0, le=L.MAX_HIDDEN)
    qk_nope_head_dim: int = Field(gt=0, le=4096)
    qk_rope_head_dim: int = Field(gt=0, le=4096)
    v_head_dim: int = Field(gt=0, le=4096)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LayerKind(NamedTuple):
    """What distinguishes one transformer layer's trace from another's in the same model."""

    moe: bool = False
    window: int = 0  # sliding-window attention span in tokens; 0: full causal attention
    recomputed: bool = False  # re-runs its whole forward in backward (the plan's recompute_layers), whatever its mode

    def label(self) -> str:
        mlp = "moe" if self.moe else "dense"
        base = f"{mlp}+window{self.window}" if self.window else mlp
        return base + "+recomputed" if self.recomputed else base

    @property
    def traced(self) -> "LayerKind":
        """The kind the tracer sees (what the layer computes; how it is recomputed is the trace's mode)."""
        return self._replace(recomputed=False) if self.recomputed else self


DENSE = LayerKind()


class ExpertLayout(NamedTuple):
    """How a plan lays out the experts of an MoE layer (what the MoE layer's trace depends on)."""

    ep: int = 1
    etp: int = 1
    imbalance: float = 1.0

    def label(self) -> str:
        return f"ep{self.ep},etp{self.etp},imb{self.imbalance:g}"
