import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


# Every test, and every process a test starts, uses a fresh capture cache and an empty folder of measured
# profiles, never the user's (~/.cache/tensoropt), and a fresh inductor cache (torch.compile's kernels: launch
# --compile), shared by the session's compiled runs. Set when pytest loads this file, before any test module
# copies the environment (tests/workers.py's ENV does, at import).
ISOLATED = {"TENSOROPT_CACHE_DIR": tempfile.mkdtemp(prefix="tensoropt-test-cache-"),
            "TENSOROPT_PROFILE_DIR": tempfile.mkdtemp(prefix="tensoropt-test-profiles-"),
            "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="tensoropt-test-inductor-")}
os.environ.update(ISOLATED)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache():
    """The test session's capture cache (see ISOLATED), removed at the end."""
    yield Path(ISOLATED["TENSOROPT_CACHE_DIR"])
    for path in ISOLATED.values():
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def write_json(tmp_path):
    def write(name: str, data: dict) -> str:
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return str(path)
    return write


SMALL_GPT = {"family": "gpt", "hidden_size": 64, "num_layers": 4, "num_attention_heads": 4,
             "ffn_hidden_size": 256, "seq_length": 32, "vocab_size": 128}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The loss trajectory of examples/train_gpt.py run alone (one process, no plan): what every
    launched plan of it must reproduce. test_elastic overrides it with final parameters."""
    from workers import GPT_SCRIPT, losses_alone
    return losses_alone(GPT_SCRIPT, tmp_path_factory.mktemp("ref") / "losses.json")
