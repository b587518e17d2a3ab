"""The lean cross-entropy (``runtime.parallel.vocab_loss``): on vocabulary-split logits, the same loss and logit
gradient as torch's ``F.cross_entropy`` on the whole logits, on 2 gloo workers; on whole logits
(``fused_loss(whole=True)``), the same in one process, on real and fake tensors; either way a backward that makes no
logit-sized tensor but the cast to the logits' dtype; the capture telling a loss that comes through ``F.cross_entropy``
from one made of ``log_softmax`` and ``nll_loss``; and the cost model pricing each as it runs."""

import dataclasses
import json
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from test_vocab_parallel import capture, gpt
from vocab_loss_probe import IGNORE, ShareSizedOutputs, reference_inputs
from workers import ENV, torchrun_argv

from tensoropt.cost.torch_memory import FLOAT32, LEAN_LOSS_TOKEN_BYTES, loss_gradient_bytes
from tensoropt.models.transformer import DecoderLM
from tensoropt.runtime.parallel.vocab_loss import fused_loss
from tensoropt.space.vocab import vocab_layout

PROBE = REPO / "tests" / "vocab_loss_probe.py"
TOKENS, VOCAB = 24, 32                  # the probe's logits
EPS = {"float32": torch.finfo(torch.float32).eps, "bfloat16": torch.finfo(torch.bfloat16).eps}


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("vocab_loss") / "out"
    result = subprocess.run(torchrun_argv(str(PROBE), [str(out)], 2), capture_output=True, text=True, env=ENV,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(out.with_name(f"out.{rank}.json").read_text()) for rank in (0, 1)]


def lean_cases(probed: list[dict]):
    """(key, result) of every case the lean loss ran, on both ranks."""
    return [(key, r) for results in probed for key, r in results.items() if not key.endswith("loss_parallel")]


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_the_lean_loss_equals_cross_entropy_on_the_whole_logits(probed):
    for key, r in lean_cases(probed):
        # both sum the same float32 exponentials of each row (V terms, in two shares here) and reduce the
        # tokens' losses: a few roundings per term
        assert r["loss_error"] <= r["loss_scale"] * TOKENS * VOCAB * EPS["float32"], key
        # the gradient: float32 as the reference's, or cast from float32 to bfloat16 by both (one rounding)
        dtype = r["grad_dtype"].removeprefix("torch.")
        assert r["grad_error"] <= r["grad_scale"] * (VOCAB * EPS["float32"] + EPS[dtype]), key


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_the_lean_backward_makes_only_the_cast_and_runs_once(probed):
    for results in probed:
        for key, r in results.items():
            if key.endswith("loss_parallel"):
                assert r["made"], key       # torch's makes its gradient (and, inside its op, three shares)
    for key, r in lean_cases(probed):
        assert r["made"] == ([] if key.startswith("float32") or key == "module" else
                             ["aten::_to_copy:bfloat16"]), key
        assert "backward through this loss once" in r["twice"], key


def _lean_whole(logits: torch.Tensor, target: torch.Tensor, reduction: str, route: bool = True) -> torch.Tensor:
    with fused_loss(whole=True) if route else fused_loss():
        return F.cross_entropy(logits, target, ignore_index=IGNORE, reduction=reduction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_whole_logits_run_the_lean_loss_to_torchs_values_making_only_the_cast(dtype, reduction):
    """Where the vocabulary is not split (any tp, any engine) a plan whose loss runs lean (``RunPlan.lean_loss``)
    routes whole logits to the same function with no process group: torch's loss and logit gradient, within the
    same bounds as the split one's, and a backward that makes only the gradient's cast, where torch's makes two
    float32 logit-sized tensors."""
    whole, target, upstream, reference, expected = reference_inputs(dtype, reduction)
    torch_made = ShareSizedOutputs(TOKENS * VOCAB)
    with torch_made:
        expected.backward(upstream)
    logits = whole.clone().requires_grad_()
    loss = _lean_whole(logits, target, reduction)
    assert type(loss.grad_fn).__name__ == "_SplitCrossEntropyBackward"
    made = ShareSizedOutputs(TOKENS * VOCAB)
    with made:
        loss.backward(upstream)
    # as the split loss's bounds (test_the_lean_loss_equals_cross_entropy_on_the_whole_logits), in one share of V terms
    scale = float(expected.detach().abs().max())
    assert float((loss.detach() - expected.detach()).abs().max()) <= scale * TOKENS * VOCAB * EPS["float32"]
    grad_scale = float(reference.grad.float().abs().max())
    eps = EPS[str(dtype).removeprefix("torch.")]
    assert float((logits.grad.float() - reference.grad.float()).abs().max()) <= \
        grad_scale * (VOCAB * EPS["float32"] + eps)
    assert logits.grad.dtype == dtype
    assert made.made == ([] if dtype == torch.float32 else ["aten::_to_copy:bfloat16"])
    assert len([m for m in torch_made.made if m.endswith("float32")]) >= 2, torch_made.made
    with pytest.raises(RuntimeError, match="backward through this loss once"):
        loss.backward(upstream)


def test_whole_logits_are_routed_only_where_the_plan_says_and_on_fake_tensors_too():
    """Outside ``whole=True`` (a plan whose loss was priced as torch's) whole logits run torch's loss; the memory
    check's fake tensors take the lean route as the real run does (``runtime.memory.check``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    logits, target = torch.randn(TOKENS, VOCAB, requires_grad=True), torch.randint(0, VOCAB, (TOKENS,))
    assert type(_lean_whole(logits, target, "mean", route=False).grad_fn).__name__ != "_SplitCrossEntropyBackward"
    assert type(_lean_whole(logits.view(2, -1, VOCAB).transpose(1, 2), target.view(2, -1), "mean").grad_fn
                ).__name__ != "_SplitCrossEntropyBackward"           # not rows of logits: torch's
    with FakeTensorMode():
        fake = torch.randn(TOKENS, VOCAB, requires_grad=True)
        loss = _lean_whole(fake, torch.randint(0, VOCAB, (TOKENS,)), "mean")
        assert type(loss.grad_fn).__name__ == "_SplitCrossEntropyBackward"
        loss.backward()
        assert fake.grad.shape == (TOKENS, VOCAB)


class SplitLoss(DecoderLM):
    """The built-in decoder, its loss made of ``log_softmax`` and ``nll_loss`` called apart."""

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, self.causal_mask, None)
        logits = self.head(self.norm(x)).float()
        return F.nll_loss(F.log_softmax(logits.view(-1, logits.shape[-1]), dim=-1), labels.reshape(-1))


class Priced:
    """What ``loss_gradient_bytes`` reads of a ``ModelCost``: the vocabulary layout and the blocks' carried bytes per
    sample."""

    def __init__(self, vocab, carried_bytes: int = 0):
        self.vocab, self.carried_bytes = vocab, carried_bytes


def test_the_capture_tells_how_the_loss_is_called_and_the_price_follows():
    fused = vocab_layout(capture(gpt()))
    apart_model = gpt()
    apart_model.__class__ = SplitLoss
    apart = vocab_layout(capture(apart_model))
    assert (fused.fused_loss, apart.fused_loss, fused.refused, apart.refused) == (True, False, "", "")
    assert fused.logit_bytes == FLOAT32                  # a float32 model: its logits need no cast
    tokens = 1000.0
    logits = tokens * fused.vocab
    targets = 2 * tokens * 8 + 2 * FLOAT32               # int64 ids and targets, the loss's float32 scalars
    # the lean loss's moment is its forward: the head's logits (and a float32 copy of bf16 ones) beside the saved
    # softmax; torch's loss_parallel's is its backward, three float32 shares; unsplit, torch's two whole gradients
    lean = LEAN_LOSS_TOKEN_BYTES * tokens                # the lean loss's per-token vectors (below)
    assert loss_gradient_bytes(Priced(fused), 2, 1, logits) == logits * FLOAT32 / 2 + lean + targets
    assert loss_gradient_bytes(Priced(apart), 2, 1, logits) == logits * 3 * FLOAT32 / 2 + targets
    # whole (tp 1): the lean loss's forward, the float32 logits; torch's two whole float32 gradients
    assert loss_gradient_bytes(Priced(fused), 1, 1, logits) == logits * FLOAT32 + lean + targets
    assert loss_gradient_bytes(Priced(apart), 1, 1, logits) == logits * 2 * FLOAT32 + targets
    # the lean loss's moment is in the model's forward: its frames may hold the embedding's and the blocks' outputs
    # (two carried streams) and the loss's per-token vectors are live; torch's loss peaks in its backward, after them
    carried = 4096
    assert loss_gradient_bytes(Priced(fused, carried), 1, 3, logits) == \
        3 * (logits * FLOAT32 + 2 * carried + LEAN_LOSS_TOKEN_BYTES * tokens) + 3 * 2 * tokens * 8 + 2 * FLOAT32
    assert loss_gradient_bytes(Priced(apart, carried), 1, 1, logits) == logits * 2 * FLOAT32 + targets
    half = Priced(dataclasses.replace(fused, logit_bytes=2))
    assert loss_gradient_bytes(half, 2, 1, logits) == logits * (2 + FLOAT32) / 2 + lean + targets
    assert loss_gradient_bytes(half, 1, 1, logits) == logits * (2 + FLOAT32) + lean + targets


def test_a_pipeline_stage_calls_the_loss_through_the_entry_point_the_step_routes():
    """A traced pipeline stage records ``F.cross_entropy`` as the aten op, which no patch of torch's Python entry point
    reaches; the stage's graph is given the entry point back (``pipeline_tp.route_cross_entropy``), so the lean
    loss runs on the last stage of a pipeline as in the whole model; the stage computes the same loss."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from tensoropt.graph.loss import counting_cross_entropy
    from tensoropt.runtime.pipeline.tp import route_cross_entropy
    model = gpt()
    ids = torch.randint(0, 128, (1, 32))
    pipe = pipeline(model, mb_args=(ids, ids), split_spec={"layers.1": SplitPoint.BEGINNING})
    first, last = pipe.get_stage_module(0), pipe.get_stage_module(1)
    inputs = first(ids)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    before = [0]
    with counting_cross_entropy(before):
        expected = last(*inputs, ids)
    route_cross_entropy(last)
    after = [0]
    with counting_cross_entropy(after):
        got = last(*inputs, ids)
    assert (before[0], after[0]) == (0, 1)
    assert torch.equal(got, expected) and torch.equal(got, model(ids, ids))
