"""Issue 16, parts 3 and 4: the loss contract is checked at capture, and a model that trains under autocast is
captured, planned and priced in the precision it computes in (nanoGPT-shaped model, examples/train_nanogpt.py)."""

import json
import sys
import textwrap

import pytest
import torch
from conftest import EXAMPLES
from workers import tensoropt_cli

import tensoropt
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.errors import CaptureError, TensorOptError
from tensoropt.graph.capture import trace_module
from tensoropt.graph.loss import describe, loss_problem
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

sys.path.insert(0, str(EXAMPLES))
from train_nanogpt import GPT  # noqa: E402

NANOGPT = str(EXAMPLES / "train_nanogpt.py")
TUPLE = "GPT.forward returns a tuple (Tensor[2, 64, 64], Tensor[]): return only the loss"


def _gpt(return_logits: bool = False) -> tuple[GPT, tuple]:
    with torch.device("meta"):
        model = GPT(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=128, return_logits=return_logits)
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    return model, (ids, ids)


# ---- part 3: the loss contract --------------------------------------------------------------------------------

def test_a_forward_returning_logits_and_loss_is_one_line_at_capture():
    model, inputs = _gpt(return_logits=True)
    with pytest.raises(CaptureError) as caught:
        trace_module(model, inputs, "GPT", require_loss=True)
    assert str(caught.value).startswith(TUPLE) and "\n" not in str(caught.value)
    graph = trace_module(*_gpt(), "GPT", require_loss=True)            # the loss alone: captured
    assert graph.meta("returns") == "a Tensor[]" and graph.meta("output") == "tensor"


def test_outputs_are_described_in_words():
    from transformers.modeling_outputs import CausalLMOutput
    logits = torch.zeros(2, 8, 5)
    assert describe((logits, torch.tensor(1.0))) == "a tuple (Tensor[2, 8, 5], Tensor[])"
    assert describe([logits, None]) == "a list [Tensor[2, 8, 5], None]"
    assert describe({"logits": logits}) == "a dict {'logits': Tensor[2, 8, 5]}"
    assert loss_problem(torch.tensor(2.0)) is None and loss_problem({"loss": torch.tensor(2.0)}) is None
    assert loss_problem(CausalLMOutput(loss=torch.tensor(2.0), logits=logits)) is None
    assert loss_problem(CausalLMOutput(logits=logits)) == ("returns a CausalLMOutput with .loss None: pass the labels "
                                                          "in the example inputs and the batch")
    assert loss_problem(logits).startswith("returns a Tensor[2, 8, 5]: return only the loss")


def test_the_script_run_alone_gets_the_same_message():
    model, _ = _gpt(return_logits=True)
    model = model.to_empty(device="cpu")
    ids = torch.zeros(2, 64, dtype=torch.long)
    _, _, run = tensoropt.parallelize(model, lambda p: torch.optim.SGD(p, lr=0.1), example_inputs=(ids, ids),
                                      global_batch=2)
    with pytest.raises(TensorOptError, match=r"forward returns a tuple \(Tensor\[2, 64, 64\], Tensor\[\]\): return "):
        run.train_step((ids, ids))


def test_capture_mode_parallelize_refuses_it_and_recaptures_under_the_steps_autocast(tmp_path, monkeypatch):
    """In capture mode (what the launcher runs), parallelize checks the loss contract and writes the graph; the
    first train_step, under the script's autocast, writes it again in that precision and ends the script."""
    from tensoropt.graph.ir import OpGraph
    from tensoropt.runtime import CAPTURE_ENV
    out = tmp_path / "graph.json"
    monkeypatch.setenv(CAPTURE_ENV, str(out))
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    with pytest.raises(CaptureError, match=r"GPT.forward returns a tuple \(Tensor\[1, 64, 64\], Tensor\[\]\)"):
        tensoropt.parallelize(_gpt(return_logits=True)[0], example_inputs=(ids, ids), global_batch=4)
    assert not out.exists()
    model, _, run = tensoropt.parallelize(_gpt()[0], lambda p: torch.optim.AdamW(p), example_inputs=(ids, ids),
                                          global_batch=4)
    first = OpGraph.from_json(json.loads(out.read_text()))
    assert not first.meta("autocast") and first.meta("returns") == "a Tensor[]"
    with pytest.raises(SystemExit) as ended, torch.autocast("cpu", dtype=torch.bfloat16):
        run.train_step((ids.repeat(4, 1), ids.repeat(4, 1)))
    assert ended.value.code == 0
    graph = OpGraph.from_json(json.loads(out.read_text()))
    assert graph.meta("autocast") == "bfloat16" and graph.meta("global_batch") == "4"
    assert {op.outputs[0].dtype for op in _products(graph)} == {"bfloat16"}


def test_inspect_and_frontier_refuse_a_builder_whose_forward_returns_logits_and_loss(tmp_path):
    builder = tmp_path / "nano.py"
    builder.write_text(textwrap.dedent(f'''
        import sys
        import torch
        sys.path.insert(0, {str(EXAMPLES)!r})
        from train_nanogpt import GPT

        def build():
            ids = torch.zeros(2, 64, dtype=torch.long)
            return GPT(64, 64, 2, 4, 128, return_logits=True), (ids, ids)
    '''))
    for command in (["inspect"], ["frontier", "--gpus", 2, "--gpus-per-node", 2]):
        result = tensoropt_cli(*command, "--model", f"{builder}:build", cwd=tmp_path)
        assert result.returncode == 1, result.stdout[-500:]
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr[-500:]
        assert f"nano.py:build: {TUPLE}" in result.stderr


@pytest.mark.slow
def test_launch_refuses_it_in_one_line_before_any_worker_starts(tmp_path):
    for extra in (["--dry-run"], []):
        run_dir = tmp_path / f"run{len(extra)}"
        result = tensoropt_cli("launch", NANOGPT, "--device", "cpu", "--gpus", 2, "--run-dir", run_dir, "--no-cache",
                               *extra, "--", "--return-logits", "--out", tmp_path / "never.json", cwd=tmp_path)
        assert result.returncode == 1, result.stdout[-500:]
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr[-500:]
        assert ("GPT.forward returns a tuple (Tensor[1, 64, 512], Tensor[]): return only the loss (a scalar tensor, "
                "or an output with .loss)") in result.stderr
        assert not (run_dir / "plan.json").exists() and not (tmp_path / "never.json").exists()   # nothing started


# ---- part 4: precision as the script trains -------------------------------------------------------------------

PRODUCTS = ("aten.addmm", "aten.mm", "aten.bmm", "aten._scaled_dot_product")


def _products(graph) -> list:
    return [op for op in graph.ops if op.target.startswith(PRODUCTS)]


def _priced(graph) -> dict:
    """One plan (one device, two micro-batches of 8, no recomputation: the first's gradients are held at the
    second's peak) priced on an H100 profile."""
    model = ModelCost(graph, tensoropt.fold(graph), Cluster(1, 1, load_profile("h100-80gb")))
    blocks = tuple(BlockPlan(b.name, ((LayerStrategy("none"), b.repeats),)) for b, _ in model.blocks)
    result = estimate(model, Plan(1, 1, 1, 1, 8, 16, 1, 0, False, (), "float32", blocks, False))
    return result.memory_breakdown | {"compute_s": result.time_breakdown["compute_s"]}


def test_a_model_under_autocast_is_captured_in_bf16_and_priced_lower_for_activations():
    model, inputs = _gpt()
    plain = tensoropt.capture(model, inputs).graph
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = tensoropt.capture(model, inputs).graph
    assert not plain.meta("autocast") and amp.meta("autocast") == "bfloat16"
    assert {op.outputs[0].dtype for op in _products(plain)} == {"float32"}
    assert {op.outputs[0].dtype for op in _products(amp)} == {"bfloat16"}       # every product computes in bf16
    assert len(_products(amp)) == len(_products(plain))
    assert amp.params == plain.params and {m.dtype for _, m in amp.params} == {"float32"}   # weights stay fp32
    # each linear still reads its weight (the strategy space finds linears so), in the dtype it computes in
    linears = [op for op in _products(amp) if op.params]
    assert len(linears) == len([op for op in _products(plain) if op.params]) == 2 * 4 + 1
    assert all(m.dtype == "bfloat16" for op in linears for m, r in zip(op.inputs, op.sources) if r.kind == "param")
    fp32, bf16 = _priced(plain), _priced(amp)
    assert bf16["activations_bytes"] < 0.75 * fp32["activations_bytes"]
    assert bf16["compute_s"] < fp32["compute_s"]
    parameters = plain.num_parameters
    for key, per_parameter in (("parameters_bytes", 4), ("gradients_bytes", 4), ("optimizer_bytes", 8)):
        assert bf16[key] == fp32[key] == per_parameter * parameters            # fp32 weights + bf16 compute
    model = model.to(torch.bfloat16)                                            # bf16 weights: autocast copies none
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights_bf16 = _priced(tensoropt.capture(model, inputs).graph)
    # "other" holds the bf16 copies of the weights beside the step's working set (the larger of the loss's backward
    # and a copy's, whose largest op's gradients are bf16 here), the same with either weights under the autocast and
    # smaller than in float32
    assert bf16["other_bytes"] - weights_bf16["other_bytes"] == 2 * parameters
    assert weights_bf16["other_bytes"] < fp32["other_bytes"]


def test_an_autocast_the_forward_enters_is_captured_on_a_cpu_only_machine():
    class Autocasting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _gpt()[0]

        def forward(self, ids, targets):
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):     # as nanoGPT's ctx, on cuda
                return self.inner(ids, targets)

    assert not torch.cuda.is_available()
    with torch.device("meta"):
        model = Autocasting()
    graph = tensoropt.capture(model, _gpt()[1], cache=False).graph
    assert graph.meta("autocast") == "bfloat16"
    assert {op.outputs[0].dtype for op in _products(graph)} == {"bfloat16"}


def test_inspect_says_a_builders_forward_runs_under_autocast(tmp_path):
    builder = tmp_path / "amp.py"
    builder.write_text(textwrap.dedent(f'''
        import sys
        import torch
        sys.path.insert(0, {str(EXAMPLES)!r})
        from train_nanogpt import GPT

        class Amp(GPT):
            def forward(self, idx, targets):
                with torch.autocast("cuda", dtype=torch.float16):
                    return super().forward(idx, targets)

        def build():
            ids = torch.zeros(2, 64, dtype=torch.long)
            return Amp(64, 64, 2, 4, 128), (ids, ids)
    '''))
    result = tensoropt_cli("inspect", "--model", f"{builder}:build", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-1000:]
    report = json.loads(result.stdout)
    assert report["autocast"] == "float16"


@pytest.mark.slow
def test_a_scripts_cuda_autocast_around_train_step_is_captured_and_priced(tmp_path):
    """The script's step runs under torch.autocast("cuda", bf16), as nanoGPT's does; captured on this CPU-only
    machine, the launcher's graph computes in bf16 and the dry run says so."""
    script = tmp_path / "train_cuda_amp.py"
    source = (EXAMPLES / "train_nanogpt.py").read_text()
    script.write_text(source.replace("autocast(device_type=run.device.type,", 'autocast(device_type="cuda",'))
    assert 'device_type="cuda"' in script.read_text()
    from launcher.capture import capture_script
    graph = capture_script(str(script), [], use_cache=False)
    assert graph.meta("autocast") == "bfloat16" and {op.outputs[0].dtype for op in _products(graph)} == {"bfloat16"}
    assert json.loads(graph.meta("sources"))                  # captured by the script's own run
    result = tensoropt_cli("launch", script, "--device", "cpu", "--gpus", 2, "--dry-run", "--run-dir", tmp_path / "run",
                           "--no-cache", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "compute and activations in bfloat16 under the script's autocast" in result.stdout
    assert "model states: bf16-mixed" in result.stdout        # the script's own autocast: bf16-mixed runs
