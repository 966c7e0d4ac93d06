"""Validated, frozen descriptions of the model, the cluster and the parallel plan."""

from echo_plan.specs.cluster import ClusterSpec, DType, Fabric, GPUSpec, NetworkSpec
from echo_plan.specs.model import Activation, ModelSpec, Norm, PositionEmbedding
from echo_plan.specs.plan import PlanSpec, Recompute, Schedule, validate_plan
from echo_plan.specs.presets import (
    DEFAULT_CLUSTER,
    DEFAULT_MODEL,
    cluster_names,
    load_cluster,
    load_model,
    model_names,
    parse_size,
)

__all__ = [
    "Activation", "ClusterSpec", "DEFAULT_CLUSTER", "DEFAULT_MODEL", "DType", "Fabric", "GPUSpec",
    "ModelSpec", "NetworkSpec", "Norm", "PlanSpec", "PositionEmbedding", "Recompute", "Schedule",
    "cluster_names", "load_cluster", "load_model", "model_names", "parse_size", "validate_plan",
]
