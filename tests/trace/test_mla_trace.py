"""Multi-head latent attention's recompute of its up-projections, as Megatron-Core runs it with Transformer
Engine's spec (each latent norm fused into its up-projection, so recomputed with it)."""

from echo_plan.specs import ModelSpec, Recompute, load_stack
from echo_plan.trace.records import Phase, StageKind
from echo_plan.trace.tracer import trace_stage


def _mla() -> ModelSpec:
    return ModelSpec.build(dict(
        name="mla-small", num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1000, seq_length=128,
        activation="swiglu", norm="rmsnorm", position_embedding="rotary", ffn_hidden_size=512,
        tied_embeddings=False, mla=dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                        v_head_dim=32)))


def _trace(modules):
    stack = load_stack("megatron-core", {"recompute_modules": modules})
    return trace_stage(_mla(), StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype="bf16",
                       recompute=Recompute.SELECTIVE, stack=stack)


def test_up_projection_recompute_reruns_the_latent_norms_and_keeps_only_their_inputs():
    plain, up = _trace(["core_attn"]), _trace(["mla_up_proj"])
    norms = [op for op in up.ops if op.phase is Phase.RECOMPUTE and "rms_norm" in op.name]
    assert len(norms) == 2  # the query and the key-value latent norms run again in backward
    m = _mla()
    latents = m.seq_length * (m.mla.q_lora_rank + m.mla.kv_lora_rank) * 2  # bf16 norm outputs
    q_k_v = m.seq_length * m.num_attention_heads * (2 * m.mla.qk_head_dim + m.mla.v_head_dim) * 2
    rope_key = m.seq_length * m.mla.qk_rope_head_dim * 2  # an input of the recomputed region: kept
    # what mla_up_proj frees against recomputing nothing of the attention: q, k, v and the normed latents
    none = up.saved_bytes_by_mode["none"]
    assert none - up.saved_bytes >= q_k_v + latents - rope_key
    assert plain.saved_bytes_by_mode["none"] == none  # the same layer without recompute either way
