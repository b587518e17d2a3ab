"""The capture cache: hits return the same graph, any model change misses, writes are atomic."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tensoropt
from tensoropt.graph.cache import GraphCache, write_json_atomic

USER_MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = ACT(layer(x))
            return x.sum()

    def build():
        return Net(), (torch.randn(2, WIDTH),)
""")


def _write_model(path, width=16, act="torch.relu"):
    """Write the model; edits keep the file's size and mtime, the worst case for Python's
    bytecode cache (it would run the old code)."""
    mtime = path.stat().st_mtime if path.exists() else None
    path.write_text(USER_MODEL.replace("WIDTH", str(width)).replace("ACT", act))
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return f"{path}:build"


def test_second_capture_comes_from_the_cache(tmp_path):
    first = tensoropt.capture("gpt2-small", seq_len=128, cache_dir=tmp_path)
    second = tensoropt.capture("gpt2-small", seq_len=128, cache_dir=tmp_path)
    assert (first.cached, second.cached) == (False, True)
    assert second.graph == first.graph
    assert second.trace_seconds == pytest.approx(first.trace_seconds, abs=1e-5)


def test_changing_the_model_invalidates_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.dont_write_bytecode", False)         # as in a clean environment
    spec = _write_model(tmp_path / "net.py")
    assert tensoropt.capture(spec, cache_dir=tmp_path).cached is False
    assert tensoropt.capture(spec, cache_dir=tmp_path).cached is True
    _write_model(tmp_path / "net.py", width=24)                    # other shapes
    changed = tensoropt.capture(spec, cache_dir=tmp_path)
    assert changed.cached is False and changed.graph.ops[0].inputs[1].shape == (2, 24)
    _write_model(tmp_path / "net.py", width=24, act="torch.tanh")  # other forward code
    recoded = tensoropt.capture(spec, cache_dir=tmp_path)
    assert recoded.cached is False and recoded.graph.ops[1].target == "aten.tanh.default"


def test_batch_and_sequence_length_are_part_of_the_key(tmp_path):
    a = tensoropt.capture("gpt2-small", seq_len=64, cache_dir=tmp_path)
    b = tensoropt.capture("gpt2-small", seq_len=128, cache_dir=tmp_path)
    c = tensoropt.capture("gpt2-small", seq_len=64, batch_size=2, cache_dir=tmp_path)
    assert not (a.cached or b.cached or c.cached)
    assert len({a.graph.fingerprint, b.graph.fingerprint, c.graph.fingerprint}) == 3


def test_a_corrupt_entry_is_recaptured(tmp_path):
    first = tensoropt.capture("gpt2-small", seq_len=64, cache_dir=tmp_path)
    path = GraphCache(tmp_path).path(first.graph.fingerprint)
    path.write_text(path.read_text()[:1000])                         # truncated
    again = tensoropt.capture("gpt2-small", seq_len=64, cache_dir=tmp_path)
    assert again.cached is False and again.graph.ops == first.graph.ops
    assert json.loads(path.read_text())["schema_version"] == 1


def test_an_interrupted_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "entry.json"
    write_json_atomic(path, {"ok": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})                   # fails mid-serialisation
    assert json.loads(path.read_text()) == {"ok": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["entry.json"]


def test_cache_can_be_bypassed(tmp_path):
    tensoropt.capture("gpt2-small", seq_len=64, cache_dir=tmp_path)
    assert tensoropt.capture("gpt2-small", seq_len=64, cache=False).cached is False


def test_tests_keep_out_of_the_users_cache(tmp_path, write_json):
    """The processes tests start get workers.ENV: a capture there, with HOME and XDG_CACHE_HOME moved to an empty
    folder, writes into the session's own cache and nothing under the home (the user's ~/.cache)."""
    from workers import ENV
    assert ENV["TENSOROPT_CACHE_DIR"] == os.environ["TENSOROPT_CACHE_DIR"] != str(Path.home() / ".cache" / "tensoropt")
    cache, home = Path(ENV["TENSOROPT_CACHE_DIR"]), tmp_path / "home"
    home.mkdir()
    before = set(cache.rglob("*"))
    model = write_json("unique.json", {"family": "gpt", "hidden_size": 32, "num_layers": 1, "num_attention_heads": 2,
                                       "ffn_hidden_size": 64, "seq_length": 8, "vocab_size": 72})
    moved = {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    result = subprocess.run([sys.executable, "-m", "tensoropt", "inspect", "--model", model], capture_output=True,
                            text=True, timeout=300, env=ENV | moved)
    assert result.returncode == 0, result.stderr[-2000:]
    assert set(cache.rglob("*")) > before and list(home.iterdir()) == []
