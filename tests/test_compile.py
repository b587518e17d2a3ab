"""``tensoropt launch --compile`` (issue 19 part 1): every block copy under ``torch.compile`` (runtime.engines.compile),
planned and priced as compiled, and refused where the engines do not run it compiled (search.engines).

The five launches compile for real with inductor on the CPU (g++: each distinct block's forward and backward, about
half a minute per worker on an idle 2-core machine, a few minutes a launch while other work loads it, which is why
there are only five; a block graph compiled once in the session is reused from the cache: the ZeRO 1 launch's takes
~15 s). Their inductor cache is the test session's own
(``TORCHINDUCTOR_CACHE_DIR``, conftest.ISOLATED), never the user's. Losses are compared with the eager script run
alone at rtol 1e-4, not the suite's 2e-5: inductor fuses each block's layer norms, softmax and GELU into loops
that sum float32 in another order than eager's kernels (measured here: 2e-7 relative after three AdamW steps on
one process), and a CPU with other vector widths sums in other orders again; a compiled block that computed
something else (a copy skipped, a wrong gradient) moves the second step's loss by more than 1e-3.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner
from conftest import LAUNCH_CWD, SMALL_GPT
from torch.distributed.checkpoint import FileSystemReader
from workers import GPT_SCRIPT, losses_alone, tensoropt_cli

import tensoropt
from tensoropt.cli import cli
from tensoropt.cost.model import ModelCost, estimate
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.memory.check import unsimulated
from tensoropt.search.engines import COMPILE_SPACES, unsupported
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

RTOL = 1e-4
LAYERS = ("--layers", "2")


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "small.json"
    path.write_text(json.dumps(SMALL_GPT))
    return tensoropt.capture(str(path)).graph


def _plan(zero: int = 3, recompute: tuple[str, ...] = ("none",) * 4, tp: int = 1, pp: int = 1,
          compile: bool = True, sp: bool = False) -> Plan:
    strategies = tuple((LayerStrategy(r, sp), 1) for r in recompute)
    return Plan(devices=2 * tp * pp, dp=2, tp=tp, pp=pp, micro_batch=1, global_batch=8, zero=zero, compile=compile,
                tp_branches=("attn", "mlp") if tp > 1 else (), blocks=(BlockPlan("layers.*", strategies),))


def test_the_compiled_space_is_what_the_torch_engine_runs_compiled():
    runs = [_plan(0), _plan(1), _plan(2), _plan(3), _plan(3, ("full", "none", "full", "none")), _plan(3, tp=2),
            _plan(3, pp=2), dataclasses.replace(_plan(0, ("full", "none"), pp=2), virtual_stages=2)]
    assert all(unsupported(p, "torch") == [] for p in runs)
    refused = {
        "selective recomputation": _plan(3, ("selective",) * 4), "sequence parallelism": _plan(3, tp=2, sp=True)}
    for what, plan in refused.items():
        assert unsupported(plan, "torch") == [f"compiled blocks with {what}"], what
        assert unsupported(dataclasses.replace(plan, compile=False), "torch") == [], what   # eager: runs
    assert unsupported(_plan(3), "deepspeed") == ["compiled blocks (the deepspeed engine runs eager PyTorch: drop "
                                                  "--compile)"]
    assert unsupported(_plan(3, compile=False), "deepspeed") == []
    assert set(COMPILE_SPACES) == {"torch"}
    # launch --dry-run --check-memory says it does not simulate compiled blocks (fake tensors through inductor)
    assert "compiled blocks are not simulated" in unsimulated(_plan(3), "torch")
    assert unsimulated(_plan(3, compile=False), "torch") is None


def test_compiled_plans_are_searched_in_that_space_and_priced_as_estimate_prices_them(graph):
    cluster = Cluster(2, 2, load_profile("h100-80gb"))
    front, eager = (tensoropt.plan(graph, cluster, engines=["torch", "deepspeed"], compile=compile, global_batch=8,
                                   precision="bf16-mixed") for compile in (True, False))
    assert set(front.engines) == {"torch"} and "deepspeed" in eager.engines
    model = ModelCost(graph, tensoropt.fold(graph), cluster)
    for point in front.points:
        plan = point.plan
        assert plan.compile, plan.summary()
        assert {s.recompute for b in plan.blocks for s, _ in b.strategies} <= {"none", "full"}
        assert not any(s.sequence_parallel for b in plan.blocks for s, _ in b.strategies)
        assert unsupported(plan, "torch") == []
        priced = estimate(model, plan)                   # tensoropt estimate --compile prices it so
        assert point.iteration_time_s == pytest.approx(priced.iteration_time_s, rel=1e-9)
        # fused memory-bound chains on an H100: the same plan run eager is slower, as estimate --eager says
        slower = estimate(model, dataclasses.replace(plan, compile=False))
        assert slower.iteration_time_s > priced.iteration_time_s
        assert slower.peak_memory_bytes == priced.peak_memory_bytes
    assert not any(p.plan.compile for p in eager.points)
    # the compiled space reaches past DDP and ZeRO 3: tensor-parallel and ZeRO 1-2 plans are searched compiled too
    assert any(p.plan.tp > 1 for p in front.points) and any(p.plan.zero in (1, 2) for p in front.points)


def test_ops_outside_the_blocks_are_priced_eager_when_the_blocks_compile(graph):
    # the runtime compiles the block copies only: the embedding, final norm, head and loss run eager
    eager = ModelCost(graph, tensoropt.fold(graph), Cluster(2, 2, load_profile("h100-80gb")))
    compiled = eager.with_kernels(True)
    assert compiled.loose(1, 1, 1) == eager.loose(1, 1, 1)
    assert compiled.blocks[0][1].arrays.activation_bytes.sum() < eager.blocks[0][1].arrays.activation_bytes.sum()


def test_frontier_compile_prices_the_plans_compiled(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL_GPT))
    fronts = {}
    for flags in ([], ["--compile"]):
        result = CliRunner().invoke(cli, ["frontier", "--model", str(path), "--gpus", "8", "--device", "h100-80gb",
                                          "--global-batch", "32", "--json", *flags])
        assert result.exit_code == 0, result.output
        fronts[bool(flags)] = json.loads(result.stdout)["points"]
    assert all(p["plan"]["compile"] for p in fronts[True]) and not any(p["plan"]["compile"] for p in fronts[False])
    assert min(p["iteration_time_s"] for p in fronts[True]) < min(p["iteration_time_s"] for p in fronts[False])


@pytest.mark.parametrize("argv, expected", [
    (["--engine", "deepspeed"], "--compile compiles the torch engine's blocks; the deepspeed engine runs eager"),
    (["--elastic", "--checkpoint-dir", "ck"], "--elastic runs eager blocks"),
    (["--recompute", "selective"], "no plan that the runtime runs with compiled blocks (no or full recomputation, no "
                                   "sequence parallelism) splits global batch 8 over 2 devices within --recompute "
                                   "selective: drop --compile or relax the limits"),
], ids=["deepspeed", "elastic", "selective"])
def test_compile_where_it_does_not_run_is_one_line(argv, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["launch", GPT_SCRIPT, "--device", "cpu", "--gpus", "2", "--dry-run",
                                      "--compile", *argv])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0] and list(tmp_path.iterdir()) == []


# FSDP2 ZeRO 3 of the 2-layer GPT, its first copy fully recomputed, in the suite's 32-true
ZERO3 = Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=2, global_batch=8, zero=3, dtype="float32", master_weights=False,
             precision="32-true", compile=True,
             blocks=(BlockPlan("layers.*", ((LayerStrategy("full"), 1), (LayerStrategy("none"), 1))),))


def test_a_plan_file_runs_compiled_when_it_says_so_or_when_launch_says_compile(tmp_path):
    for name, plan, flags in (("compiled", ZERO3, []), ("eager", dataclasses.replace(ZERO3, compile=False),
                                                         ["--compile"])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(plan.to_json()))
        result = tensoropt_cli("launch", GPT_SCRIPT, "--device", "cpu", "--gpus", 2, "--run-dir", tmp_path / name,
                               "--plan", path, *flags, "--dry-run", "--", *LAYERS, cwd=LAUNCH_CWD)
        assert result.returncode == 0, result.stderr[-2000:]
        written = json.loads((tmp_path / name / "plan.json").read_text())
        assert written["compile"] is True and written["summary"] == ZERO3.summary(), name
        assert "torch.compile on 2 block copies per stage" in result.stdout


def _launch(tmp_path, *args, layers: tuple[str, ...] = LAYERS) -> tuple[dict, dict]:
    """(what rank 0 wrote, the plan.json the workers ran) of a 2-step launch of the 2-layer GPT (or ``layers``) on
    2 CPU workers."""
    result = tensoropt_cli("launch", GPT_SCRIPT, "--device", "cpu", "--gpus", 2, "--run-dir", tmp_path / "run", *args,
                           "--", *layers, "--steps", 2, "--out", tmp_path / "losses.json", cwd=LAUNCH_CWD)
    assert result.returncode == 0, result.stderr[-3000:]
    return (json.loads((tmp_path / "losses.json").read_text()),
            json.loads((tmp_path / "run" / "plan.json").read_text()))


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The 2-layer script's two losses run alone, eager (one process, no plan)."""
    return losses_alone(GPT_SCRIPT, tmp_path_factory.mktemp("alone") / "losses.json", *LAYERS, steps=2)


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_launch_compile_plans_compiled_blocks_and_trains_to_the_eager_losses(alone, tmp_path):
    ran, written = _launch(tmp_path, "--compile", "--zero", 0)      # DDP around the compiled copies
    assert written["compile"] is True and "compiled" in written["summary"]
    assert (written["engine"], written["dp"], written["zero"]) == ("torch", 2, 0)
    assert ran["losses"] == pytest.approx(alone, rel=RTOL)
    # both copies wrapped, and one dynamo graph serves both: identical copies do not recompile
    assert ran["compiled_block_copies"] == 2
    assert ran["dynamo_graphs"] == 1


FOUR_LAYERS = ("--layers", "4")


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("plan, layers", [
    # FSDP2 ZeRO 3, the first copy recomputed (checkpoint_wrapper inside the compiled region)
    (ZERO3, LAYERS),
    # tensor parallelism inside the compiled copies (DTensor's collectives traced with them), the first recomputed
    (dataclasses.replace(ZERO3, dp=1, tp=2, zero=0, tp_branches=("attn", "mlp")), LAYERS),
    # FSDP2 ZeRO 1: no resharding after the forward, gradients reduced on the last of 2 micro-batches only
    (dataclasses.replace(ZERO3, zero=1, blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 2),)),)), LAYERS),
    # two pipeline stages of two virtual stages each (interleaved 1F1B), a recomputed and a plain copy in each: the
    # copies compiled inside the traced stage modules
    (dataclasses.replace(ZERO3, dp=1, pp=2, virtual_stages=2, zero=0), FOUR_LAYERS),
], ids=["fsdp2-zero3", "tp2", "fsdp2-zero1", "pp2x2"])
def test_compiled_plans_train_to_the_eager_losses(plan, layers, tmp_path_factory, tmp_path):
    eager = losses_alone(GPT_SCRIPT, tmp_path_factory.mktemp("alone") / "losses.json", *layers, steps=2)
    path = tmp_path / "given.json"
    path.write_text(json.dumps(plan.to_json()))
    ran, written = _launch(tmp_path, "--plan", path, "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 2,
                           layers=layers)
    assert written["compile"] is True and ran["plan"] == plan.summary()
    assert ran["losses"] == pytest.approx(eager, rel=RTOL)
    # the checkpoint holds the script's own names (DCP drops the compiled wrapper's _orig_mod.), whatever held the
    # compiled copies (a stage module, a DTensor): any plan loads it. A pipeline's also holds the model's
    # non-persistent causal_mask buffer, compiled or not (traced stage modules keep it)
    saved = FileSystemReader(str(tmp_path / "ck" / "step-00000002")).read_metadata().state_dict_metadata
    model = DecoderLM(TransformerConfig(hidden_size=64, num_layers=int(layers[1]), num_attention_heads=4,
                                        ffn_hidden_size=256, seq_length=32, vocab_size=128))
    traced = {"model.causal_mask"} if plan.pp > 1 else set()
    assert {k for k in saved if k.startswith("model.")} - traced == {f"model.{k}" for k in model.state_dict()}
    copies = {s.recompute for s, _ in plan.blocks[0].strategies}
    assert ran["compiled_block_copies"] == 2             # rank 0's: both copies, of one stage or of its two
    assert ran["dynamo_graphs"] == len(copies)           # one graph per distinct copy (plain, recomputed)
