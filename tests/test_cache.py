"""The capture cache: hits return the same graph, any model change misses, writes are atomic."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

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


# ---- tensoropt launch's capture of a script: keyed by the arguments the capture read ----

def test_the_capture_records_the_options_it_did_not_read(monkeypatch):
    """What a capture reads (runtime.capture_args): options read before parallelize count; after it, numbers
    count only where the first step ran under an autocast (captured again there) or never came; reading the whole
    namespace, or a second parse, counts everything."""
    import argparse

    from tensoropt.runtime import capture_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", argparse.ArgumentParser.parse_known_args)
    capture_args.install()                                    # undone by monkeypatch at the end

    def run(reads_early, reads_late, step, argv=("--width", "4", "--report", "r.json")):
        monkeypatch.setattr(capture_args, "_STATE", capture_args._Tracker())
        monkeypatch.setattr("sys.argv", ["script.py", *argv])
        parser = argparse.ArgumentParser()
        parser.add_argument("--width", type=int, default=2)
        parser.add_argument("--steps", type=int, default=3)
        parser.add_argument("--amp", action="store_true")
        parser.add_argument("--out", default=None)
        parser.add_argument("--files", nargs="*", default=[])
        parser.add_argument("-r", "--report", required=True)
        args = parser.parse_args()
        for read in reads_early:
            read(args)
        capture_args.mark_parallelized()
        for read in reads_late:
            read(args)
        if step is not None:
            capture_args.mark_first_step(step)
        unread = capture_args.unread_options()
        if unread is None:
            return None
        # a required option is recorded with its placeholder (its first option string), the others without one
        assert {tuple(entry) for entry in unread if entry[0] in ("-r", "--report")} == \
            ({("-r", 1, "-r"), ("--report", 1, "-r")} if "report" not in reads else set())
        return sorted(entry[0] for entry in unread if entry[0] not in ("-r", "--report"))

    reads = set()
    width, steps, amp = (lambda a: a.width), (lambda a: range(a.steps)), (lambda a: a.amp)
    everything = ["--amp", "--out", "--steps", "--width"]                 # --files takes any number: never dropped
    assert run([width], [steps, amp], step=False) == ["--out", "--steps"]
    assert run([width], [steps, amp], step=True) == ["--out"]            # the model may have changed before the step
    assert run([width], [steps], step=None) == ["--amp", "--out"]        # no step: --steps may have kept it away
    assert run([width, steps], [], step=False) == ["--amp", "--out"]
    assert run([], [], step=False) == everything
    assert run([vars], [], step=False) is None
    assert run([print], [], step=False) is None
    assert run([lambda a: argparse.ArgumentParser().parse_args([])], [], step=False) is None    # a second parse
    reads.add("report")
    assert run([width, lambda a: a.report], [], step=False) == ["--amp", "--out", "--steps"]


def test_unread_options_are_dropped_as_argparse_reads_them():
    from launcher.capture_index import reduce_argv
    unread = [["--out", 1], ["--steps", 1], ["--meta", 0], ["-o", 1]]
    assert reduce_argv(["--steps", "3", "--layers", "2", "--out=a.json", "--meta", "-o", "x"], unread) == \
        ["--layers", "2"]
    assert reduce_argv(["--steps", "-1", "--lr", "-1", "--out", "-"], unread) == ["--lr", "-1"]
    # kept whole where argparse would not read an unread option's value (so the capture shows its error), after
    # "--", in abbreviations and attached short options (kept on both lines: a line differing there misses)
    assert reduce_argv(["--steps", "--layers", "2"], unread) == ["--steps", "--layers", "2"]
    assert reduce_argv(["--layers", "2", "--", "--out", "x"], unread) == ["--layers", "2", "--", "--out", "x"]
    assert reduce_argv(["--ste", "3", "-ox", "--meta=1", "--steps"], unread) == ["--ste", "3", "-ox", "--meta=1",
                                                                                   "--steps"]


def test_a_required_unread_option_keeps_its_placeholder():
    """A required option the capture did not read (``--out``, ``required=True``): its value is dropped, its
    presence is not, so a line without it does not reuse a capture (its capture shows argparse's error)."""
    from launcher.capture_index import reduce_argv
    unread = [["-o", 1, "-o"], ["--out", 1, "-o"], ["--steps", 1]]
    assert reduce_argv(["--steps", "3", "--out", "a.json", "--layers", "2"], unread) == ["-o", "--layers", "2"]
    assert reduce_argv(["-o", "b.json", "--layers", "2"], unread) == ["-o", "--layers", "2"]
    assert reduce_argv(["--out=c.json", "--layers", "2"], unread) == ["-o", "--layers", "2"]
    assert reduce_argv(["--layers", "2"], unread) == ["--layers", "2"]
    assert reduce_argv(["--out", "--layers", "2"], unread) == ["--out", "--layers", "2"]    # no value: kept whole


def test_a_bad_index_is_passed_over(tmp_path):
    """The index is a hint: unreadable, malformed or foreign entries are no entries; a capture stored again under a
    key replaces the entries of that key."""
    from launcher.capture_index import CaptureIndex, sources_digest
    index = CaptureIndex(GraphCache(tmp_path), "script-x")
    index.path.parent.mkdir(parents=True)
    for text in ["", "{", "[]", '{"entries": 3}', '{"entries": [{"key": "../../etc/passwd", "sources": "",'
                 ' "unread": [], "reduced": ["--a"]}, {"key": "launch-' + "0" * 32 + '", "sources": "", "unread":'
                 ' [["--out", 2]], "reduced": ["--a"]}]}']:
        index.path.write_text(text)
        assert index.find(["--a"]) == []
    key, other, digest = "launch-" + "1" * 32, "launch-" + "2" * 32, sources_digest("[]")
    index.update(key, "[]", ["--a", "--out", "x"], [["--out", 1]])
    index.update(other, "[]", ["--b"], [])
    assert index.find(["--a", "--out", "y"]) == [(key, digest)] and index.find(["--b"]) == [(other, digest)]
    index.update(key, "[1]", ["--a", "--out", "x"], None)                # stored again, its unread options unknown
    assert index.find(["--a", "--out", "y"]) == [] and index.find(["--b"]) == [(other, digest)]


class _Heads(nn.Module):
    """nanoGPT-shaped attention: the head count is a plain attribute, in no parameter shape and not in repr."""

    def __init__(self, n_head: int, act=torch.relu):
        super().__init__()
        self.n_head, self.act = n_head, act
        self.c_attn = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.act(self.c_attn(x)).split(32, dim=2)
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_a_module_setting_outside_its_shapes_is_part_of_the_key(tmp_path):
    """Two instances of one class that differ only in a plain attribute their forward reads (nanoGPT's n_head), or in
    a function it calls, have the same repr, state shapes and class source: each must get its own graph, not the
    other's from the cache."""
    x = (torch.randn(2, 16, 32),)
    two = tensoropt.capture(_Heads(2), x, cache_dir=tmp_path)
    four = tensoropt.capture(_Heads(4), x, cache_dir=tmp_path)
    again = tensoropt.capture(_Heads(4), x, cache_dir=tmp_path)
    assert (two.cached, four.cached, again.cached) == (False, False, True)

    def heads(graph):
        return next(op.inputs[0].shape[1] for op in graph.ops if op.kind == "attention")
    assert (heads(two.graph), heads(four.graph), heads(again.graph)) == (2, 4, 4)
    # an activation function passed in is a setting too
    tanh = tensoropt.capture(_Heads(4, torch.tanh), x, cache_dir=tmp_path)
    assert tanh.cached is False and any(op.target == "aten.tanh.default" for op in tanh.graph.ops)
