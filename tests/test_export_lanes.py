"""A laned export whose lane's process dies mid-run (SIGKILL: the OOM killer, a lost node)
starts the lane again from its state, as `serve` does, and writes the bytes of a run nothing
killed: every step file, every state file, no file left aside."""

from __future__ import annotations

import os
import signal

import pytest

from pipeline.read.resolve import parse_config
from tests.conftest import stdlib_texts, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def streams(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("export-lanes")
    texts = stdlib_texts(40, max_bytes=3000)
    write_jsonl(d / "code.jsonl", texts[:25])
    write_jsonl(d / "prose.jsonl", [{"text": t} for t in texts[25:]])
    return {
        "code": {"paths": [str(d / "code.jsonl")], "weight": 0.6, "repeat": 40},
        "prose": {"paths": [str(d / "prose.jsonl")], "weight": 0.4, "repeat": 40},
    }


def files_of(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "summary.json"}


@pytest.mark.parametrize(("world", "kills"), [(2, {12: 1}), (2, {8: 0, 30: 1}), (1, {12: 1})])
def test_a_laned_exports_lane_killed_starts_again_and_writes_the_same_bytes(
    streams, ray_cluster, tmp_path, monkeypatch, world, kills
):
    """World 2: each lane writes its rank's files. World 1: the rank spans both lanes, and
    the export joins every step from the lanes' parts (LanedFeed.joined): a lane found dead
    there is started again too."""
    import ray

    import service.export as export
    from service.export import run_export

    cfg = parse_config({"seq_len": 128, "global_batch_size": 8, "lanes": 2, "streams": streams,
                        "read": {"first_block_bytes": 8 << 10, "block_bytes": 32 << 10}})  # fmt: skip
    steps = 48
    run_export(cfg, tmp_path / "whole", steps=steps, world_size=world, state_every=8)

    feeds = []
    laned = export.LanedFeed

    def keep(*args, **kw):
        feeds.append(laned(*args, **kw))
        return feeds[-1]

    monkeypatch.setattr(export, "LanedFeed", keep)
    killed: list[int] = []

    def progress(written: int, *_) -> None:
        for at, lane in kills.items():
            if written >= at and at not in killed:
                killed.append(at)
                pid = ray.get(feeds[0].lanes[lane].where, timeout=30)["pid"]
                os.kill(pid, signal.SIGKILL)

    run_export(cfg, tmp_path / "killed", steps=steps, world_size=world, state_every=8,
               progress=progress)  # fmt: skip
    assert killed == list(kills)
    assert [r["lane"] for r in feeds[0].restarted] == list(kills.values()), feeds[0].restarted
    whole, got = files_of(tmp_path / "whole"), files_of(tmp_path / "killed")
    assert sorted(got) == sorted(whole)  # no step file missing, none left aside (.lane)
    assert len([n for n in got if n.startswith("state-")]) == steps // 8
    for name in whole:
        assert got[name] == whole[name], name
