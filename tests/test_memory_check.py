"""``launch --dry-run --check-memory``: rank 0's step simulated on fake tensors holds what the real run holds.

Each slow case writes one plan, simulates it through the launcher (``--check-memory``, one process, nothing
allocated), then trains it for real on two CPU workers with ``TENSOROPT_MEMORY_OUT``, which tracks the same
steps with the same tracker, and compares rank 0's peak tensor bytes. The real runs go through
``workers.launched_once``: where another test launches the same plan (the DDP case is tests/test_launch.py's DDP run,
ZeRO 3 in bf16-mixed tests/test_precision.py's), the one launch serves both."""

import dataclasses
import json

import pytest
import torch
from conftest import LAUNCH_CWD
from workers import ENV, GPT_SCRIPT, gpt_plan, launched_once, tensoropt_cli

from tensoropt.runtime.memory.check import unsimulated
from tensoropt.runtime.memory.tracker import StepMemory
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

RELATIVE = 0.02          # "within a few percent"; the cases below agree to 0.3% or within 1 KiB


def test_tracker_counts_live_storages_once_and_names_their_roles():
    """A view adds nothing, a freed tensor leaves the count, the peak is kept with what was live at it, and a
    storage registered as a parameter is counted under parameters."""
    weight = torch.zeros(1000)                               # 4000 bytes, made before tracking
    tracker = StepMemory()
    tracker.register("parameters", [weight])
    with tracker:
        a = torch.ones(500)                                  # 2000 bytes, forward: an activation
        view = a[:10]
        b = a * 2                                            # 2000 more: peak 8000
        del a, view, b
        c = torch.ones(250)                                  # 1000 after the peak
    assert tracker.peak_bytes == 8000
    assert tracker.live_bytes == 5000 and c.numel() == 250
    assert tracker.breakdown() == {"parameters": 4000, "gradients": 0, "optimizer": 0, "activations": 4000,
                                   "temporaries": 0, "peak_bytes": 8000}
    # what the peak is made of, largest first (ties in the order the storages were first seen)
    assert tracker.largest_at_peak(2) == [
        {"bytes": 4000, "category": "parameters", "op": None, "shape": [1000], "dtype": "torch.float32"},
        {"bytes": 2000, "category": "activations", "op": "aten.ones.default", "shape": [500], "dtype": "torch.float32"}]
    assert [t["op"] for t in tracker.largest_at_peak()] == [None, "aten.ones.default", "aten.mul.Tensor"]


def test_deepspeed_is_said_to_be_unsimulated_and_pipelines_are_simulated():
    blocks = (BlockPlan("layers.*", ((LayerStrategy(), 2),)),)
    pipeline = Plan(devices=2, dp=1, tp=1, pp=2, micro_batch=1, global_batch=2, blocks=blocks)
    flat = Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=1, global_batch=2, blocks=blocks)
    assert "deepspeed" in unsimulated(flat, "deepspeed")
    assert unsimulated(flat, "torch") is None and unsimulated(pipeline, "torch") is None


def test_gradients_of_one_micro_batch_without_a_wrapper_are_not_held_at_the_loss():
    """Tensor parallelism on one replica (ZeRO 0, dp 1) runs no DDP: the optimizer's ``zero_grad`` leaves no
    gradient and each ``.grad`` is the one the backward makes, so with one micro-batch none is held at the loss's
    backward, the peak beside every activation (``cost.torch_memory``; the 22B row of memory_accuracy, simulated);
    with two micro-batches the first's are held through the second's, and DDP (dp 2) keeps its buckets."""
    import tensoropt
    from tensoropt.cost.model import ModelCost, estimate
    from tensoropt.cost.profile import Cluster, load_profile
    from tensoropt.models.transformer import DecoderLM, TransformerConfig
    model = DecoderLM(TransformerConfig(hidden_size=64, num_layers=4, num_attention_heads=4, ffn_hidden_size=256,
                                        seq_length=32, vocab_size=128))
    ids = torch.zeros(1, 32, dtype=torch.long)
    graph = tensoropt.capture(model, (ids, ids), cache=False).graph
    cost = ModelCost(graph, tensoropt.fold(graph), Cluster(2, 2, load_profile("h100-80gb")))

    def states(dp: int, tp: int, micro_batch: int) -> tuple[float, float]:
        m = estimate(cost, gpt_plan(dp=dp, tp=tp, micro_batch=micro_batch)).memory_breakdown
        return m["gradients_bytes"], m["parameters_bytes"]        # float32 gradients: as many bytes as the weights
    assert states(dp=1, tp=2, micro_batch=8)[0] == 0                                       # one micro-batch
    assert states(dp=1, tp=2, micro_batch=4)[0] == states(dp=1, tp=2, micro_batch=4)[1] > 0     # two
    assert states(dp=2, tp=1, micro_batch=4)[0] == states(dp=2, tp=1, micro_batch=4)[1] > 0     # DDP's buckets


def test_check_memory_needs_dry_run(tmp_path):
    result = tensoropt_cli("launch", GPT_SCRIPT, "--device", "cpu", "--gpus", 2, "--check-memory", cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --check-memory simulates the plan instead of running it: add --dry-run")


def _plan(*, dp=2, micro_batch=None, **change) -> Plan:
    """A plan for examples/train_gpt.py's model on 2 devices: by default 4 copies and a global batch of 8 in two
    micro-batches per rank (gradient accumulation exercised)."""
    return gpt_plan(dp=dp, micro_batch=micro_batch or 8 // dp // 2, **change)


CASES = {
    "ddp": dict(zero=0),
    "fsdp-zero1-bf16-mixed": dict(zero=1, precision="bf16-mixed"),
    "fsdp-zero3-full-recompute": dict(zero=3, recompute="full"),
    "tp2": dict(dp=1, tp=2),
    "tp2-sp-selective": dict(dp=1, tp=2, sp=True, recompute="selective"),
    # run as tests/test_precision.py's bf16-mixed ZeRO 3 run (2 copies, one micro-batch). Until issue 19 part 5 the
    # simulation held 104,448 bytes (6.1%) less than the real run (1,608,184 vs 1,712,632; 4.8% with 4 copies in 2
    # micro-batches), a strict xfail; it has agreed within 2% since the tracker's fixes of that change (which one
    # closed it was not isolated)
    "fsdp-zero3-bf16-mixed": dict(zero=3, precision="bf16-mixed", layers=2, micro_batch=4),
    # bf16 gradients (tests/test_precision.py's run: 2 copies, two micro-batches of 2): whole bf16 gradients held
    # from the first micro-batch's backward on, a bf16 reduce-scatter after the last
    "fsdp-zero1-bf16-gradients": dict(zero=1, precision="bf16-mixed", grad_dtype="bfloat16", layers=2, micro_batch=2),
}
GAPS: dict[str, str] = {}            # case: why it is a strict xfail
# case: (bytes the real run may hold beyond the simulated peak, why). Seen, not explained yet: under load (CI at load
# ~3, or three busy loops beside it) the real ZeRO 3 bf16-mixed run peaked at 1,712,632 B, at rest 1,612,792 B, the
# simulation 1,608,184 B; 99,840 B more is about one unit's float32 gradient (FSDP2's reduce-scatter input, which
# gloo's asynchronous work holds until its thread is done: a timing the fake process group does not have). The
# prediction, 1,975,552 B, bounds both.
# cases whose prediction is held to the simulated peak here too (the others' are in benchmarks/memory_accuracy.py)
PRICED = {"fsdp-zero1-bf16-gradients": "bf16 gradients: 2 bytes per parameter held whole, as cost.states prices"}
TIMING: dict[str, tuple[int, str]] = {
    "fsdp-zero3-bf16-mixed": (100_000, "one more float32 gradient buffer alive at the peak under load")}


def _simulated(tmp_path, common: list, rank: int) -> dict:
    """``launch --dry-run --check-memory`` of examples/train_gpt.py for ``rank`` (``TENSOROPT_SIMULATE_RANK``)."""
    run_dir = tmp_path / f"sim-{rank}"
    result = tensoropt_cli("launch", GPT_SCRIPT, *common, "--run-dir", run_dir, "--dry-run", "--check-memory",
                           cwd=LAUNCH_CWD, env=ENV | {"TENSOROPT_SIMULATE_RANK": str(rank)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"rank {rank}'s second step simulated" in result.stdout and "simulated / predicted" in result.stdout
    check = json.loads((run_dir / "memory_check.json").read_text())
    assert check["simulated"]["simulated"] is True and check["simulated"]["rank"] == rank
    return check


def _check_against_real_run(tmp_path, plan: Plan, ranks: tuple[int, ...] = (0,)) -> list[tuple[dict, dict]]:
    """[(simulated, measured)] of each of ``ranks``' second step of ``plan`` on examples/train_gpt.py: simulated by
    ``launch --dry-run --check-memory``, measured in one real 2-worker run tracked by ``TENSOROPT_MEMORY_OUT``."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    common = ["--device", "cpu", "--gpus", plan.devices, "--plan", path, "--precision", plan.precision]
    checks = [_simulated(tmp_path, common, rank) for rank in ranks]
    assert all(check["plan"] == plan.summary() for check in checks)
    real = tensoropt_cli("launch", GPT_SCRIPT, *common, "--run-dir", tmp_path / "run", "--", "--steps", 3,
                         cwd=LAUNCH_CWD, env=ENV | {"TENSOROPT_MEMORY_OUT": str(tmp_path / "real-{rank}.json")})
    assert real.returncode == 0, real.stderr[-3000:]
    out = []
    for rank, check in zip(ranks, checks):
        measured = json.loads((tmp_path / f"real-{rank}.json").read_text())
        assert measured["simulated"] is False and measured["peak_bytes"] > 0
        out.append((check["simulated"], measured))
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_simulated_pipeline_stages_equal_the_real_run(tmp_path):
    """Both ranks of two pipeline ranks in interleaved 1F1B (two virtual stages each, 4 micro-batches of 2; the
    first stage of each fully recomputed): rank 0 holds stages 0 and 2 (the embedding, the most micro-batches in
    flight), rank 1 stages 1 and 3 (the head and the loss). Run by the engine's executor on a fake process group,
    each rank's stages hold what the real run's hold (the same bytes in every category here; asserted within 2%,
    and the activations and temporaries, where the schedule's messages are, within 2% each). Twice the
    micro-batches (8) hold no more on either rank than the step's own inputs, the 4 more micro-batches of token ids
    and labels (1 KiB each, alive for the whole step): the executor keeps no buffer per micro-batch (torch's own
    stages held (2v - 1) m messages: 4 x 3 x 16 KiB more on each rank here)."""
    blocks = (BlockPlan("layers.*", ((LayerStrategy("full"), 1), (LayerStrategy("none"), 1))),)
    plan = Plan(devices=2, dp=1, tp=1, pp=2, virtual_stages=2, micro_batch=2, global_batch=8, precision="32-true",
                blocks=blocks)
    pairs = _check_against_real_run(tmp_path, plan, ranks=(0, 1))
    for simulated, measured in pairs:
        for key in ("peak_bytes", "activations", "temporaries"):
            assert simulated[key] == pytest.approx(measured[key], rel=RELATIVE), (measured["rank"], key)
        assert simulated["optimizer"] == measured["optimizer"]
    more = dataclasses.replace(plan, global_batch=16)
    path = tmp_path / "more" / "plan.json"
    path.parent.mkdir()
    path.write_text(json.dumps(more.to_json()))
    common = ["--device", "cpu", "--gpus", 2, "--plan", path, "--precision", more.precision]
    inputs_bytes = 4 * 2 * (2 * 32 * 8)           # 4 micro-batches of 2 samples: int64 ids and labels of 32 tokens
    for rank, (simulated, _) in enumerate(pairs):
        more_peak = _simulated(path.parent, common, rank)["simulated"]["peak_bytes"]
        assert simulated["peak_bytes"] <= more_peak <= simulated["peak_bytes"] + inputs_bytes, rank


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=GAPS[c])) if c in GAPS
                                  else c for c in CASES])
def test_simulated_peak_equals_the_real_runs(tmp_path, case):
    """The simulated peak of rank 0's second step is within 2% of the real run's (same tracker), and the
    optimizer states at the peak are the same bytes; the launcher prints both beside the prediction."""
    plan = _plan(**CASES[case])
    script_args = ("--layers", str(CASES[case]["layers"])) if "layers" in CASES[case] else ()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    result = tensoropt_cli("launch", GPT_SCRIPT, "--device", "cpu", "--gpus", 2, "--plan", path, "--precision",
                           plan.precision, "--run-dir", tmp_path / "sim", "--dry-run", "--check-memory", "--",
                           *script_args, cwd=LAUNCH_CWD)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "simulated / predicted" in result.stdout
    check = json.loads((tmp_path / "sim" / "memory_check.json").read_text())
    assert check["plan"] == plan.summary() and check["simulated"]["simulated"] is True
    # the largest tensors at the simulated peak, named (largest first) and printed
    largest = [t["bytes"] for t in check["largest_at_peak"]]
    assert largest == sorted(largest, reverse=True) and 0 < sum(largest) <= check["simulated"]["peak_bytes"]
    assert "largest tensors at the peak" in result.stdout
    measured = launched_once(plan, tmp_path, GPT_SCRIPT, *script_args)["memory"]
    simulated = check["simulated"]
    assert measured["simulated"] is False and measured["peak_bytes"] > 0
    extra, why = TIMING.get(case, (0, ""))
    low, high = simulated["peak_bytes"] * (1 - RELATIVE), simulated["peak_bytes"] * (1 + RELATIVE) + extra
    assert low <= measured["peak_bytes"] <= high, (simulated["peak_bytes"], measured["peak_bytes"], why)
    assert simulated["optimizer"] == measured["optimizer"]
    if case in PRICED:          # the cost model's tensor bytes for the plan, against the rank's simulated peak
        assert check["predicted"]["tensor_bytes"] == pytest.approx(simulated["peak_bytes"], rel=RELATIVE), PRICED[case]
