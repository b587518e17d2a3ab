"""Measured op times in a profile replace the roofline for exactly those ops (lookup), and every
other op keeps the roofline (fallback); the work autograd adds to a backward; how the profiler times
an op (per sample, at several samples)."""

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import tensoropt
from tensoropt.cost.ops import OpArrays, autograd_glue_bytes, op_times
from tensoropt.cost.profile import load_profile
from tensoropt.profiler.ops import _time_at, batched, time_op


def test_measured_times_replace_the_roofline_and_the_rest_falls_back():
    graph = tensoropt.capture("gpt2-small", seq_len=64).graph
    ops = tensoropt.fold(graph).blocks[0].ops
    plain = load_profile("h100-80gb")
    qkv = next(op for op in ops if op.kind == "matmul")
    measured = dataclasses.replace(plain, op_times=((qkv.key(), 0.25, 0.5),))
    shard = np.ones(len(ops))
    shard[qkv.index] = 2
    base_fwd, base_bwd = op_times(OpArrays.of(ops, plain), shard, 4, plain)
    fwd, bwd = op_times(OpArrays.of(ops, measured), shard, 4, measured)
    assert fwd[qkv.index] == 0.25 * 4 / 2 and bwd[qkv.index] == 0.5 * 4 / 2      # batch 4, sharded over 2
    others = np.arange(len(ops)) != qkv.index
    np.testing.assert_array_equal(fwd[others], base_fwd[others])
    np.testing.assert_array_equal(bwd[others], base_bwd[others])
    assert measured.op_time("aten.mm.default(nothing|)") is None


def test_a_measured_attention_efficiency_prices_fused_attention_at_that_fraction_of_the_curve(write_json):
    """A profile's ``attention_efficiency`` (the profiler's (forward FLOPs, fraction) points) multiplies the efficiency
    of fused attention ops alone, interpolated in log10 FLOPs between its points; every other op keeps its price. With
    memory free, each attention is compute-bound: its work (the causal kernel's 5/8 of the FLOPs at 512 positions, four
    tiles of 128) / (peak x curve x fraction) + the launch, and its backward (twice the FLOPs) at the same rate."""
    spec = write_json("llama.json", {"family": "llama", "hidden_size": 256, "num_layers": 2, "num_attention_heads": 4,
                                     "ffn_hidden_size": 512, "seq_length": 512, "vocab_size": 128})
    ops = tensoropt.fold(tensoropt.capture(spec).graph).blocks[0].ops
    free = dataclasses.replace(load_profile("h100-80gb"), memory_bandwidth_bytes_per_s=1e30)
    attention = [i for i, op in enumerate(ops) if op.kind == "attention"]
    assert attention
    low, high = ops[attention[0]].forward_flops, ops[attention[0]].forward_flops * 100
    measured = dataclasses.replace(free, attention_efficiency=((low / 10, 0.5), (high, 0.8)))
    shard = np.ones(len(ops))
    base_fwd, base_bwd = op_times(OpArrays.of(ops, free), shard, 1, free)
    fwd, bwd = op_times(OpArrays.of(ops, measured), shard, 1, measured)
    fraction = 0.5 + (0.8 - 0.5) * (np.log10(low) - np.log10(low / 10)) / (np.log10(high) - np.log10(low / 10))
    for i in attention:
        flops, op = ops[i].forward_flops, ops[i]
        rate = free.peak(op.outputs[0].dtype) * free.efficiency(flops)
        assert fwd[i] == pytest.approx(flops * 5 / 8 / (rate * fraction) + free.kernel_overhead_s, rel=1e-9)
        # both price the causal kernel's work, the datasheet profile at the matmul curve's rate
        assert bwd[i] - base_bwd[i] == pytest.approx(op.backward_flops * 5 / 8 / rate * (1 / fraction - 1), rel=1e-9)
    others = np.ones(len(ops), dtype=bool)
    others[attention] = False
    np.testing.assert_array_equal(fwd[others], base_fwd[others])
    np.testing.assert_array_equal(bwd[others], base_bwd[others])
    assert not free.attention_measured and measured.attention_measured


class _Attention(nn.Module):
    """Fused attention over the input as queries, keys and values, causal or not (no other op computes)."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        q = self.proj(x).view(x.shape[0], x.shape[1], 4, 16).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=self.causal)


@pytest.mark.parametrize("seq", [512, 1000])
def test_a_causal_fused_attention_is_priced_for_the_tiles_its_kernel_computes(seq):
    """A fused causal attention computes the key tiles on and below the diagonal only (flash / cuDNN kernels, 128
    positions a tile): (n + 1) / (2 n) of its FLOPs for n tiles. On a profile that measured its attention kernel, with
    memory free, a causal attention's compute-bound time is that share of a bidirectional one's, on a profile that
    measured its attention kernel and on a datasheet one alike."""
    free = dataclasses.replace(load_profile("h100-80gb"), memory_bandwidth_bytes_per_s=1e30)
    measured = dataclasses.replace(free, attention_efficiency=((1.0, 0.9),))
    times = {}
    for causal in (True, False):
        ops = tensoropt.capture(_Attention(causal), example_inputs=(torch.randn(2, seq, 64),)).graph.ops
        i = next(i for i, op in enumerate(ops) if op.kind == "attention")
        shard = np.ones(len(ops))
        for profile in (free, measured):
            fwd, bwd = op_times(OpArrays.of(ops, profile), shard, 1, profile)
            times[profile.attention_measured, causal] = (fwd[i] - profile.kernel_overhead_s,
                                                         bwd[i] - profile.kernel_overhead_s)
    tiles = -(-seq // 128)
    share = (tiles + 1) / (2 * tiles)
    for k in (0, 1):
        assert times[True, True][k] == pytest.approx(share * times[True, False][k], rel=1e-12)
        assert times[False, True][k] == pytest.approx(share * times[False, False][k], rel=1e-12)
        assert times[False, False][k] == pytest.approx(0.9 * times[True, False][k], rel=1e-12)


def test_times_at_a_ranks_own_shapes_win_over_scaling():
    graph = tensoropt.capture("gpt2-small", seq_len=64).graph
    ops = tensoropt.fold(graph).blocks[0].ops
    qkv = next(op for op in ops if op.kind == "matmul")
    profile = dataclasses.replace(load_profile("h100-80gb"),
                                  op_times=((qkv.key(), 0.25, 0.5), (qkv.key() + "@tp2", 0.2, 0.3)))
    arrays = OpArrays.of(ops, profile)
    for tp, expected_fwd, expected_bwd in ((2, 0.2 * 3, 0.3 * 3), (4, 0.25 * 3 / 4, 0.5 * 3 / 4)):
        shard = np.ones(len(ops))
        shard[qkv.index] = tp
        fwd, bwd = op_times(arrays, shard, 3, profile)
        # tp 2 was measured at a rank's shapes; tp 4 was not, so the unsharded time is scaled
        assert (fwd[qkv.index], bwd[qkv.index]) == (expected_fwd, expected_bwd)
    assert profile.sharded_degrees == (2,)


class _Fork(nn.Module):
    """y feeds two linears (fan-out 2); q and k are slices of one projection (narrowed views)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.proj, self.side = nn.Linear(8, 8), nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(x)
        h = self.proj(y)
        q, k = h[..., :8], h[..., 8:16]
        return (q * k).sum() + self.side(y).sum()


def _fork_ops():
    from tensoropt.graph.capture import trace_module
    return trace_module(_Fork(), (torch.zeros(1, 4, 8),)).ops


def test_autograd_sums_fanned_out_gradients_and_fills_sliced_ones():
    ops = _fork_ops()
    glue = autograd_glue_bytes(ops)
    y_bytes, h_bytes, slice_bytes = 4 * 8 * 4, 4 * 24 * 4, 4 * 8 * 4
    addmms = [i for i, op in enumerate(ops) if op.target == "aten.addmm.default"]
    mul = next(i for i, op in enumerate(ops) if op.target == "aten.mul.Tensor")
    # proj reads y first; side reads it second and pays the sum of the two gradients of y
    assert glue[addmms[1]] == 0 and glue[addmms[2]] == 3 * y_bytes
    # q and k: each slice's backward fills a whole h-sized gradient and copies its part; the second adds
    assert glue[mul] == 2 * (h_bytes + 2 * slice_bytes) + 3 * h_bytes
    assert glue.sum() == glue[addmms[2]] + glue[mul]
    profile = load_profile("cpu-2core")
    arrays = OpArrays.of(ops, profile)
    _, bwd = op_times(arrays, np.ones(len(ops)), 4, profile)
    _, bare = op_times(dataclasses.replace(arrays, glue_bytes=np.zeros(len(ops))), np.ones(len(ops)), 4, profile)
    np.testing.assert_allclose(bwd - bare, glue * 4 / profile.memory_bytes_per_s)


def test_ops_are_timed_per_sample_at_several_samples_where_their_output_grows():
    ops = _fork_ops()
    proj = [op for op in ops if op.target == "aten.addmm.default"][1]
    wide = batched(proj, 8)
    activation = [m.shape for m, r in zip(wide.inputs, wide.sources) if r.kind != "param"]
    assert activation == [(32, 8)] and wide.outputs[0].shape == (32, 24)        # 4 tokens x 8 samples
    assert [m.shape for m, r in zip(wide.inputs, wide.sources) if r.kind == "param"] == [(24,), (8, 24)]
    assert wide.bytes_read == sum(m.nbytes for m in wide.inputs)
    fwd, bwd = time_op(proj, "cpu", 3, 1 << 30)
    assert fwd > 0 and bwd > 0
    # an op whose sizes are fixed in its arguments cannot grow: it is timed at its captured shapes
    from tensoropt.graph.capture import trace_module
    (fixed,) = trace_module(_Fixed(), (torch.zeros(1, 4, 8),)).ops
    assert _time_at(batched(fixed, 8), "cpu", 3, 1 << 30) is None
    assert time_op(fixed, "cpu", 3, 1 << 30) is not None


class _Fixed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(3, 5)
