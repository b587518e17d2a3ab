"""Measured op times in a profile replace the roofline for exactly those ops (lookup), and every
other op keeps the roofline (fallback)."""

import dataclasses

import numpy as np

import tensoropt
from tensoropt.cost.ops import OpArrays, op_times
from tensoropt.cost.profile import load_profile


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
