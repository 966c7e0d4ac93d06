"""A suite row names its precision: a dtype, or a Blackwell recipe that implies one (mxfp8, nvfp4)."""

from echo_plan.validation.predict import RowSimulator
from echo_plan.validation.rows import read_step_times

CSV = """model,source,precision,gpus,tp,pp,vpp,cp,mbs,gbs,seq_length,step_time_s,tp_comm_overlap,fp4_param_gather
llama3-8b,a,fp8,8,1,1,1,1,2,128,8192,4.2,,
llama3-8b,a,mxfp8,8,1,1,1,1,2,128,8192,4.4,,
llama3-8b,a,nvfp4,8,1,1,1,1,2,128,8192,3.1,false,true
"""


def test_recipe_precisions_set_the_dtype_and_the_stack(tmp_path):
    path = tmp_path / "suite.csv"
    path.write_text(CSV)
    fp8, mx, fp4 = read_step_times(path)
    assert [r.label for r in (fp8, mx, fp4)] == ["llama3-8b fp8 8 GPUs", "llama3-8b mxfp8 8 GPUs",
                                                  "llama3-8b nvfp4 8 GPUs"]
    assert (fp8.plan["dtype"], mx.plan["dtype"], fp4.plan["dtype"]) == ("fp8", "fp8", "fp4")
    assert "fp8_recipe" not in fp8.stack_overrides and mx.stack_overrides["fp8_recipe"] == "mxfp8"
    assert fp4.stack_overrides == {"tp_comm_overlap": False, "fp4_param_gather": True}
    sim = RowSimulator("gb200-nvl72", "megatron-core")
    assert sim.stack_for(mx).fp8_recipe.value == "mxfp8" and sim.stack_for(fp4).fp4_param_gather
    assert sim.plan_for(fp4).dtype.value == "fp4"


def test_one_layer_per_virtual_stage_leaves_the_end_chunks_to_the_embedding_and_the_loss():
    from echo_plan.specs import load_model
    from echo_plan.validation.rows import TrainingRow

    model = load_model("llama3-405b")
    sim = RowSimulator("gb200-nvl72", "megatron-core", model_settings={"llama3-405b": {"layer_split_offsets": [-1, -1]}})
    row = TrainingRow("r", 1.0, "s/step", model=model, gpus=256,
                      plan={"tp": 4, "pp": 16, "dp": 4, "virtual_stages": 8, "micro_batch_size": 1,
                            "global_batch_size": 1536})
    split = sim.plan_for(row).layer_split
    assert split[0] == split[-1] == 0 and set(split[1:-1]) == {1} and sum(split) == 126


def test_a_rows_cuda_graph_scope_is_read_and_none_means_no_graphs(tmp_path):
    from echo_plan.validation.rows import read_step_times

    head = "model,gpus,tp,pp,ep,mbs,gbs,seq_length,step_time_s,cuda_graph_scope\n"
    (tmp_path / "g.csv").write_text(head + "qwen3-30b-a3b,8,1,1,8,1,512,4096,10,attn+moe_router\n"
                                    "qwen3-30b-a3b,8,1,1,8,4,512,4096,9,none\n")
    a, b = read_step_times(tmp_path / "g.csv")
    assert a.stack_overrides["cuda_graph_scope"] == ("attn", "moe_router")
    assert b.stack_overrides["cuda_graph_scope"] == ()
