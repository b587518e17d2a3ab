"""Models built on the meta device, launched: the initialisation a meta-built model gets under each plan (real
2-worker CPU runs whose workers shard the meta model and materialise only their part), against the script run
alone with the model built for real; and the launcher's capture of a 70B-parameter script, which must never
allocate its weights. Meta-built models training to the losses of the script alone: tests/test_selective.py."""

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import EXAMPLES, LAUNCH_CWD
from workers import ENV, dry_run_plan, tensoropt_cli

from tensoropt.cost.profile import load_profile
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

pytestmark = [pytest.mark.slow]   # the tests that start workers share the "multiprocess" xdist group
LARGE = str(EXAMPLES / "train_llama_large.py")
INIT_SCRIPT = str(Path(__file__).parent / "init_parity.py")


def _blocks(recompute: str, copies: int) -> tuple[BlockPlan, ...]:
    return (BlockPlan("layers.*", ((LayerStrategy(recompute), copies),)),)


# A meta-built GPT trains under DDP, FSDP2 ZeRO 3, tp2, a 2-stage pipeline and DeepSpeed ZeRO 3 to the losses of the
# script alone: tests/test_selective.py::test_selective_plans_train_to_the_losses_of_the_script_alone launches its
# selective plans of those five layouts with --meta (one run asserts both), checking the workers' device as here.


INIT_PLANS = {   # name: changes to the 2-worker plan of init_parity.py (global batch 4)
    "ddp": dict(dp=2, tp=1, pp=1, zero=0, micro_batch=2, tp_branches=(), blocks=_blocks("none", 4)),
    "deepspeed-zero3": dict(dp=2, tp=1, pp=1, zero=3, micro_batch=2, tp_branches=(), blocks=_blocks("none", 4)),
    "fsdp2-zero3": dict(dp=2, tp=1, pp=1, zero=3, micro_batch=2, tp_branches=(), blocks=_blocks("full", 4)),
    "tp2": dict(dp=1, tp=2, pp=1, zero=0, micro_batch=4, tp_branches=("attn", "mlp"), blocks=_blocks("none", 4)),
    "pipeline2": dict(dp=1, tp=1, pp=2, zero=0, micro_batch=2, tp_branches=(), blocks=_blocks("none", 2)),
}


@pytest.fixture(scope="module")
def init_plan(tmp_path_factory):
    return dry_run_plan(INIT_SCRIPT, tmp_path_factory.mktemp("init-dry"))


@pytest.fixture(scope="module")
def init_reference(tmp_path_factory) -> Path:
    """init_parity.py run alone with its models built for real, then ``model.apply(init_fn)``."""
    out = tmp_path_factory.mktemp("init-alone") / "ref"
    subprocess.run([sys.executable, INIT_SCRIPT, "--out", out], check=True, env=ENV, capture_output=True, timeout=300)
    return out


@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("name", INIT_PLANS)
def test_meta_built_models_get_the_values_of_apply_on_the_models_built_for_real(init_plan, init_reference, tmp_path,
                                                                                name):
    """Both of init_parity.py's initialisations (GPT-2's parent-scaled c_proj, a whole-model init_weights()
    from the root) on each rank of each plan: every parameter a rank holds, gathered, equals the script run
    alone with the model built for real, exactly, and so does the buffer the whole-model init replaces; together
    the ranks hold them all (a pipeline stage holds its own). Where a rank does not hold every tensor whole, the
    whole-model init works on a full-size copy, said in one line on rank 0."""
    plan = dataclasses.replace(init_plan, virtual_stages=1, offload=False, **INIT_PLANS[name])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    engine = "deepspeed" if name.startswith("deepspeed") else "torch"
    result = tensoropt_cli("launch", INIT_SCRIPT, "--device", "cpu", "--gpus", 2, "--plan", path, "--engine", engine,
                           "--run-dir", tmp_path / "run", "--", "--meta", "--out", tmp_path / "got", cwd=LAUNCH_CWD)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "tensoropt: init_fn(" in line]
    if name == "ddp":
        assert said == []                         # each rank holds every tensor whole: computed in place
    else:
        assert len(said) == 1 and said[0].endswith("more than one block copy of the plan (0.2 MiB)"), said
    for init in ("gpt2", "titan"):
        expected = dict(np.load(f"{init_reference}.{init}.0.npz"))
        held = set()
        for rank in (0, 1):
            got = dict(np.load(tmp_path / f"got.{init}.{rank}.npz"))
            assert got.keys() <= expected.keys()
            for key, value in got.items():
                np.testing.assert_array_equal(value, expected[key], err_msg=f"{init} rank {rank} {key}")
            held |= got.keys()
        assert held == expected.keys(), (init, sorted(expected.keys() - held))


CAPTURE = textwrap.dedent("""
    import json, resource, sys, time
    from launcher.capture import run_capture
    start = time.perf_counter()
    graph = run_capture(sys.argv[1], sys.argv[2:], timeout_s=600)
    print(json.dumps({"seconds": time.perf_counter() - start, "parameters": graph.num_parameters,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
""")


# cold: a warm-started capture would be forked by the suite's warm-start server (tests/conftest.py), and the fresh
# process would measure the stub that waits for it, not the capture
@pytest.mark.warm_start("cold")
@pytest.mark.parametrize("build", [[], ["--no-meta"]], ids=["meta_init", "built-for-real"])
def test_capturing_a_70b_script_allocates_no_weights(tmp_path, build):
    """The capture run alone (a fresh process measures its only child): far under 2 GB, whether the script builds
    on meta or not (capture puts every tensor on meta). How long it takes is no assertion (a loaded machine took
    39 s): the README's figures are measured."""
    result = subprocess.run([sys.executable, "-c", CAPTURE, LARGE, *build], capture_output=True, text=True,
                            cwd=tmp_path, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout)
    assert measured["parameters"] == 68_976_648_192                  # LLaMA-2 70B
    assert measured["peak_rss_bytes"] < 2 * 2**30, measured


def test_dry_run_plans_the_70b_script_for_gpus_this_machine_lacks(tmp_path):
    result = tensoropt_cli("launch", LARGE, "--device", "cuda", "--gpus", 8, "--nnodes", 8, "--dry-run", "--run-dir",
                           tmp_path / "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "devices: 64 x cuda (80.0 GiB each), profile h100-80gb" in result.stdout
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert written["device"] == "cuda" and written["devices"] == 64
    assert Plan.from_json(written).devices == 64
    assert written["predicted"]["peak_memory_bytes"] <= load_profile("h100-80gb").memory_bytes
