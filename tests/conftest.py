import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


# Every test, and every process a test starts, uses a fresh capture cache and an empty folder of measured
# profiles, never the user's (~/.cache/tensoropt), a fresh inductor cache (torch.compile's kernels: launch
# --compile), shared by the session's compiled runs, and a fresh folder for C++ extensions (torch's JIT builds,
# DeepSpeed's ops), which a DeepSpeed launch must leave empty (tests/test_launch.py). Set when pytest loads this
# file, before any test module copies the environment (tests/workers.py's ENV does, at import).
# Under ``pytest -n 2`` the capture cache, the inductor cache and the launches' working folder (below) are the test
# session's, made by the controlling process and handed to both xdist processes through the environment they
# inherit: a script captured (or a block compiled) in one of them is not captured again in the other. Both write
# them safely at once (the graph cache and inductor write each entry atomically; the launcher's capture index is a
# hint, rebuilt when lost). The profiles and the extensions folders stay each process's own: a test writes the one
# and asserts on the other being empty.
SESSION_ENV = "TENSOROPT_TEST_SESSION"          # set by the process that made the shared folders: its pid
SHARED = ("TENSOROPT_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TENSOROPT_TEST_LAUNCH_CWD")
_INHERITED = bool(os.environ.get("PYTEST_XDIST_WORKER")) and os.environ.get(SESSION_ENV) is not None and \
    all(os.path.isdir(os.environ.get(name, "")) for name in SHARED)
ISOLATED = {"TENSOROPT_CACHE_DIR": tempfile.mkdtemp(prefix="tensoropt-test-cache-"),
            "TENSOROPT_PROFILE_DIR": tempfile.mkdtemp(prefix="tensoropt-test-profiles-"),
            "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="tensoropt-test-inductor-"),
            "TORCH_EXTENSIONS_DIR": tempfile.mkdtemp(prefix="tensoropt-test-extensions-"),
            # The working folder of the launches the helpers in tests/workers.py make (every path they pass is
            # absolute): the launcher's capture cache keys a capture by the script, its arguments and the working
            # folder (launcher.capture), so one folder lets one script's launches from several tests share one
            # capture, where each test's own folder would make every capture unique.
            "TENSOROPT_TEST_LAUNCH_CWD": tempfile.mkdtemp(prefix="tensoropt-test-launches-")} \
    if not _INHERITED else {"TENSOROPT_PROFILE_DIR": tempfile.mkdtemp(prefix="tensoropt-test-profiles-"),
                            "TORCH_EXTENSIONS_DIR": tempfile.mkdtemp(prefix="tensoropt-test-extensions-")}
if not _INHERITED:
    os.environ[SESSION_ENV] = str(os.getpid())
os.environ.update(ISOLATED)
LAUNCH_CWD = Path(os.environ["TENSOROPT_TEST_LAUNCH_CWD"])

# Warm starts (tests/warm_start/server.py): the Python processes the tests start (workers, scripts run alone, the
# launcher's captures) are forked by a server of this pytest process that imported torch once, instead of each
# importing it (~5 CPU-s each). Set before any test module copies the environment; the server starts before the first
# test's fixtures (a process started before it, or after it stopped, starts cold). TENSOROPT_TEST_WARM=0 turns it off.
WARM_DIR = Path(__file__).resolve().parent / "warm_start"
WARM = os.environ.get("TENSOROPT_TEST_WARM", "1") != "0"
_WARM_SOCKET = os.path.join(tempfile.mkdtemp(prefix="tensoropt-warm-"), "server.sock")
_warm_server = None
if WARM:
    os.environ["TENSOROPT_TEST_WARM_SOCKET"] = _WARM_SOCKET
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(WARM_DIR), os.environ.get("PYTHONPATH", "")) if p)
# modules whose tests look at the process tree or signal it: their processes start cold ("cold"), or all but the
# scripts ("scripts": the launcher and torchrun cold, so a test finds the workers it kills under the launcher; the
# process it kills is the one torchrun started, and the script under the server dies with it); a test of such a
# module that looks only at output and exit statuses says so with @pytest.mark.warm_start("warm")
COLD_MODULES = {"test_launch_proc.py": "cold"}


def _start_warm_server():
    global _warm_server
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TENSOROPT_TEST_WARM_SOCKET"}
    _warm_server = subprocess.Popen([sys.executable, str(WARM_DIR / "server.py"), _WARM_SOCKET], env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    first = _warm_server.stdout.readline().strip()
    if first != "ready":
        # the processes the tests start would still find its socket (the environment says where): stop here, loudly
        _warm_server.kill()
        pytest.exit(f"the warm-start server did not start (its first line: {first!r}); TENSOROPT_TEST_WARM=0 runs "
                    "the suite without it", returncode=3)


@pytest.fixture(scope="session", autouse=True)
def _warm_server_started():
    """The warm-start server of this pytest process, started before any other fixture."""
    if WARM and _warm_server is None:
        _start_warm_server()


@pytest.fixture(autouse=True)
def _warm_start(request, _warm_server_started):
    """Cold starts (all, or all but the scripts) for the tests of COLD_MODULES."""
    marker = request.node.get_closest_marker("warm_start")
    mode = marker.args[0] if marker else COLD_MODULES.get(request.path.name)
    switched = _warm_server is not None and mode in ("cold", "scripts")
    if switched:
        _tell_warm_server(mode)
    yield
    if switched:
        _tell_warm_server("warm")


def _tell_warm_server(mode: str) -> None:
    _warm_server.stdin.write(mode + "\n")
    _warm_server.stdin.flush()
    assert _warm_server.stdout.readline().strip() == "ok", "the warm-start server stopped"


def pytest_unconfigure(config):
    """Remove the folders this process made (see ISOLATED), at the end: the shared ones in the process that made
    them, after its xdist processes are done; stop the warm-start server."""
    if _warm_server is not None:
        _warm_server.stdin.close()
        _warm_server.wait(30)
    for path in ISOLATED.values():
        shutil.rmtree(path, ignore_errors=True)


# The tests that start worker processes are marked xdist_group("multiprocess"): under `pytest -n 2 --dist loadgroup`
# (pyproject's addopts) the tests of one group run in one process, one after another, so that what a module's tests
# share there (a script-alone reference, a dry run, workers.launched_once) is made once. Here each module's marked
# tests become a group of their own, except the modules that read one another's launches through
# workers.launched_once, which share one: one serial group of every module was the suite's critical path, while
# many groups, the largest first, keep both xdist processes busy to the end (two launches, four workers, may then
# train at once, as the quick tests already ran beside launches).
SHARED_LAUNCHES = frozenset({"test_launch.py", "test_precision.py", "test_memory_check.py"})


@pytest.hookimpl(wrapper=True)       # around xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items):
    """Give each module's "multiprocess" tests a group of their own (see above); then let xdist name the groups.

    xdist 3.8 tells its scheduler an item's group by appending "@group" to ``item._nodeid``; pytest 9.2 keeps the
    node id in ``item._id`` and ignores that field, so each test was scheduled alone and no group held
    (pytest-dev/pytest-xdist#1386): the suffix is carried over where xdist wrote one and pytest did not see it."""
    for item in items:
        name = "launched_once" if item.path.name in SHARED_LAUNCHES else item.path.stem
        group = pytest.mark.xdist_group(f"workers-{name}").mark
        for node in item.listchain():       # the mark sits on the test function or on its module (pytestmark)
            node.own_markers[:] = [group if m.name == "xdist_group" and m.args == ("multiprocess",) else m
                                   for m in node.own_markers]
    yield
    for item in items:
        legacy = item.__dict__.get("_nodeid")
        if isinstance(legacy, str) and "@" in legacy and legacy != item.nodeid and hasattr(item, "_id"):
            item._id = type(item._id).parse(legacy)


@pytest.fixture
def benchmark_module(monkeypatch):
    """``load(name)``: a module of ``benchmarks/`` (whose modules import their siblings by bare name), imported with
    that folder on the path and forgotten after the test."""
    loaded = []

    def load(name: str):
        monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
        loaded.append(name)
        return importlib.import_module(name)
    yield load
    for name in loaded:
        sys.modules.pop(name, None)


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
    launched plan of it must reproduce; run once per test process (under ``pytest -n 2``, at most twice).
    test_elastic overrides it with final parameters."""
    from workers import GPT_SCRIPT, losses_alone
    return losses_alone(GPT_SCRIPT, tmp_path_factory.mktemp("ref") / "losses.json")


@pytest.fixture(scope="module")
def small_gpt(tmp_path_factory):
    """(graph, cost model on 2 H100s) of SMALL_GPT captured as it is (bf16), at batch 1 and 32 tokens."""
    from tensoropt.api import capture
    from tensoropt.cost.model import ModelCost
    from tensoropt.cost.profile import Cluster, load_profile
    from tensoropt.graph.fold import fold
    path = tmp_path_factory.mktemp("gpt") / "gpt.json"
    path.write_text(json.dumps(SMALL_GPT))
    graph = capture(str(path), batch_size=1, seq_len=32).graph
    return graph, ModelCost(graph, fold(graph), Cluster(2, 2, load_profile("h100-80gb")))


@pytest.fixture
def one_rank():
    """A gloo process group of one rank in this process, for engines applied in-process."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
