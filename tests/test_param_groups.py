"""The script's optimizer under tensor parallelism (``runtime.engines.param_groups``): groups split so foreach kernels
never see DTensors and plain tensors in one list, state dicts kept in the script's group layout.

One process, a one-rank gloo group and a one-device mesh: enough for DTensors to exist and for foreach to
refuse a mixed list, as it does on CUDA by default (``foreach=True`` here)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from tensoropt.runtime.checkpoint import sharded as checkpoint
from tensoropt.runtime.engines.param_groups import build_optimizer


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.proj, self.norm = nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, tokens):
        return self.norm(self.proj(self.embed(tokens))).square().mean()


def sharded(mesh) -> nn.Module:
    """``proj`` as a column-parallel DTensor pair, embedding and norm plain: what tensor parallelism leaves."""
    return parallelize_module(Tiny(), mesh, {"proj": ColwiseParallel()})


def script_groups(params):
    """A script's own groups: weight decay on matrices only (each group mixes kinds once ``proj`` is sharded)."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim == 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=1e-2, foreach=True)


def train(model, optimizer, steps: int = 2) -> list[float]:
    tokens = torch.arange(10).reshape(2, 5)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def test_foreach_refuses_the_mixed_group_and_runs_the_split_one(mesh):
    model = sharded(mesh)
    old = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)     # one group, as the engines made it
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        train(model, old, steps=1)
    model, plain = sharded(mesh), Tiny()
    got = train(model, build_optimizer(lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True), model.parameters()))
    assert got == pytest.approx(train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=True)), rel=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        torch.testing.assert_close(full(p), q, msg=name)


def test_each_script_group_splits_by_kind_and_keeps_its_settings(mesh):
    model = sharded(mesh)
    optimizer = build_optimizer(script_groups, model.parameters())
    names = {p: n for n, p in model.named_parameters()}
    groups = [(g["weight_decay"], [names[p] for p in g["params"]]) for g in optimizer.param_groups]
    assert groups == [(0.1, ["embed.weight"]), (0.1, ["proj.weight"]),
                      (0.0, ["proj.bias"]), (0.0, ["norm.weight", "norm.bias"])]
    assert all(len({isinstance(p, DTensor) for p in g["params"]}) == 1 for g in optimizer.param_groups)
    assert {g["lr"] for g in optimizer.param_groups} == {1e-2}
    unmixed = Tiny()
    assert len(build_optimizer(script_groups, unmixed.parameters()).param_groups) == 2    # nothing to split


def test_state_dict_keeps_the_script_layout_both_ways(mesh):
    model, plain = sharded(mesh), Tiny()
    split, whole = build_optimizer(script_groups, model.parameters()), script_groups(plain.parameters())
    train(model, split)
    train(plain, whole)
    saved = split.state_dict()
    assert [(g["weight_decay"], len(g["params"])) for g in saved["param_groups"]] == [(0.1, 2), (0.0, 3)]
    fresh = Tiny()
    loaded = script_groups(fresh.parameters())                  # a plan without tensor parallelism resumes it
    loaded.load_state_dict({**saved, "state": {k: {n: full(v) for n, v in s.items()} for k, s in
                                               saved["state"].items()}})
    assert exp_avgs(fresh, loaded) == pytest.approx(exp_avgs(plain, whole), rel=1e-6)
    back = build_optimizer(script_groups, sharded(mesh).parameters())
    back.load_state_dict(whole.state_dict())                   # and the reverse: split layout from the script's
    assert [len(g["params"]) for g in back.param_groups] == [1, 1, 1, 2]
    by_param = {p: back.state[p]["exp_avg"] for g in back.param_groups for p in g["params"]}
    expected = exp_avgs(plain, whole)
    assert [float(by_param[p].abs().sum()) for p in params_in_order(back)] == pytest.approx(
        [expected[n] for n in ("embed.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias")], rel=1e-6)


def params_in_order(optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def exp_avgs(model: nn.Module, optimizer) -> dict[str, float]:
    """Each parameter's first moment, summed (by the model's names): which state went to which parameter."""
    return {n: float(full(optimizer.state[p]["exp_avg"]).abs().sum()) for n, p in model.named_parameters()}


def test_checkpoint_of_split_groups_resumes_without_tensor_parallelism(mesh, tmp_path):
    model, plain = sharded(mesh), Tiny()
    split, whole = build_optimizer(script_groups, model.parameters()), script_groups(plain.parameters())
    train(model, split)
    train(plain, whole)
    checkpoint.save(tmp_path, 2, model, split)
    fresh = Tiny()
    optimizer = script_groups(fresh.parameters())
    assert checkpoint.load(tmp_path, fresh, optimizer) == 2
    assert exp_avgs(fresh, optimizer) == pytest.approx(exp_avgs(plain, whole), rel=1e-6)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert train(fresh, optimizer) == pytest.approx(train(plain, whole), rel=1e-6)
    checkpoint.save(tmp_path / "plain", 4, plain, whole)        # and back onto the split groups
    again = sharded(mesh)
    resumed = build_optimizer(script_groups, again.parameters())
    assert checkpoint.load(tmp_path / "plain", again, resumed) == 4
    assert exp_avgs(again, resumed) == pytest.approx(exp_avgs(plain, whole), rel=1e-6)
    assert train(again, resumed) == pytest.approx(train(plain, whole), rel=1e-6)
