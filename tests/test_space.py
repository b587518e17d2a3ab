"""The strategy space: where Megatron tensor parallelism applies, found from data flow."""

import pytest
from conftest import EXAMPLES

import tensoropt
from tensoropt.space.block import analyse_block


def _spaces(spec, **kw):
    graph = tensoropt.capture(spec, **kw).graph
    seq = int(graph.meta("seq_len") or 0) or None
    return graph, [(b, analyse_block(b.ops, seq)) for b in tensoropt.fold(graph).blocks]


def _linear_modules(block, indices):
    return [block.ops[i].module_path.rsplit(".", 1)[-1] for i in indices]


def test_gpt_layer_has_attention_and_mlp_branches():
    _, [(block, space)] = _spaces("gpt2-small", seq_len=128)
    attn, mlp = space.branches
    assert (_linear_modules(block, attn.column), _linear_modules(block, attn.row)) == (["qkv"], ["proj"])
    assert (_linear_modules(block, mlp.column), _linear_modules(block, mlp.row)) == (["up"], ["down"])
    assert attn.max_tp == 12 and mlp.max_tp == 3072                  # heads; ffn features
    assert {block.ops[i].kind for i in space.attention_core} >= {"softmax", "dropout"}
    kinds = sorted(block.ops[i].kind for i in space.stream)
    assert kinds == ["dropout", "dropout", "elementwise", "elementwise", "norm", "norm"]
    assert space.tp_allowed(4) and not space.tp_allowed(8)


def test_hugging_face_llama_branches_respect_key_value_heads():
    _, [(block, space)] = _spaces(str(EXAMPLES / "llama2-7b-hf-config.json"), seq_len=128)
    attn, mlp = space.branches
    assert _linear_modules(block, attn.column) == ["q_proj", "k_proj", "v_proj"]
    assert _linear_modules(block, mlp.column) == ["gate_proj", "up_proj"]
    assert attn.max_tp == 32 and space.attention_core == ()          # flash attention keeps no scores


def test_gqa_limits_tensor_parallelism_to_kv_heads(write_json):
    cfg = {"family": "llama", "hidden_size": 256, "num_layers": 2, "num_attention_heads": 16,
           "num_key_value_heads": 2, "ffn_hidden_size": 512, "seq_length": 64, "vocab_size": 100}
    _, [(_, space)] = _spaces(write_json("gqa.json", cfg))
    assert space.branches[0].max_tp == 2 and space.tp_allowed(2) and not space.tp_allowed(4)


def test_moe_layer_mlp_stays_replicated(write_json):
    cfg = {"family": "moe", "hidden_size": 64, "num_layers": 4, "num_attention_heads": 4,
           "ffn_hidden_size": 128, "seq_length": 32, "vocab_size": 100, "num_experts": 4}
    _, [(block, space)] = _spaces(write_json("moe.json", cfg))
    names = [(b.name, _linear_modules(block, b.column)) for b in space.branches]
    assert names == [("attn", ["qkv"]), ("mlp", ["up"]), ("attn", ["qkv"])]   # no branch through the router


@pytest.mark.parametrize("spec", ["wide-resnet50-2"])
def test_convolutions_have_no_tensor_parallel_branch(spec):
    _, spaces = _spaces(spec)
    assert all(space.branches == () and not space.tp_allowed(2) and space.tp_allowed(1) for _, space in spaces)


def test_the_pointwise_table_is_what_the_installed_torch_tags():
    """The planner reads ATen's pointwise tags from a table (so that planning a captured graph imports no torch):
    it must be exactly what this torch tags; another torch version rewrites it (python -m tensoropt.space.sp_check)."""
    import torch

    from tensoropt.space.pointwise_table import POINTWISE, TORCH_VERSION
    from tensoropt.space.sp_check import tagged_pointwise
    if torch.__version__ != TORCH_VERSION:
        pytest.skip(f"the table was written from torch {TORCH_VERSION}, this is {torch.__version__}")
    assert tagged_pointwise() == POINTWISE
    import torch._inductor.inductor_prims  # noqa: F401  registers prims.fma, which no capture records
    assert tagged_pointwise() == POINTWISE, "the table must not depend on what the process imported before"
    assert {"aten.add.Tensor", "aten.mul.Tensor", "aten.gelu.default"} <= POINTWISE
    assert not {"aten.cumsum.default", "aten._softmax.default", "aten.mm.default"} & POINTWISE
