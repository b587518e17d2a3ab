"""Bad input, one row per kind: every CLI command's options and ``tensoropt.parallelize``.

Each row asserts what the user sees: a non-zero exit, exactly one line on stderr that starts with
``error:`` and names the problem, no traceback, and nothing written where the command would write
(its ``--out``/``--plot``/``--run-dir``/``--checkpoint-dir``, and the workspace holds no leftovers).
Rows run in-process through click's ``CliRunner`` under an alarm (a case that hangs fails instead of
hanging the suite); none captures a script or starts a worker: everything here is refused before any
work. A few rows run the real console entry point in a subprocess with a timeout, to check the one
line survives outside click's test runner.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import EXAMPLES, SMALL_GPT

from tensoropt.cli import cli
from tensoropt.errors import TensorOptError, error_line, first_line, last_line

CASE_TIMEOUT_S = 120          # a generous bound: every row is refused in well under a second of work
SCRIPT = str(EXAMPLES / "train_gpt.py")
LONG = "a" * 300 + ".json"    # one file name longer than any Linux file system allows (255 bytes)

PLAN = {"schema_version": 1, "devices": 2, "dp": 2, "tp": 1, "pp": 1, "virtual_stages": 1, "micro_batch": 1,
        "global_batch": 8, "gradient_accumulation": 4, "zero": 0, "offload": False, "tp_branches": [],
        "dtype": "float32", "master_weights": False,
        "blocks": [{"block": "layers.*", "strategies": [{"recompute": "none", "sequence_parallel": False,
                                                          "copies": 4}]}]}


def _plan(**fields) -> dict:
    return {**PLAN, **fields}


def _strategy(**fields) -> dict:
    return _plan(blocks=[{"block": "layers.*", "strategies": [
        {"recompute": "none", "sequence_parallel": False, "copies": 4, **fields}]}])


# files the rows name as {key}: written into the workspace before each row
FILES = {
    "gpt": SMALL_GPT,
    "plan": PLAN,
    "plan_zero7": _plan(zero=7),
    "plan_dp0": _plan(dp=0),
    "plan_mb3": _plan(micro_batch=3),
    "plan_banana": _strategy(recompute="banana"),
    "plan_copies": _strategy(copies=-1),
    "plan_sp": _strategy(sequence_parallel="yes"),
    "plan_mesh": _plan(devices=4),
    "plan_accum": _plan(gradient_accumulation=3),
    "plan_virtual": _plan(virtual_stages=2),
    "plan_version": _plan(schema_version=7),
    "plan_missing": {k: v for k, v in PLAN.items() if k != "dp"},
    "plan_float": _plan(tp=1.5),
    "plan_dtype": _plan(dtype="int8"),
    "plan_precision": _plan(precision="fp8"),
    "plan_offload": _plan(offload="no"),
    "plan_grad": _plan(grad_dtype="float16"),
    "plan_grad_fp32": _plan(grad_dtype="bfloat16", precision="32-true"),
    "plan_list": [1, 2],
    "hf_missing": {"model_type": "llama", "hidden_size": 64},
    "hf_heads": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 5,
                 "vocab_size": 128, "intermediate_size": 128},
    "hf_kv": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 3, "vocab_size": 128, "intermediate_size": 128},
    "hf_zero": {"model_type": "gpt2", "n_embd": 64, "n_layer": 0, "n_head": 4, "vocab_size": 128},
    "resources_bad": {"gpus": "many"},
    "resources_zero": {"gpus": 0},
}
TEXT_FILES = {"garbage": ("garbage.json", "{not json"), "afile": ("afile", "I am a file\n")}

L = ["launch", SCRIPT, "--device", "cpu", "--gpus", "2", "--dry-run"]      # a launch refused before its capture
E = ["estimate", "--model", "{gpt}", "--gpus", "2", "--tp", "1", "--pp", "1", "--global-batch", "8"]
F = ["frontier", "--model", "{gpt}", "--gpus", "2", "--global-batch", "8"]
ELASTIC = ["launch", SCRIPT, "--device", "cpu", "--gpus", "2", "--elastic"]

# (id, argv with {file} placeholders, what the one line must say, outputs that must not appear)
CASES = [
    # --- the command line itself
    ("unknown command", ["bogus"], "No such command 'bogus'", []),
    ("unknown option", ["inspect", "--model", "gpt2-small", "--bogus"], "No such option '--bogus'", []),
    ("missing required option", ["estimate", "--model", "{gpt}"], "Missing option '--gpus'", []),
    ("int option not a number", [*E[:4], "abc", *E[5:]], "'abc' is not a valid integer", []),
    # --- inspect
    ("inspect unknown model", ["inspect", "--model", "gpt5"], "unknown model 'gpt5'", []),
    ("inspect missing config", ["inspect", "--model", "{ws}/nope.json"], "no such file", []),
    ("inspect garbage config", ["inspect", "--model", "{garbage}"], "not a readable JSON file", []),
    ("inspect batch size 0", ["inspect", "--model", "{gpt}", "--batch-size", "0"], "--batch-size", []),
    ("inspect seq len -3", ["inspect", "--model", "{gpt}", "--seq-len", "-3"], "--seq-len", []),
    ("HF config missing keys", ["inspect", "--model", "{hf_missing}"],
     "missing num_hidden_layers, num_attention_heads, vocab_size", []),
    ("HF bad head count", ["inspect", "--model", "{hf_heads}"], "not a multiple of num_attention_heads 5", []),
    ("HF bad key/value heads", ["inspect", "--model", "{hf_kv}"], "num_key_value_heads 3 must divide", []),
    ("HF zero layers", ["inspect", "--model", "{hf_zero}"], "must be positive integers", []),
    # --- frontier
    ("frontier no model", ["frontier", "--gpus", "8"], "give --model and --gpus", []),
    ("frontier global batch -4", [*F[:-1], "-4"], "--global-batch -4 must be between 1", []),
    ("frontier global batch huge", [*F[:-1], "99999999999"], "--global-batch 99999999999 must be between", []),
    ("frontier gpus 0", [*F[:4], "0", *F[5:]], "--gpus '0'", []),
    ("frontier gpus 1e9", [*F[:4], "1000000000", *F[5:]], "--gpus 1000000000 must be between 1 and 131,072", []),
    ("frontier gpus range huge", [*F[:4], "64-1000000000", *F[5:]], "--gpus 1000000000 must be between", []),
    ("frontier gpus garbage", [*F[:4], "eight", *F[5:]], "--gpus 'eight'", []),
    ("frontier gpus backwards range", [*F[:4], "64-8", *F[5:]], "--gpus '64-8'", []),
    ("frontier gpus per node 0", [*F, "--gpus-per-node", "0"], "--gpus-per-node", []),
    ("frontier gpus per node huge", [*F, "--gpus-per-node", "100000"], "--gpus-per-node", []),
    ("frontier seq len 0", [*F, "--seq-len", "0"], "--seq-len", []),
    ("frontier mem 0", [*F, "--mem", "0"], "--mem '0': give a size above 0", []),
    ("frontier mem garbage", [*F, "--mem", "lots"], "--mem 'lots': give a size with a unit", []),
    ("frontier mem huge", [*F, "--mem", "5PiB"], "at most 1 PiB", []),
    ("frontier unknown device profile", [*F, "--device", "nope"], "unknown device profile 'nope'", []),
    ("frontier plot missing folder", [*F, "--out", "{ws}/x.json", "--plot", "/nonexistent/f.png"],
     "--plot /nonexistent/f.png: the folder /nonexistent does not exist", ["{ws}/x.json"]),
    ("frontier plot not an image", [*F, "--plot", "{ws}/f.txt"], "name a PNG or PDF or SVG file", ["{ws}/f.txt"]),
    ("frontier plot is a folder", [*F, "--plot", "{ws}/dir.png"], "is a folder", []),
    ("frontier out in /proc", [*F, "--out", "/proc/x.json"], "--out /proc/x.json: cannot write in /proc", []),
    ("frontier out missing folder", [*F, "--out", "{ws}/missing/x.json"], "the folder", ["{ws}/missing"]),
    ("frontier out under a file", [*F, "--out", "{afile}/x.json"], "is a file", []),
    ("frontier out is a folder", [*F, "--out", "{ws}"], "is a folder", []),
    ("frontier out name too long", [*F, "--out", "{ws}/" + LONG], "more than the 255", []),
    ("frontier load with model and gpus", ["frontier", "--load", "{ws}/f.json", "--model", "{gpt}", "--gpus", "8"],
     "--model, --gpus describe another search", []),
    ("frontier load with limits", ["frontier", "--load", "{ws}/f.json", "--tp", "2"], "--tp 2", []),
    ("frontier load missing file", ["frontier", "--load", "{ws}/nope.json"], "not a readable frontier file", []),
    ("frontier load a plan", ["frontier", "--load", "{plan}"], "not a readable frontier file", []),
    ("frontier tp 0", [*F, "--tp", "0"], "--tp '0'", []),
    ("frontier zero 4", [*F, "--zero", "4"], "--zero '4': give ZeRO stages 0-3", []),
    ("frontier recompute banana", [*F, "--recompute", "banana"], "--recompute 'banana'", []),
    ("frontier max tp list", [*F, "--max-tp", "2,4"], "--max-tp '2,4'", []),
    ("frontier pp garbage", [*F, "--pp", "x"], "--pp 'x'", []),
    ("frontier grad dtype fp16", [*F, "--grad-dtype", "fp16"], "--grad-dtype 'fp16': give dtypes among fp32, bf16",
     []),
    ("frontier precision fp8", [*F, "--precision", "fp8"], "--precision", []),
    ("frontier load with precision", ["frontier", "--load", "{ws}/f.json", "--precision", "32-true"], "--precision",
     []),
    # --- estimate
    ("estimate gpus 0", [*E[:4], "0", *E[5:]], "--gpus 0 must be between 1", []),
    ("estimate gpus 1e9", [*E[:4], "1000000000", *E[5:]], "--gpus 1000000000 must be between", []),
    ("estimate global batch huge", [*E[:-1], "99999999999"], "--global-batch 99999999999 must be between", []),
    ("estimate tp 0", [*E[:6], "0", *E[7:]], "--tp", []),
    ("estimate zero 5", [*E, "--zero", "5"], "--zero", []),
    ("estimate micro batch 0", [*E, "--micro-batch", "0"], "--micro-batch", []),
    ("estimate recompute banana", [*E, "--recompute", "banana"], "--recompute", []),
    ("estimate dtype int8", [*E, "--dtype", "int8"], "--dtype", []),
    ("estimate precision fp8", [*E, "--precision", "fp8"], "--precision", []),
    ("estimate grad dtype fp16", [*E, "--grad-dtype", "fp16"], "--grad-dtype", []),
    ("estimate bf16 gradients in 32-true", [*E, "--precision", "32-true", "--grad-dtype", "bf16"],
     "--grad-dtype bf16 departs from bf16-mixed's float32 gradients only", []),
    ("estimate seq len 0", [*E, "--seq-len", "0"], "--seq-len", []),
    ("estimate gpus per node 0", [*E, "--gpus-per-node", "0"], "--gpus-per-node", []),
    ("estimate virtual stages 0", [*E, "--virtual-stages", "0"], "--virtual-stages", []),
    # --- show: plan files checked field by field
    ("show missing file", ["show", "{ws}/nope.json"], "not a readable JSON file", []),
    ("show garbage", ["show", "{garbage}"], "not a readable JSON file", []),
    ("show plan zero 7", ["show", "{plan_zero7}"], '"zero" must be a ZeRO stage 0-3, got 7', []),
    ("show plan dp 0", ["show", "{plan_dp0}"], '"dp" must be an integer >= 1, got 0', []),
    ("show plan micro batch 3", ["show", "{plan_mb3}"], 'micro_batch 3 x gradient_accumulation 4 x dp 2', []),
    ("show plan recompute banana", ["show", "{plan_banana}"], "\"recompute\" must be one of none, selective, full, "
     "got 'banana'", []),
    ("show plan negative copies", ["show", "{plan_copies}"], '"copies" must be an integer >= 0, got -1', []),
    ("show plan sp not a bool", ["show", "{plan_sp}"], '"sequence_parallel" must be true or false', []),
    ("show plan mesh", ["show", "{plan_mesh}"], 'dp 2 x tp 1 x pp 1 must equal "devices" 4', []),
    ("show plan accumulation", ["show", "{plan_accum}"], "gradient_accumulation 3", []),
    ("show plan virtual without pp", ["show", "{plan_virtual}"], '"virtual_stages" 2 needs pp > 1', []),
    ("show plan schema version", ["show", "{plan_version}"], "schema_version 7 is not 1", []),
    ("show plan missing field", ["show", "{plan_missing}"], '"dp" is missing', []),
    ("show plan fractional tp", ["show", "{plan_float}"], '"tp" must be an integer >= 1, got 1.5', []),
    ("show plan dtype", ["show", "{plan_dtype}"], '"dtype" must be one of', []),
    ("show plan precision", ["show", "{plan_precision}"], "'fp8' is not one of", []),
    ("show plan offload not a bool", ["show", "{plan_offload}"], '"offload" must be true or false', []),
    ("show plan grad dtype", ["show", "{plan_grad}"], '"grad_dtype" must be \'bfloat16\'', []),
    ("show plan bf16 gradients in 32-true", ["show", "{plan_grad_fp32}"],
     '"grad_dtype" \'bfloat16\' needs "precision" "bf16-mixed", got \'32-true\'', []),
    ("show plan a list", ["show", "{plan_list}"], "a plan is a JSON object", []),
    ("show plot missing folder", ["show", "{plan}", "--plot", "/nonexistent/f.png"], "/nonexistent does not exist", []),
    ("show plot of a plan", ["show", "{plan}", "--plot", "{ws}/p.png"], "--plot draws a frontier", ["{ws}/p.png"]),
    # --- profile: the output checked before 18 s of measuring
    ("profile out in /proc", ["profile", "--quick", "--out", "/proc/x.json"], "cannot write in /proc", []),
    ("profile out missing folder", ["profile", "--quick", "--out", "{ws}/missing/x.json"], "does not exist",
     ["{ws}/missing"]),
    ("profile out not json", ["profile", "--quick", "--out", "{ws}/x.txt"], "ending in .json", ["{ws}/x.txt"]),
    ("profile out name too long", ["profile", "--quick", "--out", "{ws}/" + LONG], "more than the 255", []),
    ("profile nproc 0", ["profile", "--quick", "--nproc", "0"], "--nproc", []),
    ("profile nproc huge", ["profile", "--quick", "--nproc", "1000", "--out", "{ws}/x.json"], "--nproc",
     ["{ws}/x.json"]),
    ("profile unknown link profile", ["profile", "--quick", "--nproc", "1", "--link-profile", "nope",
                                      "--out", "{ws}/x.json"], "unknown device profile 'nope'", ["{ws}/x.json"]),
    ("profile device tpu", ["profile", "--device", "tpu"], "--device", []),
    # --- launch: refused before the script is captured
    ("launch missing script", ["launch", "{ws}/nope.py", "--device", "cpu", "--gpus", "2"], "no such script", []),
    ("launch gpus 0", [*L[:5], "0", *L[6:]], "--gpus", []),
    ("launch cpu workers 1e9", [*L[:5], "1000000000", *L[6:]], "more than 131,072 devices", []),
    ("launch cpu workers 1000", [*L[:5], "1000", *L[6:]], "at most 256 CPU workers", []),
    ("launch device tpu", ["launch", SCRIPT, "--device", "tpu"], "--device", []),
    ("launch cpu without gpus", ["launch", SCRIPT, "--device", "cpu", "--dry-run"], "--device cpu needs --gpus", []),
    ("launch mem per gpu 0", [*L, "--mem-per-gpu", "0"], "--mem-per-gpu '0': give a size above 0", []),
    ("launch mem per gpu garbage", [*L, "--mem-per-gpu", "plenty"], "--mem-per-gpu 'plenty'", []),
    ("launch mem per gpu beyond the host", [*L, "--mem-per-gpu", "1TiB"], "more than this host's", []),
    ("launch unknown profile", [*L, "--profile", "nope"], "unknown device profile 'nope'", []),
    ("launch mem per gpu beyond the profile", ["launch", SCRIPT, "--device", "cuda", "--gpus", "8", "--dry-run",
                                              "--mem-per-gpu", "1TiB"], "--mem-per-gpu 1024.0 GiB is more than", []),
    ("launch objective", [*L, "--objective", "cheapest"], "--objective", []),
    ("launch engine", [*L, "--engine", "jax"], "--engine", []),
    ("launch precision", [*L, "--precision", "fp8"], "--precision", []),
    ("launch master port 99999", [*L, "--master-port", "99999"], "--master-port", []),
    ("launch master port 0", [*L, "--master-port", "0"], "--master-port", []),
    ("launch plan port past 65535", [*L, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "65535"],
     "below 65535", []),
    ("launch node rank 5 of 2", [*L, "--nnodes", "2", "--node-rank", "5"], "--node-rank 5 must be below --nnodes 2",
     []),
    ("launch nnodes 0", [*L, "--nnodes", "0"], "--nnodes", []),
    ("launch nnodes without master", [*L[:-1], "--nnodes", "2"], "--nnodes 2 needs --master-addr", []),
    ("launch gpus per node 0", [*L, "--gpus-per-node", "0"], "--gpus-per-node", []),
    ("launch run dir is a file", [*L, "--run-dir", "{afile}"], "--run-dir", []),
    ("launch run dir in /proc", [*L, "--run-dir", "/proc/run"], "cannot write in /proc", []),
    ("launch run dir name too long", [*L, "--run-dir", "{ws}/" + "r" * 300], "more than the 255", []),
    ("launch plan missing", [*L, "--plan", "{ws}/nope.json"], "--plan", []),
    ("launch plan garbage", [*L, "--plan", "{garbage}"], "not a readable plan file", []),
    ("launch plan zero 7", [*L, "--plan", "{plan_zero7}"], '"zero" must be a ZeRO stage 0-3, got 7', []),
    ("launch plan micro batch 3", [*L, "--plan", "{plan_mb3}"], "micro_batch 3", []),
    ("launch plan recompute banana", [*L, "--plan", "{plan_banana}"], "got 'banana'", []),
    ("launch plan dp 0", [*L, "--plan", "{plan_dp0}"], '"dp" must be an integer >= 1, got 0', []),
    ("launch plan with limits", [*L, "--plan", "{plan}", "--tp", "1"], "--plan runs the plan given", []),
    ("launch limits zero 4", [*L, "--zero", "4"], "--zero '4'", []),
    ("launch limits recompute banana", [*L, "--recompute", "banana"], "--recompute 'banana'", []),
    ("launch limits grad dtype", [*L, "--grad-dtype", "bf32"], "--grad-dtype 'bf32'", []),
    ("launch plan grad dtype", [*L, "--plan", "{plan_grad}"], '"grad_dtype" must be', []),
    ("launch checkpoint every 0", [*L, "--checkpoint-every", "0"], "--checkpoint-every", []),
    ("launch resources without elastic", [*L, "--resources", "{resources_bad}"], "--resources is watched by an "
     "--elastic job only", []),
    ("elastic without checkpoint dir", ELASTIC, "--elastic needs --checkpoint-dir", []),
    ("elastic checkpoint dir is a file", [*ELASTIC, "--checkpoint-dir", "{afile}"], "--checkpoint-dir", []),
    ("elastic with nnodes", [*ELASTIC, "--checkpoint-dir", "{ws}/ck", "--nnodes", "2"], "drop --nnodes",
     ["{ws}/ck"]),
    ("elastic with a plan", [*ELASTIC, "--checkpoint-dir", "{ws}/ck", "--plan", "{plan}"], "drop --plan", ["{ws}/ck"]),
    ("elastic with deepspeed", [*ELASTIC, "--checkpoint-dir", "{ws}/ck", "--engine", "deepspeed"],
     "drop --engine deepspeed", ["{ws}/ck"]),
    ("elastic garbage resources", [*ELASTIC, "--checkpoint-dir", "{ws}/ck", "--resources", "{garbage}"],
     "not a readable JSON file", ["{ws}/ck"]),
    ("elastic resources gpus many", [*ELASTIC, "--checkpoint-dir", "{ws}/ck", "--resources", "{resources_bad}"],
     'give {"gpus": N}', ["{ws}/ck"]),
    ("elastic resources gpus 0", [*ELASTIC, "--checkpoint-dir", "{ws}/ck", "--resources", "{resources_zero}"],
     "names 0 devices, fewer than --min-gpus 1: giving up", ["{ws}/ck"]),
    ("elastic resources missing", [*ELASTIC, "--checkpoint-dir", "{ws}/ck", "--resources", "{ws}/nope.json"],
     "not a readable JSON file", ["{ws}/ck"]),
    ("elastic min gpus above gpus", [*ELASTIC, "--checkpoint-dir", "{ws}/ck", "--min-gpus", "4"],
     "--min-gpus 4 is more than --gpus 2", ["{ws}/ck"]),
]


@pytest.fixture
def workspace(tmp_path):
    """A folder with every file the rows name; {name} in a row's argv is replaced by its path."""
    names = {"ws": str(tmp_path)}
    for name, data in FILES.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        names[name] = str(path)
    for name, (file_name, text) in TEXT_FILES.items():
        path = tmp_path / file_name
        path.write_text(text)
        names[name] = str(path)
    (tmp_path / "dir.png").mkdir()
    return tmp_path, names


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail the case instead of hanging the suite (SIGALRM interrupts the command in this process)."""
    def expire(_signum, _frame):
        raise TimeoutError(f"no answer within {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _fill(text: str, names: dict[str, str]) -> str:
    for key, value in names.items():
        text = text.replace("{" + key + "}", value)
    return text


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def _assert_one_line(code: int, stderr: str, expected: str, context) -> None:
    lines = stderr.strip().splitlines()
    assert code != 0, (context, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), (context, stderr[-2000:])
    assert expected in lines[0], (context, expected, lines[0])
    assert "Traceback" not in stderr


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_writes_nothing(case, workspace, monkeypatch):
    name, argv, expected, outputs = case
    folder, names = workspace
    monkeypatch.chdir(folder)                  # a default --run-dir would land here: nothing may
    before = _listing(folder)
    args = [_fill(a, names) for a in argv]
    with _deadline(CASE_TIMEOUT_S):
        result = CliRunner().invoke(cli, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (name, result.exception)
    _assert_one_line(result.exit_code, result.stderr, expected, name)
    assert result.stdout == "", (name, result.stdout[-500:])
    for path in outputs:
        assert not Path(_fill(path, names)).exists(), (name, path)
    assert _listing(folder) == before, (name, _listing(folder) ^ before)      # no temp or probe files left


@pytest.mark.parametrize("args, expected", [
    (["launch", SCRIPT, "--device", "cpu", "--gpus", "2", "--master-port", "99999"], "--master-port"),
    (["frontier", "--model", "gpt2-small", "--gpus", "8", "--plot", "/nonexistent/f.png"],
     "/nonexistent does not exist"),
], ids=["click error", "tensoropt error"])
def test_the_console_entry_point_prints_one_line(args, expected, tmp_path):
    result = subprocess.run([sys.executable, "-m", "tensoropt", *args], capture_output=True, text=True, cwd=tmp_path,
                            timeout=CASE_TIMEOUT_S)
    _assert_one_line(result.returncode, result.stderr, expected, args)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("global_batch", [-4, 0, 2.5, True, "8"])
def test_parallelize_refuses_a_bad_global_batch(global_batch, monkeypatch):
    import tensoropt
    monkeypatch.delenv("TENSOROPT_PLAN", raising=False)
    with pytest.raises(TensorOptError) as info:
        tensoropt.parallelize(torch.nn.Linear(2, 2), example_inputs=torch.zeros(1, 2), global_batch=global_batch)
    assert "global_batch" in str(info.value) and "\n" not in str(info.value)


def test_a_resources_file_that_turns_bad_keeps_the_last_good_value_and_says_so(tmp_path):
    from launcher.devices import Devices
    from launcher.elastic import Resources, resources
    from tensoropt.cost.profile import load_profile
    devices = Devices("cpu", 2, 2**30, load_profile("cpu-2core"))
    path = tmp_path / "resources.json"
    path.write_text('{"gpus": 3}')
    said: list[str] = []
    good = resources(devices, path, None, echo=said.append)
    assert good == Resources(3, 2**30) and said == []
    path.write_text('{"gpus": ')                                      # half-written, or garbage
    assert resources(devices, path, good, echo=said.append) == good
    assert len(said) == 1 and "not a readable JSON file" in said[0] and "keeping the last good value, 3 devices" \
        in said[0]
    with pytest.raises(TensorOptError, match="not a readable JSON file"):      # at the start there is none to keep
        resources(devices, path, None)


def test_error_lines():
    assert error_line(TensorOptError("a\n  b\n")) == "error: a b"
    assert first_line(OSError("first\nsecond")) == "first" and first_line(ValueError()) == "ValueError"
    assert last_line("Traceback ...\n  File x\nValueError: why\n\n") == "ValueError: why"
    assert last_line("") == "(no output)" and len(first_line("x" * 1000)) == 300


def test_hugging_face_config_without_intermediate_size_is_refused(write_json):
    path = write_json("hf.json", {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "vocab_size": 128})
    with _deadline(CASE_TIMEOUT_S):
        result = CliRunner().invoke(cli, ["inspect", "--model", path])
    _assert_one_line(result.exit_code, result.stderr, "missing intermediate_size", path)


def test_every_command_has_rows():
    """The table covers every command of the CLI (a new command needs its bad inputs here)."""
    covered = {argv[0] for _, argv, _, _ in CASES}
    assert set(cli.commands) <= covered, set(cli.commands) - covered
    assert len(CASES) >= 90 and os.sep      # the 90 kinds and more


@pytest.mark.slow
def test_a_script_with_a_negative_global_batch_is_one_line_from_the_launcher(tmp_path):
    """The launcher's capture runs the script: its ``parallelize`` refuses the batch before anything is planned."""
    script = tmp_path / "train.py"
    script.write_text("import torch\nimport tensoropt\n"
                      "model = torch.nn.Linear(4, 4)\n"
                      "tensoropt.parallelize(model, example_inputs=torch.zeros(2, 4), global_batch=-4)\n")
    result = subprocess.run([sys.executable, "-m", "tensoropt", "launch", str(script), "--device", "cpu", "--gpus", "2",
                             "--dry-run", "--run-dir", str(tmp_path / "run"), "--no-cache"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)
    _assert_one_line(result.returncode, result.stderr, "tensoropt.parallelize(global_batch=-4)", script)
    assert not (tmp_path / "run").exists()
