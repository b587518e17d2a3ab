"""Selective recomputation in the torch engine (``runtime.memory.selective``): one block copy keeps all autograd
saves but its attention core, which the cost model says it drops, and trains exactly as without it."""

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import LAUNCH_CWD
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from workers import GPT_SCRIPT, LOSS_RTOL, dry_run_plan, launched_with_plan, tensoropt_cli

import tensoropt
from tensoropt.cost.model import ModelCost
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.errors import TensorOptError
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.memory.selective import selective_wrapper
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

BATCH, SEQ = 2, 64


def _model(attention="eager", dropout=0.0) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(TransformerConfig(hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=256,
                                       seq_length=SEQ, vocab_size=128, dropout=dropout, attention=attention))


class _Made(TorchDispatchMode):
    """Every storage an op makes, weakly held: after the forward, the live ones are what the graph keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[StorageWeakRef, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.setdefault(StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self, *besides: torch.Tensor) -> int:
        held = {StorageWeakRef(t.untyped_storage()) for t in besides}
        return sum(n for ref, n in self.storages.items() if not ref.expired() and ref not in held)


def _run(block, x, mask, grad, seed=1):
    """(bytes the block's forward leaves for its backward, x's gradient, parameter gradients)."""
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    with _Made() as made:
        out = block(x, mask)
    kept = made.live_bytes(out)
    out.backward(grad)
    return kept, x.grad, {n: p.grad for n, p in block.named_parameters()}


def _core_bytes(model: DecoderLM) -> float:
    """What the cost model says selective recomputation drops from one block copy at micro-batch BATCH."""
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    graph = tensoropt.capture(model, (ids, ids), cache=False).graph
    [(_, cost)] = ModelCost(graph, tensoropt.fold(graph), Cluster(1, 1, load_profile("h100-80gb"))).blocks
    kept = {r: cost.layer(LayerStrategy(r), 1, (), BATCH).activation_bytes for r in ("none", "selective")}
    return kept["none"] - kept["selective"]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_selective_block_drops_exactly_the_attention_core_and_keeps_its_gradients(dropout):
    """In its first forward (the dispatch mode finds and tapes the core) and in later ones (it runs under its learned
    saved-tensor hooks alone): the block keeps the same bytes, and its gradients are bitwise the plain block's; with
    attention dropout the replay draws the very random numbers the forward drew (each forward from another generator
    state here: the seed of each run). Without dropout what it drops is what the cost model says the core keeps
    (with dropout the CPU's mask is a byte per element wider than the GPU kernel's the capture prices)."""
    model = _model(dropout=dropout)
    block, mask = model.layers[0], model.causal_mask
    x, grad = torch.randn(BATCH, SEQ, 64), torch.randn(BATCH, SEQ, 64)
    wrapped = selective_wrapper(copy.deepcopy(block))
    core = _core_bytes(model)
    assert core >= BATCH * 4 * SEQ * SEQ * 4                       # at least the softmax's probabilities
    kept = []
    for seed in (1, 2, 3):
        plain_bytes, plain_dx, plain_grads = _run(block, x, mask, grad, seed)
        block.zero_grad(set_to_none=True)
        wrapped.zero_grad(set_to_none=True)
        selective_bytes, dx, grads = _run(wrapped, x, mask, grad, seed)
        kept.append(selective_bytes)
        if not dropout:
            assert plain_bytes - selective_bytes == pytest.approx(core, rel=0.03), seed
        assert torch.equal(dx, plain_dx), seed
        grads = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in grads.items()}
        assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    from tensoropt.runtime.memory.selective import LEARNED
    assert getattr(wrapped._checkpoint_wrapped_module, LEARNED)      # the later forwards ran as learned
    assert kept[0] == kept[1] == kept[2]


def test_fused_attention_has_no_core_so_selective_keeps_everything():
    model = _model(attention="flash")
    block = model.layers[0]
    x, grad = torch.randn(BATCH, SEQ, 64), torch.randn(BATCH, SEQ, 64)
    plain_bytes, plain_dx, _ = _run(block, x, None, grad)
    selective_bytes, dx, _ = _run(selective_wrapper(copy.deepcopy(block)), x, None, grad)
    assert selective_bytes == plain_bytes and torch.equal(dx, plain_dx)


def _modes_inside(block) -> list:
    """For each forward of ``block``: whether a ``CoreMode`` and saved-tensor hooks are on where its attention
    starts."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from tensoropt.runtime.memory.selective import CoreMode
    seen = []
    block.attn.register_forward_pre_hook(lambda *_: seen.append((
        any(isinstance(m, CoreMode) for m in _get_current_dispatch_mode_stack()),
        torch._C._autograd._top_saved_tensors_default_hooks(True) is not None)))
    return seen


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_a_copy_without_core_runs_no_dispatch_mode_after_its_first_forward(attention):
    """Fused attention has no core: after its first forward the selective copy runs plainly (no ``CoreMode``, no
    hooks), with the plain copy's gradients bitwise; an eager copy learns its core in its first forward and runs
    the later ones under its saved-tensor hooks alone, without the mode."""
    model = _model(attention=attention)
    block, mask = model.layers[0], model.causal_mask if attention == "eager" else None
    x, grad = torch.randn(BATCH, SEQ, 64), torch.randn(BATCH, SEQ, 64)
    _, plain_dx, plain_grads = _run(block, x, mask, grad)
    wrapped = selective_wrapper(copy.deepcopy(block))
    seen = _modes_inside(wrapped._checkpoint_wrapped_module)
    for _ in range(2):
        wrapped.zero_grad(set_to_none=True)
        _, dx, grads = _run(wrapped, x, mask, grad)
        assert torch.equal(dx, plain_dx)
        assert all(torch.equal(g, plain_grads[n.replace("_checkpoint_wrapped_module.", "")]) for n, g in grads.items())
    assert seen[0] == (True, True)
    assert seen[1] == ((False, True) if attention == "eager" else (False, False))


class _ScoresOfInput(torch.nn.Module):
    """Attention whose scores are the block's input times itself: the core reads the input directly."""

    def forward(self, x):
        return (x @ x.transpose(-2, -1)).softmax(-1) @ x


def test_an_input_of_the_core_changed_after_the_forward_stops_the_backward_in_one_line():
    x = torch.randn(2, 8, 4, requires_grad=True)
    y = x * 1.0
    out = selective_wrapper(_ScoresOfInput())(y)
    with torch.no_grad():
        y.add_(1.0)               # autograd saved y too; the core's check comes first and says what to do
    with pytest.raises(TensorOptError, match="plan this block with full recomputation instead"):
        out.sum().backward()


def test_the_engine_wraps_each_copy_as_its_strategy_says():
    """Per copy, in model order: selective copies get the selective wrapper, full ones torch's checkpoint."""
    from tensoropt.runtime.memory.recompute import apply_recompute
    from tensoropt.runtime.memory.selective import selective_checkpoint
    model = DecoderLM(TransformerConfig(hidden_size=32, num_layers=4, num_attention_heads=4, ffn_hidden_size=64,
                                        seq_length=16, vocab_size=64))
    plan = Plan(devices=1, dp=1, tp=1, pp=1, micro_batch=1, global_batch=1, blocks=(BlockPlan("layers.*", tuple(
        (LayerStrategy(r), n) for r, n in (("selective", 2), ("full", 1), ("none", 1)))),))
    apply_recompute(model, plan)
    kinds = [getattr(getattr(layer, "checkpoint_fn", None), "func", None) for layer in model.layers]
    assert kinds[:2] == [selective_checkpoint] * 2 and kinds[2] is torch.utils.checkpoint.checkpoint
    assert kinds[3] is None and type(model.layers[3]).__name__ == "Block"


# --- real workers: tensoropt launch --plan with selective copies trains to the script's own losses ---

def _launched(plan, tmp_path, engine: str) -> list[float]:
    """The launched run of ``plan`` on a model the script builds on the meta device (``--meta``): each worker
    materialises its own part, on the CPU, and the losses must be those of the script alone with the model built
    for real (the same values: ``init_fn`` on the materialised part). These five runs are also the suite's
    meta-built trainings under DDP, FSDP2 ZeRO 3, tp2, pp2 and DeepSpeed ZeRO 3."""
    data = launched_with_plan(plan, tmp_path, plan.devices, GPT_SCRIPT, "--meta", engine=engine)
    copies = sum(n for b in plan.blocks for s, n in b.strategies if s.recompute == "selective")
    assert f"attention core recomputed (selective) in {copies} block copies" in data["stdout"]
    assert (data["device"], data["parameter_devices"]) == ("cpu", ["cpu"]) and data["written"]["device"] == "cpu"
    return data["losses"]


@pytest.fixture(scope="module")
def dry_plan(tmp_path_factory):
    return dry_run_plan(GPT_SCRIPT, tmp_path_factory.mktemp("dry"))


def _blocks(*strategies) -> tuple:
    return (BlockPlan("layers.*", tuple((LayerStrategy(r), n) for r, n in strategies)),)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("engine, change", [
    ("torch", dict(dp=2, tp=1, pp=1, zero=0, micro_batch=2, blocks=_blocks(("selective", 3), ("none", 1)))),  # DDP
    ("torch", dict(dp=2, tp=1, pp=1, zero=3, micro_batch=1,                                             # FSDP2
                   blocks=_blocks(("selective", 2), ("full", 1), ("none", 1)))),
    ("torch", dict(dp=1, tp=2, pp=1, zero=0, micro_batch=4, tp_branches=("attn", "mlp"),                # 2 heads each
                   blocks=_blocks(("selective", 4)))),
    ("torch", dict(dp=1, tp=1, pp=2, zero=0, micro_batch=2, blocks=_blocks(("selective", 2)))),        # 1F1B
    ("deepspeed", dict(dp=2, tp=1, pp=1, zero=3, micro_batch=1,                                         # ZeRO 3
                       blocks=_blocks(("selective", 2), ("full", 1), ("none", 1)))),
], ids=["ddp", "fsdp2-zero3", "tp2", "pp2", "deepspeed-zero3"])
def test_selective_plans_train_to_the_losses_of_the_script_alone(reference, dry_plan, tmp_path, engine, change):
    plan = dataclasses.replace(dry_plan, offload=False, virtual_stages=1, **change)
    np.testing.assert_allclose(_launched(plan, tmp_path, engine), reference, rtol=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_the_launcher_chooses_selective_plans_and_they_train(reference, tmp_path):
    """``--recompute selective`` leaves the launcher only selective plans: it finds one it can run and runs it."""
    out = tmp_path / "losses.json"
    result = tensoropt_cli("launch", GPT_SCRIPT, "--device", "cpu", "--gpus", 2, "--recompute", "selective",
                           "--run-dir", tmp_path / "run", "--", "--steps", 3, "--out", out, cwd=LAUNCH_CWD)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert {s["recompute"] for b in plan["blocks"] for s in b["strategies"]} == {"selective"}
    assert "attention core recomputed (selective)" in result.stdout
    np.testing.assert_allclose(json.loads(out.read_text())["losses"], reference, rtol=LOSS_RTOL)


def test_hugging_face_eager_attention_with_dropout_and_gqa_keeps_its_gradients():
    """Another attention code (Hugging Face LLaMA, eager: additive mask, float32 softmax, dropout, repeated
    key/value heads): the core is found by data flow, dropped and replayed exactly."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, attn_implementation="eager",
                                   attention_dropout=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    results = []
    for selective in (False, True):
        copied = copy.deepcopy(model)
        if selective:
            for i, layer in enumerate(copied.model.layers):
                copied.model.layers[i] = selective_wrapper(layer)
        torch.manual_seed(5)
        with _Made() as made:
            loss = copied(input_ids=ids, labels=ids).loss
        kept = made.live_bytes(loss)
        loss.backward()
        results.append((kept, {n.replace("_checkpoint_wrapped_module.", ""): p.grad
                               for n, p in copied.named_parameters()}))
    (plain_bytes, plain_grads), (selective_bytes, grads) = results
    assert plain_bytes - selective_bytes >= 2 * 2 * 4 * SEQ * SEQ * 4     # at least the probabilities of 2 layers
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads)
