"""Per-plan communication outside the layers: pipeline transfers, the tied-embedding all-reduce,
and the parameters each rank holds of the embedding and output stages."""

from __future__ import annotations

from echo_plan.layout.layer_mix import output_rank
from echo_plan.specs.model import ModelSpec, PositionEmbedding
from echo_plan.specs.plan import PlanSpec
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind



def _params(model: ModelSpec, plan: PlanSpec) -> tuple[int, int, int]:
    """Parameters one rank holds: per block, for the embedding, for the output (norm + head).

    Linear weights are split by tp; the learned position embedding is replicated, as in
    Megatron-LM; with tied embeddings and pp > 1 the last stage keeps its own copy of the word
    embedding for the output projection (kept equal by the tied all-reduce), unless the first stage's
    rank holds the last stage too (ZB-V's V: one copy)."""
    tp = plan.tp
    block = -(-model.params_per_layer // tp)
    word = -(-model.vocab_size * model.hidden_size // tp)
    pos = model.seq_length * model.hidden_size if model.position_embedding is PositionEmbedding.LEARNED else 0
    norm = model.output_params - (0 if model.tied_embeddings else model.vocab_size * model.hidden_size)
    head = word if (not model.tied_embeddings or output_rank(plan) != 0) else 0
    return block, word + pos, norm + head


def _p2p_time(model: ModelSpec, plan: PlanSpec, comm_time) -> float:
    """One activation (or gradient) between adjacent stages: [mbs, seq / cp, hidden] in the plan dtype.

    With sequence parallelism each TP rank holds and sends 1/tp of it. Without it, Megatron-LM's
    scatter/gather optimisation (Narayanan et al. 2021, section 4.1) sends 1/tp per rank over the
    inter-stage link and all-gathers it over NVLink on the receiving stage."""
    group = CommGroup(GroupKind.PP, size=2, stride=plan.stage_ranks)
    return comm_time(CollectiveKind.SEND_RECV, -(-_message_bytes(model, plan) // plan.tp), group)


def _p2p_gather_time(model: ModelSpec, plan: PlanSpec, comm_time) -> float:
    """Without sequence parallelism, the receiving stage all-gathers the 1/tp parts over TP before
    using them (its own stream; the sender does not wait for it)."""
    if plan.tp == 1 or plan.sequence_parallel:
        return 0.0
    return comm_time(CollectiveKind.ALL_GATHER, _message_bytes(model, plan), CommGroup(GroupKind.TP, size=plan.tp))


def _message_bytes(model: ModelSpec, plan: PlanSpec) -> int:
    return plan.micro_batch_size * (model.seq_length // plan.cp) * model.hidden_size * plan.param_dtype.nbytes


def _tied_time(model: ModelSpec, plan: PlanSpec, comm_time, gbytes: int) -> float:
    """The word-embedding gradient all-reduce between the first and the last stage (tied weights); none where one
    rank holds both (ZB-V's V)."""
    if not model.tied_embeddings or plan.pp == 1 or output_rank(plan) == 0:
        return 0.0
    nbytes = -(-model.vocab_size * model.hidden_size // plan.tp) * gbytes
    group = CommGroup(GroupKind.PP, size=2, stride=(plan.pp - 1) * plan.stage_ranks)
    return comm_time(CollectiveKind.ALL_REDUCE, nbytes, group)
