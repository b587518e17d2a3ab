"""Limits on the search space (--tp, --max-tp, --pp, --zero, --no-offload, --recompute, --grad-dtype) of `frontier`
and `launch`: every plan returned respects them, and bad values or limits no plan survives are one line."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import EXAMPLES

from tensoropt.cli import cli
from tensoropt.search.ft import SearchSpace
from tensoropt.search.limits import Limits

GPT = {"family": "gpt", "hidden_size": 128, "num_layers": 6, "num_attention_heads": 8,
       "ffn_hidden_size": 512, "seq_length": 128, "vocab_size": 512}
SCRIPT = EXAMPLES / "train_gpt.py"


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def recomputes(plan: dict) -> set[str]:
    return {s["recompute"] for b in plan["blocks"] for s in b["strategies"]}


# (flags, what every returned plan must satisfy)
CASES = [
    (["--tp", "1"], lambda p: p["tp"] == 1),
    (["--tp", "2,4"], lambda p: p["tp"] in (2, 4)),
    (["--max-tp", "2"], lambda p: p["tp"] <= 2),
    (["--pp", "2"], lambda p: p["pp"] == 2),
    (["--zero", "0,1"], lambda p: p["zero"] in (0, 1)),
    (["--no-offload"], lambda p: not p["offload"]),
    (["--recompute", "none,full"], lambda p: recomputes(p) <= {"none", "full"}),
    (["--tp", "1", "--zero", "3", "--no-offload"], lambda p: (p["tp"], p["zero"], p["offload"]) == (1, 3, False)),
    (["--grad-dtype", "fp32"], lambda p: "grad_dtype" not in p and p["engine"] != "deepspeed"),
    # DeepSpeed's bf16 mode reduces bf16 gradients as its own layout (no grad_dtype named)
    (["--grad-dtype", "bf16"], lambda p: p.get("grad_dtype") == "bfloat16" or p["engine"] == "deepspeed"),
]
# the frontier of what the engines run has no offloading plan for this small model (DeepSpeed's, at tp 1 without
# pipeline stages, saves less than the runtime's fixed overhead costs it in time): --no-offload excludes nothing there,
# and is checked by the launcher's min-memory cases below. Without --grad-dtype every plan keeps its precision's own
# gradients (float32 under FSDP2, and no DeepSpeed plan is on this frontier): --grad-dtype fp32 excludes nothing
# either, its bf16 twin excludes all (it opts in to bf16 gradients, which replace the float32 ones)
EXCLUDES_NOTHING = {"--no-offload", "--grad-dtype fp32"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("limits") / "gpt6.json"
    path.write_text(json.dumps(GPT))
    return path


def frontier(model, *flags):
    code, out = run("frontier", "--model", model, "--gpus", 8, "--gpus-per-node", 4, "--global-batch", 32, "--json",
                    *flags)
    return code, out


def test_the_unlimited_frontier_breaks_every_limit(model):
    """So that each case below checks something: its limit excludes part of the unlimited frontier."""
    code, out = frontier(model)
    plans = [p["plan"] for p in json.loads(out)["points"]]
    assert code == 0
    assert all(not all(check(p) for p in plans) for flags, check in CASES if " ".join(flags) not in EXCLUDES_NOTHING)


@pytest.mark.parametrize("flags, check", CASES, ids=[" ".join(f) for f, _ in CASES])
def test_frontier_returns_only_plans_within_the_limits(model, flags, check):
    code, out = frontier(model, *flags)
    assert code == 0, out
    plans = [p["plan"] for p in json.loads(out)["points"]]
    assert plans and all(check(p) for p in plans)


def test_the_limits_search_a_narrower_space_not_filter_a_frontier(model):
    # the unlimited frontier has no pipeline plan here (see the case above): --pp 2 finds its own front
    code, out = frontier(model, "--pp", "2")
    assert code == 0 and len(json.loads(out)["points"]) > 1


@pytest.mark.parametrize("flags, expected", [
    (["--tp", "0"], "--tp '0': give positive integers, e.g. 1 or 2,4"),
    (["--tp", "two"], "--tp 'two': give positive integers"),
    (["--max-tp", "2,4"], "--max-tp '2,4': give one positive integer"),
    (["--pp", "-1"], "--pp '-1': give positive integers"),
    (["--zero", "4"], "--zero '4': give ZeRO stages 0-3"),
    (["--recompute", "some"], "--recompute 'some': give strategies among none, selective, full"),
    (["--tp", "0", "--zero", "9"], "--tp '0': give positive integers, e.g. 1 or 2,4; --zero '9'"),
    (["--grad-dtype", "fp16"], "--grad-dtype 'fp16': give dtypes among fp32, bf16, e.g. fp32"),
    (["--tp", "3"], "no plan for "),                                 # 3 divides neither 4 per node nor 8 heads
    # 32-true reduces float32 gradients in every engine
    (["--precision", "32-true", "--grad-dtype", "bf16"], "respects --grad-dtype bf16 with --global-batch 32"),
    (["--pp", "4"], "respects --pp 4 with --global-batch 32: relax the limits"),   # 4 does not divide 6 layers
])
def test_bad_limits_and_limits_no_plan_survives_are_one_line(model, flags, expected):
    code, out = frontier(model, *flags)
    assert code == 1 and expected in out and out.count("\n") == 1 and out.startswith("error: "), out


def test_a_saved_frontier_takes_no_limits(model, tmp_path):
    code, _ = frontier(model, "--out", tmp_path / "f.json")
    code, out = run("frontier", "--load", tmp_path / "f.json", "--tp", 1)
    assert code == 1 and "--tp 1 describe another search" in out and out.count("\n") == 1


def test_selective_recomputation_alone_leaves_no_plan_for_flash_attention(write_json):
    llama = write_json("llama.json", {"family": "llama", "hidden_size": 128, "num_layers": 2, "num_attention_heads": 4,
                                      "ffn_hidden_size": 256, "seq_length": 64, "vocab_size": 128})
    code, out = run("frontier", "--model", llama, "--gpus", 2, "--global-batch", 8, "--recompute", "selective")
    assert code == 1 and "respects --recompute selective" in out and out.count("\n") == 1


def test_limits_narrow_each_engines_part_of_the_space():
    from tensoropt.search.engines import ENGINE_SPACES
    deepspeed = SearchSpace(global_batch=8, **ENGINE_SPACES["deepspeed"])
    assert Limits(tensor_parallel=(2,)).restrict(deepspeed) is None          # DeepSpeed runs tp 1 only
    limited = Limits(tensor_parallel=(1, 2), max_tp=1, zero_stages=(0, 3), offload=False).restrict(deepspeed)
    assert (limited.tensor_parallel, limited.zero_stages, limited.offload) == ((1,), (0, 3), False)
    torch_space = SearchSpace(global_batch=8, **ENGINE_SPACES["torch"])
    assert Limits(zero_stages=(1,)).restrict(torch_space).zero_stages == (1,)  # the torch engine runs ZeRO 1 too
    assert Limits(max_tp=4).restrict(torch_space).tensor_parallel == (1, 2, 3, 4)
    assert Limits().restrict(torch_space) == torch_space and not Limits()
    assert Limits(max_tp=2, offload=False).describe() == "limited to tp <= 2, no offload"


def test_the_gradient_dtype_limit_reads_what_each_engine_reduces_in():
    """--grad-dtype limits the dtype gradients are reduced in, as each engine holds them: the torch engine's
    bf16-mixed offers float32 ("") and bf16 ("bfloat16") layouts, DeepSpeed's bf16 mode reduces bf16 as its own
    layout, 32-true reduces float32 only."""
    from tensoropt.search.engines import ENGINE_SPACES, grad_dtypes, master_weights

    def space(engine, precision):
        return SearchSpace(global_batch=8, precision=precision, master_weights=master_weights(engine, precision),
                           engine=engine, grad_dtypes=grad_dtypes(engine, precision), **ENGINE_SPACES[engine])
    fp32, bf16 = Limits(grad_dtypes=("float32",)), Limits(grad_dtypes=("bfloat16",))
    torch_mixed = space("torch", "bf16-mixed")
    assert torch_mixed.grad_dtypes == ("", "bfloat16")
    assert fp32.restrict(torch_mixed).grad_dtypes == ("",)
    lean = bf16.restrict(torch_mixed)
    assert (lean.grad_dtypes, lean.zero_stages) == (("bfloat16",), (1, 2, 3))
    assert fp32.restrict(space("deepspeed", "bf16-mixed")) is None
    assert bf16.restrict(space("deepspeed", "bf16-mixed")).grad_dtypes == ("",)
    assert bf16.restrict(space("torch", "32-true")) is None and fp32.restrict(space("torch", "32-true")) is not None
    assert bf16.describe() == "limited to gradients in bf16" and fp32.flags() == "--grad-dtype fp32"


# --- tensoropt launch: a dry run plans within the limits; the elastic re-plans keep them ---

LAUNCH_CASES = [
    (["--tp", "2"], lambda p: p["tp"] == 2),
    (["--pp", "2"], lambda p: p["pp"] == 2),
    (["--zero", "0"], lambda p: p["zero"] == 0),
    (["--zero", "2,3", "--max-tp", "1"], lambda p: p["zero"] in (2, 3) and p["tp"] == 1),
    (["--objective", "min-memory", "--no-offload"], lambda p: not p["offload"]),
    (["--objective", "min-memory", "--recompute", "none"], lambda p: recomputes(p) == {"none"}),
    (["--objective", "min-memory", "--no-offload", "--tp", "1"], lambda p: not p["offload"] and p["tp"] == 1),
    (["--grad-dtype", "fp32"], lambda p: "grad_dtype" not in p and p["engine"] == "torch"),
]


@pytest.mark.slow
@pytest.mark.parametrize("flags, check", LAUNCH_CASES, ids=[" ".join(f) for f, _ in LAUNCH_CASES])
def test_launch_dry_run_plans_within_the_limits(tmp_path, flags, check):
    """Each case's limit excludes the plan chosen without it (fastest: dp2 zero1 with bf16 gradients on torch;
    min-memory: ZeRO 3 with offload and full recomputation, or tp2 once offload is excluded)."""
    code, out = run("launch", SCRIPT, "--device", "cpu", "--gpus", 2, "--dry-run", "--run-dir", tmp_path, *flags)
    assert code == 0, out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert check(plan), plan["summary"]
    assert "limited to " in plan["predicted"]["why"] and "limited to " in out


@pytest.mark.slow
def test_launch_refuses_bad_limits_in_one_line(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    for flags, expected in [
        (["--zero", "7"], "--zero '7': give ZeRO stages 0-3"),
        (["--engine", "deepspeed", "--tp", "2"], "no plan the runtime can apply on 2 devices respects --tp 2"),
        (["--pp", "2", "--tp", "2"], "no plan the runtime can apply on 2 devices respects"),     # 4 devices needed
        (["--plan", plan, "--tp", "1"], "--plan runs the plan given; --tp 1 limit the search"),
    ]:
        code, out = run("launch", SCRIPT, "--device", "cpu", "--gpus", 2, "--dry-run", "--run-dir", tmp_path, *flags)
        assert code == 1 and expected in out and out.count("\n") == 1, out


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_elastic_plans_within_the_limits(tmp_path):
    from conftest import LAUNCH_CWD
    from workers import ENV
    result = subprocess.run(
        [sys.executable, "-m", "tensoropt", "launch", SCRIPT, "--device", "cpu", "--gpus", "2", "--elastic",
         "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", "2", "--run-dir", tmp_path / "run", "--zero", "0",
         "--", "--steps", "2"], cwd=LAUNCH_CWD, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # found anywhere in a line: the workers' block-buffered output shares the pipe and may end mid-line
    log = [line[line.index("elastic:"):] for line in result.stdout.splitlines() if "elastic:" in line]
    assert " -> dp2 tp1 pp1 mb4x1 zero0 " in log[0] and log[-1].startswith("elastic: finished")
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["zero"] == 0 and "limited to ZeRO 0" in plan["predicted"]["why"]
