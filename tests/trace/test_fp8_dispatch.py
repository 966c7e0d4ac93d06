"""DeepSeek-V3's FP8 exchange (the stack's ``moe_dispatch_fp8``): tokens dispatched as FP8 rows with their
1 x 128 tile scales, and the gradients before the experts' FC2 too; both combines stay bf16."""

import pytest

from echo_plan.specs import DType, Recompute, load_stack
from echo_plan.specs.moe import ExpertLayout, LayerKind
from echo_plan.trace.records import CollectiveKind, Phase, StageKind
from echo_plan.trace.tracer import trace_stage


def _trace(model, fp8_dispatch: bool, dtype=DType.FP8, ep=4):
    stack = load_stack("megatron-core", {"fp8_recipe": "blockwise", "moe_dispatcher": "deepep",
                                         "moe_dispatch_fp8": fp8_dispatch})
    return trace_stage(model, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype=dtype,
                       recompute=Recompute.NONE, stack=stack, kind=LayerKind(moe=True),
                       layout=ExpertLayout(ep, 1, 1.0))


def _exchanges(trace):
    return [(op.phase, op.collective.nbytes) for op in trace.ops
            if op.collective is not None and op.collective.kind is CollectiveKind.ALL_TO_ALL
            and op.collective.nbytes > 4096]  # the token exchanges, not the gate weights riding along


def test_the_dispatches_move_fp8_rows_with_scales_and_the_combines_bf16(small_moe):
    bf16_x, fp8_x = _exchanges(_trace(small_moe, False)), _exchanges(_trace(small_moe, True))
    copies = small_moe.seq_length * small_moe.moe.top_k
    h = small_moe.hidden_size
    bf16_rows, fp8_rows = copies * h * 2, copies * (h + 4 * (h // 128))
    assert sorted(n for _, n in bf16_x) == [bf16_rows] * 4
    fwd = sorted(n for p, n in fp8_x if p is Phase.FORWARD)
    bwd = sorted(n for p, n in fp8_x if p is Phase.BACKWARD)
    assert fwd == [fp8_rows, bf16_rows] and bwd == [fp8_rows, bf16_rows]  # dispatch FP8, combine bf16, each way


def test_the_experts_take_the_arrived_fp8_rows_without_a_cast_of_their_own(small_moe):
    def forward_casts(trace):
        return [op.inputs[0].shape for op in trace.ops
                if op.phase is Phase.FORWARD and op.name.endswith("fp8_block_cast.default")]
    plain, fp8 = forward_casts(_trace(small_moe, False)), forward_casts(_trace(small_moe, True))
    h = small_moe.hidden_size
    fc1 = [s for s in plain if len(s) == 3 and s[-1] == h]  # the local experts' tokens, [experts, rows, hidden]
    assert len(fc1) == 1 and not [s for s in fp8 if len(s) == 3 and s[-1] == h]
    assert fp8.count((small_moe.seq_length, h)) == plain.count((small_moe.seq_length, h)) + 1  # tokens, cast once


@pytest.mark.parametrize("dtype, ep", [(DType.BF16, 4), (DType.FP8, 1)])
def test_without_fp8_gemms_or_expert_parallelism_the_setting_changes_nothing(small_moe, dtype, ep):
    a, b = _trace(small_moe, False, dtype, ep), _trace(small_moe, True, dtype, ep)
    assert [op.name for op in a.ops] == [op.name for op in b.ops] and a.saved_bytes == b.saved_bytes
