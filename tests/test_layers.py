"""The floors check of `./dev lint` (dev-extras/layers.py) passes on the house and fails on an
upward import or a circle, wherever in a file it stands."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "dev-extras" / "layers.py"


def run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True, text=True)


def house(tmp_path: Path) -> Path:
    for top in ("wire", "client", "pipeline", "service", "trainer", "bench"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_house_keeps_its_floors():
    r = run(ROOT)
    assert r.returncode == 0, r.stdout
    assert "no upward import, no circle" in r.stdout


def test_an_upward_import_inside_a_function_fails(tmp_path):
    root = house(tmp_path)
    cfg = root / "pipeline" / "config.py"
    cfg.write_text(cfg.read_text() + "\n\ndef _late():\n    from pipeline.feed import StepFeed\n")
    r = run(root)
    assert r.returncode == 1
    assert (
        "pipeline/config.py:" in r.stdout
        and "imports pipeline.feed from a higher floor" in r.stdout
    )
    assert "import circle" in r.stdout  # feed imports config: a circle too


def test_a_circle_on_one_floor_fails(tmp_path):
    root = house(tmp_path)
    shuffle = root / "pipeline" / "stages" / "shuffle.py"
    shuffle.write_text(shuffle.read_text() + "\nfrom pipeline.stages.documents import DocSource\n")
    r = run(root)
    assert r.returncode == 1
    assert "pipeline.stages.documents -> pipeline.stages.shuffle" in r.stdout
    assert "pipeline.stages.shuffle -> pipeline.stages.documents" in r.stdout


def test_the_wire_imports_nothing_above_it(tmp_path):
    root = house(tmp_path)
    proto = root / "wire" / "protocol.py"
    proto.write_text(
        proto.read_text()
        + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from client.cluster import client_address\n"
    )
    r = run(root)
    assert r.returncode == 1 and "wire/protocol.py:" in r.stdout


def test_a_rank_loading_the_service_class_imports_no_pipeline():
    """A rank's `ray.get_actor` loads the BatchServer class, importing service/batch_server.py in
    the rank: the pipeline (and pydantic) are imported where the actor uses them, not there."""
    import subprocess
    import sys

    code = (
        "import sys, service.batch_server; "
        "print(sorted(m for m in ('pipeline.config', 'pipeline.feed', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_trainer_stands_on_the_wire_and_the_client_only(tmp_path):
    root = house(tmp_path)
    feed = root / "trainer" / "feed.py"
    feed.write_text(
        feed.read_text() + "\n\ndef _late():\n    from service.serve import run_status\n"
    )
    r = run(root)
    assert r.returncode == 1
    assert (
        "trainer/feed.py:" in r.stdout
        and "trainer stands on wire, client, trainer only" in r.stdout
    )
