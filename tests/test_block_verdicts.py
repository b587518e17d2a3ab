"""The capture's block checks kept on disk (``graph.block_verdicts``): a block seen before is not run again by the
layout probe nor by the static tensor-parallel check, and anything a run depends on (its code, its shapes, the
runtime's sharding) makes a new key. Small blocks captured on meta, in this process."""

import json

import pytest
import torch
from test_layout_probe import HIDDEN, SEQ, Model, captured
from torch import nn

from tensoropt.graph import block_verdicts
from tensoropt.runtime.parallel import layout_probe
from tensoropt.space import tp_check


def probed(tmp_path, shape="plain", sources=()):
    graph = captured(shape, probe=False)
    with torch.device("meta"):
        model = Model(shape)
    inputs = (torch.empty(2, SEQ, HIDDEN, device="meta"),)
    return layout_probe.probe_layouts(model, inputs, graph, tmp_path / "probes", sources)


def test_a_block_seen_before_is_not_run_again(tmp_path, monkeypatch):
    first = probed(tmp_path)
    (stored,) = (tmp_path / "probes").iterdir()
    assert json.loads(stored.read_text()) == {"schema_version": 1, "entry": first["layers.*[1:4]"]}

    def never(*args, **kwargs):
        raise AssertionError("the probe ran a block whose verdict was stored")
    monkeypatch.setattr(layout_probe, "_fails", never)
    assert probed(tmp_path) == first


def test_what_the_run_depends_on_makes_a_new_key(tmp_path):
    """The block's code, given by a source file's contents (not its path), and the block itself."""
    graph = captured("plain", probe=False)
    with torch.device("meta"):
        model = Model("plain")
    source = tmp_path / "model_code.py"
    source.write_text("x = 1\n")
    (block,) = layout_probe.fold(graph).blocks

    def key(copy=model.layers[0], ops=block.ops, sources=(str(source),)):
        return block_verdicts.block_key("layout_probe", copy, ops, sources, sp=True, seq_len=SEQ)
    before = key()
    copy = tmp_path / "elsewhere.py"
    copy.write_text(source.read_text())
    assert key(sources=(str(copy),)) == before                 # the same code elsewhere
    source.write_text("x = 22\n")                               # another size: a new digest on any file system
    assert key() != before
    with torch.device("meta"):
        assert key(copy=nn.Sequential(nn.Linear(HIDDEN, HIDDEN))) != key()
    assert key(ops=block.ops[:-1]) != key()


@pytest.mark.parametrize("content", ["not json", '{"schema_version": 0, "entry": {}}',
                                     '{"schema_version": 1, "entry": []}'])
def test_an_unreadable_or_old_entry_is_a_miss(tmp_path, content):
    first = probed(tmp_path)
    (stored,) = (tmp_path / "probes").iterdir()
    stored.write_text(content)
    assert probed(tmp_path) == first
    assert json.loads(stored.read_text())["entry"] == first["layers.*[1:4]"]


def test_the_static_check_of_a_block_seen_before_is_not_run_again(tmp_path, monkeypatch):
    graph = captured("plain", probe=False)
    with torch.device("meta"):
        model = Model("plain")
    inputs = (torch.empty(2, SEQ, HIDDEN, device="meta"),)
    first = tp_check.check_tensor_parallel(model, inputs, graph, tmp_path, ())
    expected = {"layers.*[1:4]": {"up+down": {"max_tp": 64}}}
    assert first == tp_check.check_tensor_parallel(model, inputs, graph) == expected

    def never(*args, **kwargs):
        raise AssertionError("the check ran a block whose verdicts were stored")
    monkeypatch.setattr(tp_check, "_check_branch", never)
    assert tp_check.check_tensor_parallel(model, inputs, graph, tmp_path, ()) == first
