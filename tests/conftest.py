import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """All tests share one fresh capture cache and an empty folder of measured profiles, never the user's."""
    paths = {"TENSOROPT_CACHE_DIR": tmp_path_factory.mktemp("tensoropt-cache"),
             "TENSOROPT_PROFILE_DIR": tmp_path_factory.mktemp("tensoropt-profiles")}
    old = {name: os.environ.get(name) for name in paths}
    os.environ.update({name: str(path) for name, path in paths.items()})
    yield paths["TENSOROPT_CACHE_DIR"]
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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
