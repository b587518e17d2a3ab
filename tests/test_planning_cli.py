"""frontier / estimate / show: the JSON contracts, queries on saved frontiers, one-line errors."""

import json

import pytest
from click.testing import CliRunner

from tensoropt.cli import cli

GPT = {"family": "gpt", "hidden_size": 128, "num_layers": 6, "num_attention_heads": 8,
       "ffn_hidden_size": 512, "seq_length": 128, "vocab_size": 512}


@pytest.fixture
def model(write_json):
    return write_json("gpt6.json", GPT)


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def frontier_json(model, *extra):
    code, out = run("frontier", "--model", model, "--gpus", 8, "--gpus-per-node", 4, "--global-batch", 32, "--json",
                    *extra)
    return code, out


def test_frontier_json_contract_and_order(model):
    code, out = frontier_json(model)
    assert code == 0, out
    report = json.loads(out)
    assert {"model", "devices", "search_seconds", "capture_seconds", "folding", "points", "chosen"} <= set(report)
    assert report["chosen"] is None and report["devices"] == [8]
    points = report["points"]
    assert len(points) > 3
    times = [p["iteration_time_s"] for p in points]
    mems = [p["peak_memory_bytes"] for p in points]
    assert times == sorted(times) and mems == sorted(mems, reverse=True)      # non-dominated, fastest first
    plan = points[0]["plan"]
    assert plan["dp"] * plan["tp"] * plan["pp"] == 8 and {"zero", "micro_batch", "blocks"} <= set(plan)


def test_mem_picks_the_fastest_plan_that_fits_and_a_saved_frontier_answers_alone(model, tmp_path):
    code, out = frontier_json(model, "--out", tmp_path / "f.json")
    points = json.loads(out)["points"]
    budget = points[len(points) // 2]["peak_memory_bytes"]
    code, out = run("frontier", "--load", tmp_path / "f.json", "--mem", f"{budget}B", "--json")
    assert code == 0
    chosen = json.loads(out)["chosen"]
    assert chosen["peak_memory_bytes"] <= budget
    assert chosen["iteration_time_s"] == min(p["iteration_time_s"] for p in points if p["peak_memory_bytes"] <= budget)
    code, out = run("frontier", "--load", tmp_path / "f.json", "--mem", "1KiB")
    least = min(p["peak_memory_bytes"] for p in points)
    assert code == 1 and "no plan fits in 1 KiB" in out and "least memory any plan needs" in out
    assert out.strip().splitlines()[-1].startswith("error:")
    code, out = run("show", tmp_path / "f.json", "--plot", tmp_path / "f.png")
    assert code == 0 and "frontier points" in out and (tmp_path / "f.png").stat().st_size > 1000
    assert least > 0


def test_gpus_list_spans_device_counts(model, tmp_path):
    code, out = run("frontier", "--model", model, "--gpus", "2,4,8", "--gpus-per-node", 4, "--global-batch", 32,
                    "--json", "--plot", tmp_path / "p.png")
    assert code == 0
    report = json.loads(out)
    assert report["devices"] == [2, 4, 8]
    assert {p["devices"] for p in report["points"]} >= {8} and all("devices" in p for p in report["points"])
    assert (tmp_path / "p.png").exists()


def test_estimate_json_contract(model):
    code, out = run("estimate", "--model", model, "--gpus", 8, "--gpus-per-node", 4, "--tp", 2, "--pp", 2,
                    "--global-batch", 32, "--micro-batch", 2, "--recompute", "selective", "--sequence-parallel",
                    "--zero", 1, "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["iteration_time_s"] > 0 and report["peak_memory_bytes"] > 0
    assert set(report["memory_breakdown"]) == {"parameters_bytes", "gradients_bytes", "optimizer_bytes",
                                               "activations_bytes", "other_bytes"}
    assert sum(report["memory_breakdown"].values()) == pytest.approx(report["peak_memory_bytes"], abs=8)
    assert report["plan"]["dp"] == 2 and isinstance(report["time_breakdown"], dict)


def test_estimate_prices_the_precision_it_is_told(model):
    """--dtype and --master-weights/--no-master-weights price the states they describe (on no engine), as before
    precisions were named; with neither, the plan is priced as launch runs it (next test)."""
    def est(*precision):
        code, out = run("estimate", "--model", model, "--gpus", 1, "--tp", 1, "--pp", 1, "--global-batch", 4,
                        "--micro-batch", 4, "--json", *precision)
        assert code == 0, out
        return json.loads(out)
    mixed, pure, fp32 = est("--master-weights"), est("--no-master-weights"), est("--dtype", "fp32")
    params = mixed["memory_breakdown"]["parameters_bytes"] / 2                      # bf16 weights: 2 bytes each
    assert mixed["memory_breakdown"]["optimizer_bytes"] == pytest.approx(12 * params)
    assert pure["memory_breakdown"]["optimizer_bytes"] == pytest.approx(4 * params)
    assert fp32["memory_breakdown"]["parameters_bytes"] == pytest.approx(4 * params)
    assert fp32["memory_breakdown"]["optimizer_bytes"] == pytest.approx(8 * params)
    assert (mixed["plan"]["master_weights"], pure["plan"]["master_weights"]) == (True, False)
    assert fp32["plan"]["dtype"] == "float32" and "float32 weights" in fp32["precision"]
    assert "mixed precision" in mixed["precision"] and "no master copy" in pure["precision"]
    # float32 is captured in float32: its activations take twice the bf16 ones (the masks stay 1 byte)
    ratio = fp32["memory_breakdown"]["activations_bytes"] / mixed["memory_breakdown"]["activations_bytes"]
    assert 1.7 < ratio <= 2.0
    assert fp32["iteration_time_s"] > mixed["iteration_time_s"]                     # float32 peak is lower
    assert (mixed["engine"], pure["engine"], fp32["engine"]) == (None, None, None)


def test_estimate_prices_by_default_what_launch_runs(model):
    """With no precision flag, a plan is priced in launch's default precision (bf16-mixed) on the engine launch
    chooses for it (torch where it runs it, else DeepSpeed), the model captured as the launcher captures it: equal to
    --precision bf16-mixed --engine E; DeepSpeed runs the offloading plan."""
    def est(*extra, zero=1):      # 2 micro-batches: the first's gradients are held through the second's backward
        code, out = run("estimate", "--model", model, "--gpus", 2, "--tp", 1, "--pp", 1, "--global-batch", 8,
                        "--micro-batch", 2, "--zero", zero, "--json", *extra)
        assert code == 0, out
        return json.loads(out)
    default = est()
    assert default["engine"] == "torch" and default["plan"]["precision"] == "bf16-mixed"
    assert default == est("--precision", "bf16-mixed", "--engine", "torch")
    params = default["memory_breakdown"]["parameters_bytes"] / 2                   # FSDP2's gathered bf16 weights
    assert default["memory_breakdown"]["gradients_bytes"] == pytest.approx(4 * params)   # float32, whole (ZeRO 1)
    lean = est("--grad-dtype", "bf16")
    assert lean["plan"]["grad_dtype"] == "bfloat16" and "grad:bf16" in lean["plan"]["summary"]
    assert lean["memory_breakdown"]["gradients_bytes"] == pytest.approx(2 * params)      # bf16, whole
    assert lean["time_breakdown"]["data_parallel_comm_s"] < default["time_breakdown"]["data_parallel_comm_s"]
    offloaded = est("--offload")
    assert offloaded["engine"] == "deepspeed" and offloaded["plan"]["master_weights"] is True
    code, out = run("estimate", "--model", model, "--gpus", 2, "--tp", 1, "--pp", 1, "--global-batch", 4, "--zero",
                    1, "--offload", "--grad-dtype", "fp32")
    assert code == 1 and "the deepspeed engine reduces this plan's gradients in bf16" in out and \
        out.count("\n") == 1, out


def test_recomputation_trades_time_for_memory_in_estimates(model):
    def est(recompute):
        code, out = run("estimate", "--model", model, "--gpus", 1, "--tp", 1, "--pp", 1, "--global-batch", 4,
                        "--micro-batch", 4, "--recompute", recompute, "--json")
        assert code == 0, out
        return json.loads(out)
    none, full = est("none"), est("full")
    assert full["iteration_time_s"] > none["iteration_time_s"]
    assert full["memory_breakdown"]["activations_bytes"] < none["memory_breakdown"]["activations_bytes"] / 3


BAD = {
    "tp does not divide": (["--tp", 3, "--pp", 1], "--tp 3 x --pp 1 must divide --gpus 8"),
    "pp does not divide layers": (["--tp", 1, "--pp", 4], "--pp 4 must divide the 6 repeated layers"),
    "offload without zero": (["--tp", 1, "--pp", 1, "--offload"], "--offload moves ZeRO's optimizer partitions"),
    "unknown profile": (["--tp", 1, "--pp", 1, "--device", "tpu-v9"], "unknown device profile 'tpu-v9'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_estimate_bad_operands_are_one_line(model, case):
    extra, expected = BAD[case]
    args = ["estimate", "--model", model, "--gpus", 8, "--gpus-per-node", 4, "--global-batch", 32, *extra]
    code, out = run(*args)
    assert code == 1 and expected in out and out.count("\n") == 1, out


def test_frontier_bad_input(model, tmp_path):
    (tmp_path / "broken.json").write_text("{\"kind\": \"tensoropt.frontier\"")
    cases = [(["--model", model, "--gpus", 8, "--mem", "40.5"], "give a size with a unit"),
             (["--model", model, "--gpus", "8-2"], "--gpus '8-2'"),
             (["--load", tmp_path / "broken.json"], "not a readable frontier file"),
             (["--gpus", 8], "give --model and --gpus, or --load")]
    for args, expected in cases:
        code, out = run("frontier", *args)
        assert code == 1 and expected in out and out.count("\n") == 1, out


def test_a_plain_integer_is_a_byte_count(model, tmp_path):
    """--mem 45936257537 is bytes, as in DeepSpeed configs and torch; a fraction still needs a unit."""
    from tensoropt.units import parse_bytes
    assert parse_bytes("45936257537") == parse_bytes("45936257537B") == 45936257537
    assert parse_bytes(" 1024 ") == parse_bytes("1KiB") and parse_bytes(512, "mem_per_gpu") == 512
    code, out = frontier_json(model, "--out", tmp_path / "f.json")
    points = json.loads(out)["points"]
    budget = int(points[len(points) // 2]["peak_memory_bytes"])
    chosen = [json.loads(run("frontier", "--load", tmp_path / "f.json", "--mem", mem, "--json")[1])["chosen"]
              for mem in (str(budget), f"{budget}B")]
    assert chosen[0] == chosen[1] and chosen[0]["peak_memory_bytes"] <= budget


def test_no_plan_for_the_global_batch_is_one_line():
    # Wide-ResNet has no tensor-parallel branch and several blocks (no pipeline): only dp = 8 runs
    code, out = run("frontier", "--model", "wide-resnet50-2", "--gpus", 8, "--global-batch", 3)
    assert code == 1 and "no plan runs wide-resnet50-2 on [8] devices with --global-batch 3" in out
    code, out = run("frontier", "--model", "wide-resnet50-2", "--gpus", 8, "--global-batch", 64, "--json")
    points = json.loads(out)["points"]
    assert code == 0 and all(p["tokens_per_s"] is None and p["plan"]["tp"] == 1 for p in points)


def test_frontier_lists_only_plans_the_device_can_hold(model, tmp_path):
    from tensoropt.cost.profile import PROFILES_DIR
    data = json.loads((PROFILES_DIR / "h100-80gb.json").read_text())
    code, out = frontier_json(model)
    largest = max(p["peak_memory_bytes"] for p in json.loads(out)["points"])
    smallest = min(p["peak_memory_bytes"] for p in json.loads(out)["points"])
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**data, "name": "small", "memory_bytes": int((largest + smallest) / 2)}))
    code, out = frontier_json(model, "--device", small)
    kept = json.loads(out)["points"]
    assert code == 0 and kept and all(p["peak_memory_bytes"] <= (largest + smallest) / 2 for p in kept)
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({**data, "name": "tiny", "memory_bytes": 1024}))
    code, out = frontier_json(model, "--device", tiny)
    assert code == 1 and "fits the device's 1 KiB; the least memory any plan needs is" in out


def test_estimate_prices_the_kernels_it_is_told(model):
    def est(*kernels):
        code, out = run("estimate", "--model", model, "--gpus", 1, "--tp", 1, "--pp", 1, "--global-batch", 4,
                        "--micro-batch", 4, "--json", *kernels)
        assert code == 0, out
        return json.loads(out)
    eager, default, compiled = est("--eager"), est(), est("--compile")
    assert eager == default and eager["plan"]["compile"] is False and compiled["plan"]["compile"] is True
    # fused memory-bound chains move fewer bytes: the compiled plan's forward + backward is faster
    assert compiled["time_breakdown"]["forward_backward_s"] < eager["time_breakdown"]["forward_backward_s"]


def test_estimate_prices_the_engine_it_is_told(model):
    """``--engine deepspeed`` adds DeepSpeed's own buffers (ZeRO 1: the reduce bucket of every bf16 gradient, and
    more) to the same states (described by hand: --master-weights); ``--engine torch`` prices as no engine does; a
    plan DeepSpeed cannot run is one line."""
    def est(*engine, tp=1):
        code, out = run("estimate", "--model", model, "--gpus", 2, "--tp", tp, "--pp", 1, "--global-batch", 4,
                        "--micro-batch", 2, "--zero", 1, "--json", "--master-weights", *engine)
        return code, out
    reports = {}
    for engine in ("", "torch", "deepspeed"):
        code, out = est(*(["--engine", engine] if engine else []))
        assert code == 0, out
        reports[engine] = json.loads(out)
    plain, torch_, deepspeed = (reports[e]["memory_breakdown"] for e in ("", "torch", "deepspeed"))
    assert torch_ == plain and reports["torch"]["plan"]["engine"] == "torch"
    assert reports["deepspeed"]["plan"]["engine"] == "deepspeed" and "engine" not in reports[""]["plan"]
    # the same states; the gradients and activations at the peak are each engine's moment's (one micro-batch: the
    # torch engine's FSDP2 makes gradients during the backward, cost.torch_memory)
    assert all(deepspeed[k] == plain[k] for k in ("parameters_bytes", "optimizer_bytes"))
    params = plain["parameters_bytes"] / 2                                           # bf16 weights
    # the bf16 reduce bucket at least, beyond what the torch engine holds at the same (lean) loss's forward: FSDP2's
    # last gathered unit, one layer's bf16 weights (under params / layers elements: the embedding is in params too)
    assert deepspeed["other_bytes"] - plain["other_bytes"] >= 2 * params - 2 * params / GPT["num_layers"]
    code, out = est("--engine", "deepspeed", tp=2)
    assert code == 1 and "the deepspeed engine does not run tensor parallelism" in out and out.count("\n") == 1, out


def test_estimate_prices_offload_and_zero_3_stages(model):
    """``--offload`` keeps no optimizer state on the device (DeepSpeed runs it; the torch engine refuses it in one
    line), and ZeRO 3 pipeline stages, which the torch engine runs and the search offers, shard the stage's states
    over dp (refused until now, as DeepSpeed's pipelines refuse ZeRO 2/3)."""
    def est(*extra, pp=1, zero=3):
        return run("estimate", "--model", model, "--gpus", 2 * pp, "--tp", 1, "--pp", pp, "--global-batch", 4,
                   "--micro-batch", 1, "--zero", zero, "--precision", "bf16-mixed", "--json", *extra)
    kept, offloaded = (json.loads(est("--engine", "deepspeed", *flag)[1]) for flag in ((), ("--offload",)))
    assert kept["memory_breakdown"]["optimizer_bytes"] > 0 and offloaded["memory_breakdown"]["optimizer_bytes"] == 0
    assert offloaded["plan"]["offload"] and offloaded["peak_memory_bytes"] < kept["peak_memory_bytes"]
    code, out = est("--engine", "torch", "--offload")
    assert code == 1 and "the torch engine does not run optimizer offload" in out and out.count("\n") == 1, out
    staged = {zero: json.loads(est(pp=2, zero=zero)[1]) for zero in (0, 3)}
    assert staged[3]["plan"]["zero"] == 3 and staged[3]["plan"]["pp"] == 2
    assert staged[3]["memory_breakdown"]["optimizer_bytes"] == staged[0]["memory_breakdown"]["optimizer_bytes"] / 2
