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
