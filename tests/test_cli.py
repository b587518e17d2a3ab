"""The CLI: inspect's table and JSON contract, and one-line errors for bad input."""

import json
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner
from conftest import EXAMPLES, REPO, SMALL_GPT

from tensoropt.cli import cli


def run(*args):
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_help_lists_commands():
    code, out = run("--help")
    assert code == 0 and "inspect" in out


def test_the_launcher_imports_on_its_own_and_without_the_tensoropt_command_line():
    """``import launcher.cli`` in a fresh interpreter works and loads no part of ``tensoropt.cli`` (the options both
    use are in ``tensoropt.options``), so the click group can import the launcher at its top with no cycle."""
    probe = "import sys, launcher.cli; print(sorted(m for m in sys.modules if m.startswith('tensoropt.cli')))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_inspect_json_contract(write_json):
    code, out = run("inspect", "--model", write_json("gpt.json", SMALL_GPT), "--json")
    assert code == 0
    report = json.loads(out)
    for key in ("parameters", "ops", "flops_per_iteration", "capture_seconds", "folding"):
        assert key in report
    assert set(report["folding"]) >= {"unique_blocks", "ops_after_folding"}
    (block,) = report["folding"]["unique_blocks"]
    assert {"name", "ops", "repeats"} <= set(block) and block["repeats"] == 4
    assert report["folding"]["ops_after_folding"] == report["ops"] - 3 * block["ops"]


def test_inspect_table_shows_blocks():
    code, out = run("inspect", "--model", "gpt2-small", "--seq-len", "128")
    assert code == 0
    assert "layers.*" in out and "124.4M" in out and "FLOPs per iteration" in out


@pytest.mark.slow
def test_console_script_inspects_gpt3_175b():
    out = subprocess.run([sys.executable, "-m", "tensoropt", "inspect", "--model", "gpt3-175b", "--json"],
                         capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    assert report["folding"]["unique_blocks"][0]["repeats"] == 96
    assert abs(report["parameters"] / 175e9 - 1) < 0.01


def _bad_user_file(tmp_path, body):
    path = tmp_path / "bad.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


BAD_INPUTS = {
    "unknown preset": (["--model", "gpt5"], "unknown model 'gpt5'"),
    "missing file": (["--model", "nope.json"], "no such file"),
    "python file without function": (["--model", "model.py"], "name the function too"),
    "non-positive batch": (["--model", "gpt2-small", "--batch-size", "0"], "must be a positive integer"),
    "too long sequence": (["--model", "gpt2-small", "--seq-len", "4096"], "exceeds gpt2-small's 1024"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_non_zero(case):
    args, expected = BAD_INPUTS[case]
    result = CliRunner().invoke(cli, ["inspect", *args])
    assert result.exit_code != 0
    assert expected in result.output
    assert "Traceback" not in result.output


def test_bad_json_configs(write_json):
    cases = {
        write_json("a.json", {"family": "gpt", "hidden_size": 64}): "missing required key(s) num_layers",
        write_json("b.json", {**SMALL_GPT, "hiden_size": 3}): "unknown key(s) hiden_size",
        write_json("c.json", {**SMALL_GPT, "num_attention_heads": 5}): "must be divisible by num_attention_heads 5",
        write_json("d.json", {"family": "transformer"}): "\"family\" must be one of",
        write_json("e.json", {"model_type": "no-such-arch", "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "vocab_size": 128}): "does not know model_type 'no-such-arch'",
    }
    for path, expected in cases.items():
        result = CliRunner().invoke(cli, ["inspect", "--model", path])
        assert result.exit_code == 1, path
        assert expected in result.output and result.output.count("\n") == 1, result.output


def test_user_file_errors(tmp_path):
    cases = {
        "def build():\n    raise RuntimeError('boom')\n": "raised RuntimeError: boom",
        "def build():\n    return 3\n": "must return (model, example_inputs)",
        "import not_a_module\n": "importing it failed: ModuleNotFoundError",
        ("import torch\nfrom torch import nn\nclass M(nn.Module):\n    def forward(self, x):\n"
         "        return x[x > 0].sum()\ndef build():\n    return M(), (torch.randn(3),)\n"):
        "depends on tensor values",
    }
    for body, expected in cases.items():
        path = _bad_user_file(tmp_path, body)
        result = CliRunner().invoke(cli, ["inspect", "--model", f"{path}:build", "--no-cache"])
        assert result.exit_code == 1 and expected in result.output, result.output
        assert result.output.count("\n") == 1
    result = CliRunner().invoke(cli, ["inspect", "--model", f"{EXAMPLES / 'custom_model.py'}:nothing"])
    assert result.exit_code == 1 and "has no function 'nothing'" in result.output


def test_the_launcher_and_the_planner_import_no_torch():
    """A launch from a cached capture plans and starts its workers without importing torch (~2 CPU-s a launch):
    the CLI, the launcher, the planner and the DeepSpeed config import it only where a model is captured or run."""
    code = ("import sys, tensoropt.cli.group, launcher.cli, tensoropt.planning, tensoropt.search.ft, "
            "tensoropt.runtime.engines.ds_config, tensoropt.runtime.engines.precision_names, tensoropt.runtime; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout[:500]
