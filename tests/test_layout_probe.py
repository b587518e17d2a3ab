"""Offered means runnable (issue 37): layouts the workers could not run are refused at capture, with their reason.

``runtime.parallel.layout_probe`` shards each block's first copy as the workers do, on a fake process group, and runs it
forward and backward on fake tensors; ``space.block`` keeps branches whose inner ops read parameters replicated.
Small hand-written blocks, captured on meta (no process starts)."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import RowwiseParallel

from tensoropt.graph.capture import trace_module
from tensoropt.graph.fold import fold
from tensoropt.runtime.parallel import tp_styles
from tensoropt.runtime.parallel.layout_probe import probe_layouts
from tensoropt.space.block import analyse_block
from tensoropt.space.sp_check import SP_CHECK_KEY
from tensoropt.space.tp_check import check_tensor_parallel, tp_checks, with_tp_checks
from tensoropt.space.tp_layout import not_offered

HIDDEN, HEADS, SEQ = 32, 4, 8


class Block(nn.Module):
    """ln -> up -> gelu -> down, added to the stream; ``shape`` varies what the block does around that branch."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape, self.ln = shape, nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.head_norm = nn.RMSNorm(4 * HIDDEN // HEADS)
        self.register_buffer("scale", torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.ln(x))
        if self.shape == "head-norm":         # a norm with a weight between the linears, per head (Qwen3's q_norm)
            h = self.head_norm(h.view(*h.shape[:2], HEADS, -1)).flatten(2)
        y = self.down(F.gelu(h))
        if self.shape == "in-place":          # Falcon: mlp_output += attention_output
            y += x
            return y
        if self.shape == "stream-buffer":     # a buffer scaling the stream (a plain tensor beside the DTensor stream)
            return x * self.scale + y
        return x + y


class Model(nn.Module):
    def __init__(self, shape: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(shape) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def captured(shape: str, probe: bool = True):
    with torch.device("meta"):
        model = Model(shape)
    inputs = (torch.empty(2, SEQ, HIDDEN, device="meta"),)
    graph = trace_module(model, inputs, shape, {"seq_len": str(SEQ), "batch_size": "2"}, require_loss=True)
    graph = with_tp_checks(graph, check_tensor_parallel(model, inputs, graph))
    return with_tp_checks(graph, probe_layouts(model, inputs, graph)) if probe else graph


def block_space(graph):
    (block,) = fold(graph).blocks
    return analyse_block(block.ops, SEQ, checks=tp_checks(graph, block.name))


def test_a_plain_block_is_offered_every_layout():
    graph = captured("plain")
    space = block_space(graph)
    assert [b.name for b in space.branches] == ["up+down"] and space.sp_allowed(2) and space.sp_allowed(8)
    # the first layer reads the model's input and folds with none: the block is the other three, named so
    assert json.loads(graph.meta("tp_checks"))["layers.*[1:4]"][SP_CHECK_KEY] == {"max_tp": 8}
    assert not_offered(graph) == []


def test_a_buffer_in_the_stream_refuses_sequence_parallelism_at_capture():
    """The analysis accepts it (a pointwise mul); the runtime's sequence-parallel copy fails: refused with why."""
    assert block_space(captured("stream-buffer", probe=False)).sp_allowed(2)
    graph = captured("stream-buffer")
    space = block_space(graph)
    assert not space.sp_allowed(2) and [b.name for b in space.branches] == ["up+down"]
    assert "got mixed torch.Tensor and DTensor" in space.sequence_refused
    (line,) = not_offered(graph)
    assert line.startswith("layers.*[1:4]: no sequence parallelism: sequence parallelism on 2 tensor-parallel ranks "
                           "the runtime's sharded layers.1 fails on fake tensors: RuntimeError: aten.mul.Tensor "
                           "got mixed")


def test_a_row_output_added_into_in_place_runs_sharded(monkeypatch):
    """Falcon's ``mlp_output += attention_output``: runs with the runtime's row style; with torch's own (a view of
    the all-reduced output) the capture refuses the branch with the error the workers met."""
    assert [b.name for b in block_space(captured("in-place")).branches] == ["up+down"]
    monkeypatch.setattr(tp_styles.Rows, "_prepare_output_fn", staticmethod(RowwiseParallel._prepare_output_fn))
    space = block_space(captured("in-place"))
    assert not space.branches
    ((name, why),) = space.refused
    assert name == "up+down" and "is a view and is being modified inplace" in why


@pytest.mark.parametrize("probe", [False, True])
def test_a_parameter_between_the_linears_keeps_the_branch_replicated(probe):
    """Qwen3's per-head q_norm/k_norm: each rank's gradient of the norm weight is a partial sum over its heads."""
    space = block_space(captured("head-norm", probe))
    assert not space.branches
    ((name, why),) = space.refused
    assert name == "up+down" and why.startswith("the ops between its linears read layers.1.head_norm.weight")


def test_the_row_style_sums_in_place_into_a_tensor_of_its_own(one_rank):
    """No copy beside the matmul's output (Megatron's reduce from the model-parallel region): the partial outputs
    are all-reduced in place (c10d's ``allreduce_``, not the functional all-reduce that copies, nor a clone),
    the model may add into the output in place, and values and gradients are the unsharded module's."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
    sharded = copy.deepcopy(whole)
    parallelize_module(sharded, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": tp_styles.Rows()})
    x = torch.randn(2, SEQ, HIDDEN)
    with Ops() as ops:
        y = sharded(x)
    assert "c10d.allreduce_.default" in ops.names, ops.names
    assert not [n for n in ops.names if "clone" in n or "copy" in n or "_c10d_functional" in n], ops.names
    y += x                                  # Falcon's in-place add into a row linear's output
    (y.square().mean()).backward()
    want = whole(x)
    want += x
    want.square().mean().backward()
    torch.testing.assert_close(y, want)
    for (name, got), (_, ref) in zip(sharded.named_parameters(), whole.named_parameters(), strict=True):
        torch.testing.assert_close(got.grad.full_tensor(), ref.grad, msg=name)


class TwoBranches(nn.Module):
    """Two MLP branches in a row; the second adds the stream into its row linear's output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.up1, self.down1 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.up2, self.down2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down1(F.gelu(self.up1(self.ln1(x))))
        y = self.down2(F.gelu(self.up2(self.ln2(h))))
        y += h
        return y


def test_branches_run_together_first_and_alone_where_that_fails(monkeypatch):
    """The probe runs a block's branches sharded at once at each degree and each alone only where that fails
    (``_branches_failing``): the branch that fails is refused with its own error, the other keeps every degree."""
    monkeypatch.setattr(tp_styles.Rows, "_prepare_output_fn", staticmethod(RowwiseParallel._prepare_output_fn))
    with torch.device("meta"):
        model = nn.Sequential(*(TwoBranches() for _ in range(3)))
    inputs = (torch.empty(2, SEQ, HIDDEN, device="meta"),)

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x).pow(2).mean()

    whole = Loss()
    graph = trace_module(whole, inputs, "two", {"seq_len": str(SEQ), "batch_size": "2"}, require_loss=True)
    graph = with_tp_checks(graph, check_tensor_parallel(whole, inputs, graph))
    graph = with_tp_checks(graph, probe_layouts(whole, inputs, graph))
    space = block_space(graph)
    assert [b.name for b in space.branches] == ["up1+down1"] and space.branches[0].max_tp >= 8
    ((name, why),) = space.refused
    assert name == "up2+down2" and "is a view and is being modified inplace" in why
