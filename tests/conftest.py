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


# The tests that start worker processes are marked xdist_group("multiprocess"): under `pytest -n 2` a group runs
# in one process, one test after another, so that launches of the same plan, the dry runs and the script-alone
# references are made once per process (tests/workers.py). One such serial group was CI's critical path: a launch
# keeps two cores only ~70% busy (measured: launcher 3.0 + torchrun 1.9 + 2 x 3.7 worker CPU-seconds of the GPT
# example's launch, 8.6 of them one process after another: each imports torch in turn), and the other xdist process
# sat idle once the quick tests were done. So the modules below form a second chain, "multiprocess-2", which the
# other process runs beside the first (two launches, four workers, may then train at once). The split is by module,
# along what the modules share (test_launch, test_precision and test_memory_check read one another's launches
# through workers.launched_once and stay together), balanced by measured durations; a new module's tests join the
# first chain unless listed here.
SECOND_CHAIN = frozenset({
    "test_deepspeed_gpu_path.py", "test_deepspeed_memory.py", "test_elastic.py", "test_full_state_dict.py",
    "test_fused_launch.py", "test_launch_proc.py", "test_limits.py", "test_meta_launch.py", "test_profile_gpu_path.py",
    "test_profiler.py", "test_selective.py", "test_sequence_parallel.py", "test_tensor_parallel.py",
    "test_vocab_parallel.py"})


@pytest.hookimpl(tryfirst=True)       # before xdist reads the groups (its own collection_modifyitems)
def pytest_collection_modifyitems(items):
    """Move the "multiprocess" tests of the SECOND_CHAIN modules to the "multiprocess-2" group (see above)."""
    second = pytest.mark.xdist_group("multiprocess-2").mark
    for item in items:
        if item.path.name in SECOND_CHAIN:
            for node in item.listchain():       # the mark sits on the test function or on its module (pytestmark)
                node.own_markers[:] = [second if m.name == "xdist_group" and m.args == ("multiprocess",) else m
                                       for m in node.own_markers]


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


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The loss trajectory of examples/train_gpt.py run alone (one process, no plan): what every
    launched plan of it must reproduce; run once per test process (the modules that use it sit in the two
    "multiprocess" chains, so two processes run it). test_elastic overrides it with final parameters."""
    from workers import GPT_SCRIPT, losses_alone
    return losses_alone(GPT_SCRIPT, tmp_path_factory.mktemp("ref") / "losses.json")
