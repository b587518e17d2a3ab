"""Capture: per-op shapes, FLOPs, saved activations and parameters are the real ones."""

import math
import resource

import pytest
import torch
from torch import nn

import tensoropt
from tensoropt.errors import CaptureError
from tensoropt.graph.capture import trace_module
from tensoropt.graph.ir import OpGraph


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).sum()


def _meta_inputs(*shapes, dtype=torch.float32):
    return tuple(torch.empty(*s, dtype=dtype, device="meta") for s in shapes)


def test_linear_flops_shapes_and_saved_bytes():
    with torch.device("meta"):
        model = TwoLinear()
    graph = trace_module(model, _meta_inputs((4, 16)))
    kinds = [op.kind for op in graph.ops]
    assert kinds == ["matmul", "elementwise", "matmul", "reduction"]
    fc1, relu, fc2, total = graph.ops
    assert fc1.module_path == "fc1" and fc2.module_path == "fc2"
    assert fc1.forward_flops == 2 * 4 * 16 * 32
    # the model input needs no gradient: fc1's backward computes only dW
    assert fc1.backward_flops == fc1.forward_flops
    # fc2's input comes from fc1 (needs a gradient): dX and dW
    assert fc2.backward_flops == 2 * fc2.forward_flops
    assert fc1.outputs[0].shape == (4, 32) and fc1.params == ("fc1.bias", "fc1.weight")
    # autograd keeps relu's output (for relu's and fc2's backward); fc1's output is not kept
    assert relu.saved_bytes == 4 * 32 * 4
    assert fc1.saved_bytes == 0
    assert graph.num_parameters == 16 * 32 + 32 + 32 * 8
    assert graph.edges() == [(0, 0, 1, 0), (1, 0, 2, 0), (2, 0, 3, 0)]


def test_no_memory_is_allocated_for_a_175b_model():
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    captured = tensoropt.capture("gpt3-175b", cache=False)
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib) / 2**20
    assert captured.graph.parameter_bytes > 300 * 2**30     # 325 GiB of bf16 weights described...
    assert grown_gib < 2                                     # ...without allocating them


def test_tied_embedding_is_counted_once_and_read_twice():
    graph = tensoropt.capture("gpt2-small").graph
    assert graph.num_parameters == 124_439_808
    readers = [op for op in graph.ops if "embed.weight" in op.params]
    assert [op.kind for op in readers] == ["embedding", "matmul"]


def test_flash_attention_for_sdpa_models_keeps_no_score_matrix(write_json):
    path = write_json("llama.json", {"family": "llama", "hidden_size": 128, "num_layers": 2,
                                     "num_attention_heads": 8, "num_key_value_heads": 2,
                                     "ffn_hidden_size": 256, "seq_length": 64, "vocab_size": 100})
    graph = tensoropt.capture(path).graph
    attention = [op for op in graph.ops if op.kind == "attention"]
    assert len(attention) == 2
    q = attention[0].inputs[0]
    assert q.shape == (1, 8, 64, 16)                          # GQA keys/values expanded to 8 heads
    assert attention[0].forward_flops == 4 * 8 * 64 * 64 * 16
    # nothing of size heads * s * s is kept for backward
    assert all(max((m.numel for m in op.outputs), default=0) < 8 * 64 * 64 or op.saved_bytes == 0
               for op in graph.ops if op.kind != "loss")


def test_eager_attention_keeps_the_score_matrix(write_json):
    from conftest import SMALL_GPT
    graph = tensoropt.capture(write_json("gpt.json", SMALL_GPT)).graph
    softmax = [op for op in graph.ops if op.kind == "softmax" and op.module_path.endswith("attn")]
    assert len(softmax) == 4 and all(op.saved_bytes == 4 * 32 * 32 * 2 for op in softmax)   # bf16


def test_json_round_trip_is_exact():
    graph = tensoropt.capture("wide-resnet50-2").graph
    again = OpGraph.from_json(graph.to_json())
    assert again == graph
    bad = graph.to_json() | {"schema_version": 999}
    with pytest.raises(ValueError, match="schema_version"):
        OpGraph.from_json(bad)


def test_a_real_cpu_module_is_captured_without_computing():
    model = TwoLinear()                                       # real CPU weights
    graph = trace_module(model, (torch.randn(4, 16),))
    assert len(graph.ops) == 4 and graph.ops[0].forward_flops == 2 * 4 * 16 * 32


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 1)

    def forward(self, x):
        if self.gate(x).mean().item() > 0:                   # reads a value: not capturable
            return x.sum()
        return x.mean()


def test_data_dependent_forward_is_a_one_line_error_naming_module_and_op():
    with torch.device("meta"):
        model = DataDependent()
    with pytest.raises(CaptureError) as info:
        trace_module(model, _meta_inputs((2, 8)))
    message = str(info.value)
    assert "\n" not in message
    assert "tensor values" in message and "aten._local_scalar_dense" in message and "meta device" in message


class ShapeMismatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 4), nn.Linear(8, 4))

    def forward(self, x):
        return self.inner(x)


def test_shape_error_names_the_module():
    with torch.device("meta"):
        model = ShapeMismatch()
    with pytest.raises(CaptureError, match=r"module 'inner\.1'"):
        trace_module(model, _meta_inputs((2, 8)))


def test_total_flops_of_a_conv_net_use_the_conv_formula():
    with torch.device("meta"):
        conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
    graph = trace_module(nn.Sequential(conv), _meta_inputs((2, 3, 16, 16)))
    (op,) = graph.ops
    assert op.kind == "conv"
    assert op.forward_flops == 2 * 2 * 8 * 16 * 16 * 3 * 3 * 3
    assert math.prod(op.outputs[0].shape) == 2 * 8 * 16 * 16


@pytest.mark.parametrize("batch, seq", [(1, 1024), (2, 128)])
def test_gpt_layer_keeps_exactly_the_megatron_activation_bytes(batch, seq):
    """Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    eq. 1): a GPT layer keeps s*b*h*(34 + 5*a*s/h) bytes for backward with 16-bit activations
    and 1-byte dropout masks; the two LayerNorms also keep fp32 mean and rstd (16*s*b bytes)."""
    graph = tensoropt.capture("gpt2-small", batch_size=batch, seq_len=seq).graph
    (block,) = tensoropt.fold(graph).blocks
    h, a = 768, 12
    expected = seq * batch * h * (34 + 5 * a * seq / h) + 16 * seq * batch
    assert sum(op.saved_bytes for op in block.ops) == expected
    masks = [op for op in block.ops if op.kind == "dropout"]
    assert len(masks) == 3 and all(op.outputs[1].dtype == "bool" for op in masks)
