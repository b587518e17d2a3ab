"""Model sources: builder files (their folder importable, their sequence length recorded), modules given to
``tensoropt.capture``, and Hugging Face configs' sequence length."""

import json
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import tensoropt
from tensoropt.cli import cli
from tensoropt.models import example_shape, resolve_model

# GPT-2 XL's attention shape (25 heads of 64 over 1600 features), 2 layers, with separate q/k/v linears whose
# outputs are viewed as heads (the head count taken from the tensor, as Hugging Face models do: hard-coded, the
# attention could not be sharded at all): only the (batch, heads, seq, dim) tensors show that tp must divide 25
GPT2_XL_BUILDER = '''
import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, VOCAB = 1600, 25, 512


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (lin(h).view(b, s, -1, HIDDEN // HEADS).transpose(1, 2) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def build(batch_size: int = 1):
    ids = torch.zeros(batch_size, 64, dtype=torch.long)
    return Model(), (ids, ids)
'''


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def test_a_builder_imports_the_modules_beside_it_without_pythonpath(tmp_path):
    (tmp_path / "tensoropt_test_sibling_layers.py").write_text(textwrap.dedent('''
        from torch import nn

        class Net(nn.Sequential):
            def forward(self, x):
                return super().forward(x).mean()          # the loss

        def make():
            return Net(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    '''))
    (tmp_path / "builder.py").write_text(textwrap.dedent('''
        import torch
        from tensoropt_test_sibling_layers import make

        def build():
            return make(), (torch.zeros(4, 16),)
    '''))
    path_before = list(sys.path)
    graph = tensoropt.capture(f"{tmp_path / 'builder.py'}:build", cache=False).graph
    assert graph.num_parameters == 16 * 32 + 32 + 32 + 1
    assert sys.path == path_before                                # the folder was on it only while building


def test_a_gpt2_xl_shaped_builder_refuses_tp2_as_the_preset_does(tmp_path):
    builder = tmp_path / "gpt2_xl.py"
    builder.write_text(GPT2_XL_BUILDER)
    graph = tensoropt.capture(f"{builder}:build").graph
    assert (graph.meta("batch_size"), graph.meta("seq_len")) == ("1", "64")      # read from the example input
    code, out = run("frontier", "--model", f"{builder}:build", "--gpus", 2, "--gpus-per-node", 2, "--global-batch", 8,
                    "--json")
    assert code == 0, out
    tps = {p["plan"]["tp"] for p in json.loads(out)["points"]}
    assert tps == {1}                                             # 25 heads do not split over 2
    code, out = run("estimate", "--model", f"{builder}:build", "--gpus", 2, "--gpus-per-node", 2, "--tp", 2, "--pp", 1,
                    "--global-batch", 8)
    assert code == 1 and out.count("\n") == 1
    assert "--tp 2 must divide every tensor-parallel branch's heads/features" in out and " 25" in out


TINY_BUILDER = '''
import torch
from torch import nn


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Embedding(32, 8), nn.Linear(8, 1)

    def forward(self, ids):
        return self.out(self.embed(ids)).mean()


def build({params}):
    return Mixer(), {{"ids": torch.zeros(3, {length}, dtype=torch.long)}}
'''


@pytest.mark.parametrize("params, length, extra, expected", [
    ("", 12, [], "12"),                                  # read from the example input (a dict of keywords)
    ("seq_len: int = 40", "seq_len // 2", [], "40"),     # stated by the builder: its seq_len parameter's default
    ("seq_len: int = 40", "seq_len", ["--seq-len", 24], "24"),   # --seq-len passed on and recorded
])
def test_a_builders_sequence_length_is_recorded(tmp_path, params, length, extra, expected):
    builder = tmp_path / "tiny.py"
    builder.write_text(TINY_BUILDER.format(params=params, length=length))
    code, out = run("inspect", "--model", f"{builder}:build", "--json", *extra)
    assert code == 0, out
    report = json.loads(out)
    assert (report["batch_size"], report["seq_len"]) == (3, int(expected))


def test_capture_of_a_module_records_its_sequence_length():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16))
    ids = torch.zeros(2, 48, dtype=torch.long, device="meta")
    graph = tensoropt.capture(model, (ids,), cache=False).graph
    assert (graph.meta("batch_size"), graph.meta("seq_len")) == ("2", "48")
    stated = tensoropt.capture(model, (ids,), seq_len=96, cache=False).graph
    assert stated.meta("seq_len") == "96"


def test_example_shape_reads_sequences_not_images():
    assert example_shape((torch.zeros(5), torch.zeros(5, 7, dtype=torch.long))) == (5, 7)    # labels first: skipped
    assert example_shape({"x": torch.zeros(2, 9, 4)}) == (2, 9)                             # embeddings
    assert example_shape((torch.zeros(8, 3, 32, 32),)) == (8, None)                         # an image has no sequence
    assert example_shape((3,)) == (None, None)


@pytest.mark.parametrize("config, seq_len, expected", [
    ({"n_positions": 128}, None, 128),                       # GPT-2 style
    ({"n_ctx": 96}, None, 96),
    ({"max_position_embeddings": 512, "n_positions": 128}, None, 512),
    ({"max_position_embeddings": 131072}, None, 4096),       # capped
    ({"n_positions": 128}, 64, 64),                          # --seq-len wins
    ({}, None, 2048),
])
def test_hugging_face_sequence_length_reads_gpt2_style_keys(write_json, config, seq_len, expected):
    sizes = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128}
    source = resolve_model(write_json("config.json", {"model_type": "gpt2", **sizes, **config}))
    assert source.identity(None, seq_len)["seq_len"] == expected


def test_a_hugging_face_gpt2_config_is_captured_at_its_n_positions(write_json):
    path = write_json("gpt2.json", {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128,
                                    "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0})
    graph = tensoropt.capture(path).graph
    assert graph.meta("seq_len") == "128"
    embedding = next(op for op in graph.ops if op.kind == "embedding")
    assert embedding.outputs[0].shape == (1, 128, 64)
