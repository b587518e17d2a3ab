"""The profiler on CPU with 2 real worker processes (gloo): schema, sanity bounds, use by the
cost model, and no half-written file when interrupted."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import EXAMPLES
from workers import ctrl_c_reaches_it

from tensoropt.cost.ops import efficiency
from tensoropt.cost.profile import load_profile

pytestmark = [pytest.mark.slow]   # the tests that start workers share the "multiprocess" xdist group


def _profile(out, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tensoropt", "profile", "--device", "cpu", "--nproc", "2",
                           "--quick", "--out", str(out), *extra], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiles") / "cpu-quick.json"
    result = _profile(out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrote" in result.stdout
    return out


@pytest.mark.xdist_group("multiprocess")
def test_profile_matches_the_schema_the_cost_model_reads(quick_profile):
    profile = load_profile(str(quick_profile))
    data = json.loads(quick_profile.read_text())
    assert profile.measured and data["schema_version"] == 1
    assert {"device_name", "device_count", "torch", "date", "method", "quick"} <= set(data["metadata"])
    assert data["metadata"]["device_count"] == 2 and data["metadata"]["quick"] is True
    # measured rates: positive and finite (how fast they are depends on the CPU and its load: bf16 matmuls on a
    # loaded AVX2 core measured 0.64 GFLOP/s; a timing floor here failed a correct profile)
    rates = (profile.peak("float32"), profile.peak("bfloat16"), profile.memory_bandwidth_bytes_per_s,
             profile.intra_node.bandwidth_bytes_per_s)
    assert all(0 < r < float("inf") for r in rates), rates
    assert 0 < profile.intra_node.latency_s < float("inf") and 0 < profile.kernel_overhead_s < float("inf")
    assert all(0 < e <= 1 for _, e in profile.matmul_efficiency)


@pytest.mark.xdist_group("multiprocess")
def test_the_grouped_products_efficiency_is_its_rate_over_the_curves_at_one_groups_size(quick_profile):
    """The profile's ``grouped_matmul_efficiency`` is the measured bf16 grouped product's rate over the peak times
    the measured bf16 curve at one group's FLOPs, the very rate the cost model gives a grouped product before that
    factor (so a measured GPU prices Mixture-of-Experts products at its own grouped kernel's speed)."""
    profile = load_profile(str(quick_profile))
    (grouped,) = json.loads(quick_profile.read_text())["measurements"]["grouped_matmul"]
    assert grouped["dtype"] == "bfloat16" and grouped["flops"] == grouped["groups"] * grouped["group_flops"]
    plain = profile.peak("bfloat16") * float(efficiency(np.array([grouped["group_flops"]]), profile)[0])
    assert profile.grouped_matmul_efficiency == pytest.approx(grouped["flops_per_s"] / plain, rel=1e-12)
    assert 0 < profile.grouped_matmul_efficiency < float("inf")


@pytest.mark.xdist_group("multiprocess")
def test_the_attention_efficiency_is_each_attentions_rate_over_the_curves_at_its_forward_flops(quick_profile):
    """The profile's ``attention_efficiency`` holds, per measured causal attention (forward and backward, bf16), its
    forward FLOPs and its rate over the peak times the measured bf16 curve at those FLOPs: the rate the cost model
    gives an attention op before that factor, so a measured device prices attention at its own fused kernel's speed.
    The rate is of the work a causal kernel does: the FLOPs as the graph counts them (forward 4 b h s^2 d, backward
    twice that) times the share of tiles on and below the diagonal, as the cost model prices the op's work."""
    profile = load_profile(str(quick_profile))
    measured = json.loads(quick_profile.read_text())["measurements"]["attention"]
    assert len(measured) == 2 and all(a["dtype"] == "bfloat16" for a in measured)
    expected = []
    for a in measured:
        assert a["forward_flops"] == 4 * a["batch"] * a["heads"] * a["seq"] ** 2 * a["head_dim"]
        tiles = -(-a["seq"] // 128)
        assert a["work"] == (tiles + 1) / (2 * tiles)
        assert a["flops_per_s"] == pytest.approx(3 * a["forward_flops"] * a["work"] / a["seconds"], rel=1e-12)
        plain = profile.peak("bfloat16") * float(efficiency(np.array([a["forward_flops"]]), profile)[0])
        expected.append((a["forward_flops"], a["flops_per_s"] / plain))
    assert [f for f, _ in profile.attention_efficiency] == [f for f, _ in sorted(expected)]
    assert [e for _, e in profile.attention_efficiency] == pytest.approx([e for _, e in sorted(expected)], rel=1e-12)
    assert profile.attention_measured


@pytest.mark.xdist_group("multiprocess")
def test_measurements_grow_with_size(quick_profile):
    m = json.loads(quick_profile.read_text())["measurements"]
    for dtype in ("float32", "bfloat16"):
        times = [p["seconds"] for p in sorted(m["matmul"], key=lambda p: p["n"]) if p["dtype"] == dtype]
        assert times == sorted(times) and times[-1] > 10 * times[0]
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        runs = sorted((c for c in m["collectives"] if c["op"] == op), key=lambda c: c["bytes"])
        # 4 KiB against 16 MiB: 4096x the data, far beyond the noise of a busy 2-core machine
        assert len(runs) == 3 and runs[-1]["seconds"] > runs[0]["seconds"] > 0, op


@pytest.mark.xdist_group("multiprocess")
def test_the_planner_uses_a_measured_profile(quick_profile, write_json):
    from click.testing import CliRunner

    from tensoropt.cli import cli
    model = write_json("m.json", {"family": "gpt", "hidden_size": 1024, "num_layers": 2, "num_attention_heads": 8,
                                  "ffn_hidden_size": 4096, "seq_length": 1024, "vocab_size": 1024})
    runs = {}
    for device in (str(quick_profile), "h100-80gb"):
        result = CliRunner().invoke(cli, ["estimate", "--model", model, "--gpus", 2, "--gpus-per-node", 2, "--tp", 1,
                                          "--pp", 1, "--global-batch", 4, "--device", device, "--json"])
        assert result.exit_code == 0, result.output
        runs[device] = json.loads(result.output)
    assert runs[str(quick_profile)]["device_profile"] == "cpu-quick"
    # compute-bound: a 2-core CPU is hundreds of times slower than an H100
    assert runs[str(quick_profile)]["iteration_time_s"] > 50 * runs["h100-80gb"]["iteration_time_s"]


@pytest.mark.xdist_group("multiprocess")
def test_an_interrupted_run_writes_nothing(tmp_path):
    """Ctrl-C once the first measurement is done (its line on stderr, never a fixed delay): exit status 130,
    one line, no file."""
    out = tmp_path / "cut.json"
    proc = subprocess.Popen([sys.executable, "-m", "tensoropt", "profile", "--device", "cpu", "--nproc", "2",
                             "--quick", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=ctrl_c_reaches_it)
    first = proc.stderr.readline()
    assert first.startswith("profiling: "), first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.splitlines()[-1] == "interrupted", (proc.returncode, err[-2000:])
    assert "Traceback" not in err and all(line.startswith("profiling: ") for line in err.splitlines()[:-1])
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bad_profile_arguments_are_one_line(tmp_path):
    for extra, expected in ((["--out", str(tmp_path / "missing" / "x.json")], "does not exist"),
                            (["--out", str(tmp_path / "x.json"), "--model", "gpt5"], "unknown model 'gpt5'")):
        result = subprocess.run([sys.executable, "-m", "tensoropt", "profile", "--quick", *extra],
                                capture_output=True, text=True)
        assert result.returncode == 1 and expected in result.stderr and "Traceback" not in result.stderr


@pytest.mark.xdist_group("multiprocess")
def test_model_calibration_times_the_unique_ops_and_the_planner_uses_them(tmp_path, write_json):
    cfg = {"family": "gpt", "hidden_size": 128, "num_layers": 4, "num_attention_heads": 4,
           "ffn_hidden_size": 512, "seq_length": 128, "vocab_size": 256}
    model = write_json("calib.json", cfg)
    out = tmp_path / "calibrated.json"
    result = _profile(out, "--model", model)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    import tensoropt
    from tensoropt.cost.ops import OpArrays
    graph = tensoropt.capture(model).graph
    folded = tensoropt.fold(graph)
    unique = {op.key() for op in folded.blocks[0].ops} | {op.key() for op in folded.loose_ops}
    plain = {k for k in data["op_times"] if "@tp" not in k}
    sharded = {k for k in data["op_times"] if "@tp" in k}
    assert plain <= unique and len(plain) >= len(unique) - 2
    assert len(data["op_times"]) == data["metadata"]["op_times_measured"]
    # ops at the shapes one of 2 tensor-parallel ranks computes (at tp 4 a rank holds a single head,
    # which changes the op sequence, so those shapes are not aligned and fall back to scaling)
    assert "tp2" in {k.rsplit("@", 1)[1] for k in sharded}
    assert all(k.rsplit("@", 1)[0] in unique for k in sharded)
    assert len(unique) < len(graph.ops) / 2                                  # folded: never every layer
    profile = load_profile(str(out))
    arrays = OpArrays.of(folded.blocks[0].ops, profile)
    timed = ~np.isnan(arrays.measured_forward_s)
    assert timed.sum() >= len(folded.blocks[0].ops) - 1 and np.all(arrays.measured_forward_s[timed] > 0)


def test_each_ring_collective_gets_its_own_bandwidth_at_the_links_latency():
    from tensoropt.profiler.run import link_of
    alpha, rates = 2e-4, {"all_reduce": 1e9, "all_gather": 3e8, "reduce_scatter": 4e8, "all_to_all": 5e8}
    points = []
    for op, rate in rates.items():
        for full in (1 << 16, 1 << 20, 1 << 24):
            passes = 2 if op == "all_reduce" else 1
            seconds = passes * (0.5 * full / rate + alpha)
            # an all-gather's record gives each rank's input: half the gathered tensor on 2 ranks
            points.append({"op": op, "group_size": 2, "bytes": full // 2 if op == "all_gather" else full,
                           "seconds": seconds})
    link = link_of(points)
    assert link["bandwidth_bytes_per_s"] == pytest.approx(1e9) and link["latency_s"] == pytest.approx(alpha)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert link["collective_bandwidths_bytes_per_s"][op] == pytest.approx(rates[op])


def test_one_device_measures_no_collectives_and_launch_finds_this_machines_profile(tmp_path):
    """--nproc 1 (a single GPU's case, here on the CPU): links copied from the named datasheet profile, said
    in the metadata and the summary; without --out the profile lands where `tensoropt launch` looks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TENSOROPT_PROFILE_DIR": str(tmp_path / "store")}
    result = subprocess.run([sys.executable, "-m", "tensoropt", "profile", "--device", "cpu", "--nproc", "1",
                             "--link-profile", "h100-80gb", "--quick"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "copied from the h100-80gb profile (one device)" in result.stdout
    from tensoropt.profiler.run import device_name
    from tensoropt.profiler.store import device_slug
    (written,) = (tmp_path / "store").iterdir()
    assert written.name == f"{device_slug(device_name('cpu'))}.json"
    data = json.loads(written.read_text())
    datasheet = json.loads((Path(__file__).parent.parent / "profiles" / "h100-80gb.json").read_text())
    assert data["measurements"]["collectives"] == [] and data["metadata"]["device_count"] == 1
    assert (data["intra_node"], data["inter_node"]) == (datasheet["intra_node"], datasheet["inter_node"])
    assert data["metadata"]["links_from"] == "copied from the h100-80gb profile (one device)"
    assert load_profile(str(written)).measured
    launched = subprocess.run([sys.executable, "-m", "tensoropt", "launch", str(EXAMPLES / "train_gpt.py"), "--device",
                               "cpu", "--gpus", "2", "--dry-run", "--run-dir", str(tmp_path / "run")],
                              capture_output=True, text=True, env=env, cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert f"profile {written} (measured on this machine)" in launched.stdout
