"""States of earlier versions still resume exactly (issue 16: the state format's version bump).

`tests/data/states_v2.json` holds version 2 states written by the code before the stage
protocol (93f913d), over the golden corpus (tests/test_golden.py): bfd early and late in the
run, and concat. Each is migrated on load and must continue exactly as an uninterrupted run of
today's code, which test_golden pins to the same batches as that older code.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from pipeline.feed import StepFeed
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.state.resume import STATE_VERSION, StateError, check_state, migrate, seal
from tests.conformance import batch_bytes
from tests.test_golden import _config, _corpus

V2 = json.loads((Path(__file__).parent / "data" / "states_v2.json").read_text())


def _cfg(tmp_path, mode: str):
    cfg = _config(tmp_path)
    if mode == "concat":
        cfg = parse_config(cfg.model_dump(mode="json") | {"packing": {"mode": "concat"}})
    return cfg


def _as_written_here(state: dict, cfg) -> dict:
    """The fixture's config hash covers the corpus paths of the machine that wrote it: put
    this run's in, and seal again (what a user who moved their corpus would not need)."""
    state = copy.deepcopy(state)
    state["config_hash"] = cfg.config_hash()
    return seal(state)


@pytest.mark.parametrize("name", ["bfd", "bfd_late", "concat"])
def test_a_version_2_state_resumes_exactly(tmp_path, name):
    _corpus(tmp_path)
    cfg = _cfg(tmp_path, name.split("_")[0])
    old = _as_written_here(V2[name], cfg)
    straight = StepFeed(cfg, executor=iter_blocks_local)
    want = [batch_bytes(straight.next_step()) for _ in range(old["step"] + 6)][old["step"] :]
    resumed = StepFeed(cfg, executor=iter_blocks_local, state=old)
    assert resumed.step == old["step"]
    assert resumed.get_state()["version"] == STATE_VERSION
    assert [batch_bytes(resumed.next_step()) for _ in range(6)] == want
    # The migrated state is the state today's code writes at that step, but for the window
    # positions: version 2 kept the read position before a window's rejects, version 3 after.
    s1, s2 = straight.summary(), resumed.summary()
    assert (s1.real_tokens, s1.rows, s1.steps) == (s2.real_tokens, s2.rows, s2.steps)


def test_a_version_1_state_without_digest_still_loads_checked_field_by_field(tmp_path):
    _corpus(tmp_path)
    cfg = _cfg(tmp_path, "bfd")
    legacy = {k: v for k, v in _as_written_here(V2["bfd_late"], cfg).items() if k != "digest"}
    legacy["version"] = 1
    migrated = check_state(legacy, cfg.config_hash(), list(cfg.streams), False, "bfd")
    assert migrated["version"] == STATE_VERSION
    legacy["streams"]["code"]["restart"] = [0, 1]
    with pytest.raises(StateError, match="streams.code.restart must have 8 entries"):
        check_state(legacy, cfg.config_hash(), list(cfg.streams), False, "bfd")
    del legacy["mixer"]
    with pytest.raises(StateError, match="version 1 is malformed"):
        migrate(legacy, "bfd")
