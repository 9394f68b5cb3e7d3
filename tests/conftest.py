"""Shared fixtures: one real local Ray cluster per test session, tiny real corpora."""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples every run (CI must not pass or fail by luck);
# HYPOTHESIS_PROFILE=explore draws fresh ones, as a search for new counterexamples.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("RAYON_NUM_THREADS", "1")
# A busy machine slows the suite evenly, never starves its Ray: Ray starts its workers at
# niceness 15, and beside a user's CPU-bound job at 0 (two busy loops on the 2 cores) each
# test's Ray worker got a few percent of a core while the test's own process kept its share;
# the slow tier went from 14 minutes to hours. The suite's Ray workers (every cluster its tests
# start inherits this) run at the niceness of the tests. No test measures time; the product
# keeps Ray's default, and the head start follows the setting (pipeline/read/headstart.py).
os.environ["RAY_worker_niceness"] = "0"  # noqa: SIM112 (Ray's own name)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Isolation: the suite never meets the user's own tokenmill. Each test process (each xdist
# worker too) has its own service records and cache (a `serve` the user runs, named
# `tokenmill`, or the user's TOKENMILL_CACHE, cannot change a result) and its own Ray temp
# folder, and nothing in the environment sends it to a cluster, a service or a port of the
# user's. Tests that need one of these set it themselves.
#
# A process a test starts imports this file too (a Ray worker unpickling a test's function, a
# driver run with the checkout on its path). It keeps the folder and the environment its test
# process gave it (a test may send it to a cluster on purpose) and leaves the folder to that
# process to remove: such processes are killed with their cluster, past any `atexit`, and
# each one that made a folder of its own left it behind, empty. A child is told from an xdist
# worker by the worker's id: xdist's workers inherit the controller's environment.
_OWNER = os.environ.get("PYTEST_XDIST_WORKER", "controller")
_owner, _, _folder = os.environ.get("TOKENMILL_TEST_FOLDER", "").partition(":")
if _owner == _OWNER and _folder and Path(_folder).is_dir():
    ISOLATED = Path(_folder)
else:
    ISOLATED = Path(tempfile.mkdtemp(prefix="tmt", dir="/tmp"))  # short: Ray's AF_UNIX paths
    os.environ["TOKENMILL_TEST_FOLDER"] = f"{_OWNER}:{ISOLATED}"
    os.environ["TOKENMILL_CACHE"] = str(ISOLATED / "cache")
    os.environ["RAY_TMPDIR"] = str(ISOLATED)
    for _key in ("RAY_ADDRESS", "TOKENMILL_RAY_ADDRESS", "TOKENMILL_SERVICE", "TOKENMILL_PORT",
                 "TOKENMILL_HOST", "TOKENMILL_API_TOKEN", "TOKENMILL_API_TOKEN_FILE",
                 "TOKENMILL_TIMEOUT_S", "TOKENMILL_OBJECT_STORE_BYTES", "RAY_AUTH_MODE"):  # fmt: skip
        os.environ.pop(_key, None)
    atexit.register(shutil.rmtree, ISOLATED, ignore_errors=True)


# The default tokenizer's built files (cl100k converted to tokenizer.json, the fast engine's
# proofs), made once for every test process that runs from this venv: both tiers and every
# xdist worker copy them (a few MB) into their own cache instead of building them (~15 CPU-s
# each). Their names carry the content and library versions they were built from, as in a
# user's cache; a venv that cannot be written to builds them in the process's own cache.
BUILT = Path(sys.prefix) / "tokenmill-test-cache"


def _built(src: Path) -> bool:
    return any(src.glob("cl100k_base-*/tokenizer.json")) and (src / "fast_proofs").is_dir()


def _build(cache: Path) -> None:
    from pipeline.config import TokenizerConfig
    from pipeline.tokenize.engines import load_tokenizer

    before = os.environ.get("TOKENMILL_CACHE")
    os.environ["TOKENMILL_CACHE"] = str(cache)
    try:
        load_tokenizer(TokenizerConfig())
    finally:
        if before is None:
            os.environ.pop("TOKENMILL_CACHE", None)
        else:
            os.environ["TOKENMILL_CACHE"] = before


def warm_cache() -> Path:
    """This test process's TOKENMILL_CACHE, with the default tokenizer's built files in it.
    A cold cache costs every process that loads the tokenizer ~15 CPU-s (measured: 3 s
    importing transformers' converter, 3 s converting, 9 s of proofs), and the processes a
    test starts together (a serve, its lanes, an export) each pay it: on two cores, a large
    share of the slow tier. What a cold cache does is tested where it is the subject
    (test_tokenizer_loading.py, test_chat.py)."""
    src = ISOLATED / "cache"
    if _built(src):
        return src
    try:
        BUILT.mkdir(exist_ok=True)
        lock = open(BUILT / ".lock", "w")  # noqa: SIM115  # held while one process builds
    except OSError:
        _build(src)
        return src
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _built(BUILT):
            _build(BUILT)
    _copy_built(BUILT, src)
    return src


def _copy_built(src: Path, dst: Path) -> None:
    """The tokenizer's built files of cache `src` into cache `dst`; never its service records."""
    for entry in src.iterdir():
        if entry.is_dir() and entry.name != "services":
            shutil.copytree(entry, dst / entry.name, dirs_exist_ok=True)


def fresh_cache(path: Path) -> Path:
    """A new TOKENMILL_CACHE at `path` for a test's own processes: no service record in it,
    the tokenizer's built files copied from `warm_cache()`."""
    src = warm_cache()
    path.mkdir(parents=True, exist_ok=True)
    _copy_built(src, path)
    return path


STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_texts(n: int, start: int = 0, max_bytes: int = 20_000) -> list[str]:
    """`n` real Python sources from the standard library, deterministic."""
    out = []
    for p in sorted(STDLIB.glob("*.py"))[start:]:
        text = p.read_text(encoding="utf-8", errors="replace")[:max_bytes]
        if text.strip():
            out.append(text)
        if len(out) == n:
            break
    return out


def write_jsonl(path: Path, records, field: str = "text") -> Path:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({field: r} if isinstance(r, str) else r) + "\n")
    return path


# Tiers. A test is `slow` when it is marked so or uses a fixture that starts a Ray cluster,
# a process of Ray's, a browser, an object store server or a copy of the checkout (through any
# other fixture too: pytest's `fixturenames` is the closure); every other test is `fast`,
# in-process, the tier to run before each commit (`./dev test fast`). Derived from the
# fixtures at collection, so a new test lands in its tier by itself.
SLOW_FIXTURES = frozenset({"ray_cluster", "foreign", "head", "clone", "browser",
                           "endpoint"})  # fmt: skip


# The slow tier's longest files, longest first: their CPU seconds run one at a time on this
# 2-core machine (the slow tier is CPU-bound: both cores 97-99% busy), or their wall in CI
# where they mostly wait (test_stop.py, test_liveness.py). The xdist workers take whole files
# in this order (`./dev test` passes --no-loadscope-reorder: xdist's default puts the files
# with the most tests first), so the short ones fill in at the end (LPT scheduling):
# otherwise one worker ran the last long file alone for minutes.
LONGEST_FIRST = ("test_lanes.py", "test_trainer_service.py", "test_swift.py",
                 "test_adapters_torchrun.py", "test_autoscale.py", "test_demand.py",
                 "test_ranks.py", "test_cluster.py", "test_adapters_raytrain.py", "test_hosts.py",
                 "test_stop.py", "test_export_lanes.py", "test_nodes.py", "test_job_submit.py",
                 "test_liveness.py", "test_end_of_data.py", "test_page.py", "test_titan.py",
                 "test_faults.py", "test_concurrent.py", "test_serve.py", "test_adapters.py",
                 "test_policy.py", "test_operators.py", "test_export.py", "test_placing.py")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        if slow or not SLOW_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
            if not slow:
                item.add_marker(pytest.mark.slow)
        else:
            item.add_marker(pytest.mark.fast)
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: files stay whole


@pytest.fixture(scope="session", autouse=True)
def _tokenizer_built():
    """Every test process finds the default tokenizer built in its cache (`warm_cache`)."""
    warm_cache()


TEST_SLOTS = 2  # `tokenmill_test_slot` resources of the session's cluster (test_placing.py)


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray, shared by the session, with a capped object store."""
    import ray

    from client.cluster import connect

    warm_cache()  # before the cluster's workers, which inherit this process's cache, load it
    # TEST_SLOTS of a custom resource, for the tests that place actors by resources.
    started = connect(object_store_memory=256 << 20, num_cpus=2,
                      resources={"tokenmill_test_slot": TEST_SLOTS})  # fmt: skip
    yield ray
    from trainer.feed import stop_beats

    stop_beats()  # no rank's beat thread calls into a Ray that is shutting down
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def torch_one_thread():
    """Tiny models: one intra-op thread is fastest and does not fight a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    from pipeline.config import TokenizerConfig
    from pipeline.tokenize.engines import load_tokenizer

    return load_tokenizer(TokenizerConfig())


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Three JSONL files of real source text, with one bad line in the middle file."""
    d = tmp_path / "corpus"
    d.mkdir()
    texts = stdlib_texts(30)
    write_jsonl(d / "a.jsonl", texts[:10])
    lines = [json.dumps({"text": t}) for t in texts[10:20]]
    lines.insert(4, "{broken json")
    (d / "b.jsonl").write_text("\n".join(lines) + "\n")
    write_jsonl(d / "c.jsonl", texts[20:])
    return d
