"""Validated, frozen descriptions of the model, the cluster and the parallel plan."""

from echo_plan.specs.cluster import ClusterSpec, DType, Fabric, GPUSpec, NetworkSpec
from echo_plan.specs.model import Activation, ModelSpec, Norm, PositionEmbedding
from echo_plan.specs.plan import PlanSpec, Recompute, Schedule
from echo_plan.specs.plan_checks import validate_plan
from echo_plan.specs.presets import (
    DEFAULT_CLUSTER,
    DEFAULT_MODEL,
    DEFAULT_STACK,
    cluster_names,
    load_cluster,
    load_model,
    load_stack,
    model_names,
    parse_size,
    stack_names,
)
from echo_plan.specs.software import AttentionKernel, AttentionLibrary, Fp8Recipe, OptimizerSharding, RecomputeModule, SoftwareSpec

__all__ = [
    "Activation", "AttentionKernel", "AttentionLibrary", "ClusterSpec", "DEFAULT_CLUSTER", "DEFAULT_MODEL", "DEFAULT_STACK", "DType",
    "Fabric", "Fp8Recipe", "GPUSpec", "ModelSpec", "NetworkSpec", "Norm", "OptimizerSharding", "PlanSpec", "PositionEmbedding",
    "Recompute", "RecomputeModule", "Schedule", "SoftwareSpec", "cluster_names", "load_cluster", "load_model",
    "load_stack", "model_names", "parse_size", "stack_names", "validate_plan",
]
