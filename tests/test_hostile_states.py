"""Hostile states and an unbounded mixture history (issue 24, findings 6 and 7).

A state that is not an object is refused, never read as "no state". The seal is a keyless
SHA-256 (pipeline/state/resume.py `SEAL`): it detects corruption, not tampering, so a state edited
and re-sealed by hand is checked for what a run can be in, and refused when it holds
duplicate pool entries or positions out of bounds. The mixture history stays bounded however
many weight changes arrive, and a resume continues exactly.
"""

import contextlib
import copy
import json

import pytest

from pipeline.feed import StepFeed
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.stages.mixing import HISTORY_PAST
from pipeline.state.resume import SEAL, StateError, check_state, digest, load_state, seal
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient


def _cfg(d, mode="bfd"):
    write_jsonl(d / "a.jsonl", stdlib_texts(8, max_bytes=1500))
    write_jsonl(d / "b.jsonl", stdlib_texts(8, start=30, max_bytes=1500))
    return parse_config({"seed": 3, "seq_len": 64, "global_batch_size": 2, "shuffle": {"window": 3},
                         "packing": {"mode": mode, "buffer": 8},
                         "streams": {"a": {"paths": [str(d / "a.jsonl")], "weight": 0.6},
                                     "b": {"paths": [str(d / "b.jsonl")], "weight": 0.4}}})  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny bfd run: the state after step 3 and the batches of steps 3..6."""
    cfg = _cfg(tmp_path_factory.mktemp("hostile_states"))
    feed = StepFeed(cfg, executor=iter_blocks_local)
    for _ in range(3):
        feed.next_step()
    state = json.loads(json.dumps(feed.get_state()))
    after = [feed.next_step() for _ in range(4)]
    feed.close()
    return cfg, state, after


def _check(cfg, state):
    return check_state(state, cfg.config_hash(), list(cfg.streams), False, cfg.packing.mode,
                       cfg.global_batch_size)  # fmt: skip


# --- 6a. a file holding null (or any JSON that is not an object) -------------------------------


@pytest.mark.parametrize("text", ["null", "[]", "3", '"state"', "true"])
def test_a_resume_file_that_is_not_an_object_is_refused_naming_the_file(tmp_path, text):
    path = tmp_path / "state.json"
    path.write_text(text)
    with pytest.raises(StateError, match=r"state\.json: a resume state must be a JSON object"):
        load_state(str(path))


def test_a_resume_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "state.json"
    path.write_text('{"step": ')
    with pytest.raises(StateError, match="cannot read the state"):
        load_state(str(path))


def test_a_resume_file_holding_a_state_reads_it(run, tmp_path):
    cfg, state, _ = run
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    assert _check(cfg, load_state(str(path))) == state


# --- 6b. edited and re-sealed: the digest cannot tell, the content checks can --------------------


def _stream(state, name="a"):
    return state["packer"]["streams"][name]


def _dup_pool(s):
    pool = _stream(s)["pool"]
    pool[-1] = pool[-2]  # one held piece twice, the last one lost: 1 document skipped


def _mixer(s):
    return s["packer"]["mixer"]


EDITS = {
    "duplicate pool entry": (_dup_pool, r"packer.streams.a.pool must be strictly increasing"),
    "pool entry repeated at the end": (
        lambda s: _stream(s)["pool"].append(_stream(s)["pool"][-1]),
        r"packer.streams.a.pool must be strictly increasing",
    ),
    "pool entry at arrivals": (
        lambda s: _stream(s)["pool"].append(_stream(s)["arrivals"]),
        r"packer.streams.a.pool must lie within base",
    ),
    "base past the first held piece": (
        lambda s: _stream(s).__setitem__("base", _stream(s)["pool"][0] + 1),
        r"packer.streams.a.pool must lie within base",
    ),
    "empty pool, base short of arrivals": (
        lambda s: _stream(s).__setitem__("pool", []),
        r"packer.streams.a.base must equal arrivals",
    ),
    "offset past the window": (
        lambda s: _stream(s)["input"].__setitem__("offset", 9),  # window 0 holds <= 8
        r"packer.streams.a.input.offset 9 is past the end of window 0",
    ),
    "half-set read mark": (
        lambda s: _stream(s)["input"]["input"].__setitem__("reported", [0, -1, 2]),
        r"reported must be unset",
    ),
    "history out of order": (
        lambda s: _mixer(s)["history"].insert(0, {"step": 2, "weights": {"a": 1.0}, "source": "x"}),
        r"history must hold the weight changes in step order",
    ),
    "mixer step past the state's": (
        lambda s: _mixer(s).__setitem__("step", s["step"] + 1),
        r"packer.mixer.step 4 must be within",
    ),
    "weights not shares": (
        lambda s: _mixer(s)["weights"].__setitem__("a", 5.0),
        r"packer.mixer.weights are shares, their sum is 5.4",
    ),
    "exhausted not strings": (
        lambda s: _mixer(s).__setitem__("exhausted", [3]),
        r"exhausted must be a list of strings",
    ),
    "rows differ": (
        lambda s: s["packer"].__setitem__("rows", s["packer"]["rows"] + 1),
        r"packer.rows 7 must equal feed.rows 6",
    ),
    "more placed than delivered": (
        lambda s: _mixer(s)["placed"].__setitem__("a", 10_000),
        r"packer.mixer.placed \(10128 tokens in all\) is more than feed.real_tokens",
    ),
    "version true": (lambda s: s.__setitem__("version", True), r"has version True"),
    "step 10**30": (lambda s: s.__setitem__("step", 10**30), r"step must be at most 2\*\*62"),
    "step past the rows made": (
        lambda s: s.__setitem__("step", 1 << 40),
        r"step 1099511627776 does not agree with feed.rows 6 \(2 rows a step\)",
    ),
    "step short of the rows made": (
        lambda s: s.__setitem__("step", 2),
        r"step 2 does not agree with feed.rows 6",
    ),
    "unknown key": (
        lambda s: s.__setitem__("steps", 3),
        r"the state has unknown key\(s\) \['steps'\]",
    ),
    "unknown mixer key": (
        lambda s: _mixer(s).__setitem__("weight", {"a": 1.0}),
        r"packer.mixer has unknown key\(s\) \['weight'\]",
    ),
    "unknown stream key": (
        lambda s: _stream(s).__setitem__("consumed", 0),
        r"packer.streams.a has unknown key\(s\) \['consumed'\]",
    ),
}


def _paths(obj, at=()):
    """Every (container, key) of a JSON tree, depth first."""
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for key, value in items:
        yield at + (key,)
        yield from _paths(value, at + (key,))


def test_any_field_deleted_or_of_another_type_is_a_state_error(run):
    """Every failure of a state, at every field, is a StateError (the message names the field),
    never a KeyError, TypeError or IndexError from deep inside a stage."""
    cfg, state, _ = run
    tried = 0
    for path in list(_paths(state)):
        if path == ("digest",):
            continue
        for value in (None, "x", -1, 2.5, True, [], {}, [1, 2], {"k": 1}, "delete"):
            bad = copy.deepcopy(state)
            holder = bad
            for key in path[:-1]:
                holder = holder[key]
            if value == "delete":
                if isinstance(holder, list):
                    holder.pop(path[-1])
                else:
                    del holder[path[-1]]
            else:
                holder[path[-1]] = value
            seal(bad)
            tried += 1
            try:
                _check(cfg, bad)
            except StateError:
                continue
            # Accepted: it resumes, or the stages find that the data differ from what it says
            # (a position moved): a StateError too, never a crash.
            with contextlib.suppress(StateError):
                StepFeed(cfg, executor=iter_blocks_local, state=bad).close()
    assert tried > 500


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_impossible_state_resealed_by_hand_is_refused_naming_the_field(run, edit):
    cfg, state, _ = run
    change, message = EDITS[edit]
    bad = copy.deepcopy(state)
    change(bad)
    seal(bad)  # the digest is keyless: anyone can re-seal (SEAL)
    assert bad["digest"] == digest(bad) and SEAL == "sha256"
    with pytest.raises(StateError, match=message):
        _check(cfg, bad)
    with pytest.raises(StateError, match=message):
        StepFeed(cfg, executor=iter_blocks_local, state=bad)


# --- 7. the mixture history is bounded, and resume stays exact ---------------------------------


def _weights(i: int) -> dict[str, float]:
    return {"a": float(1 + i % 3), "b": float(1 + (i * 7) % 5)}


def _hammer(feed, start: int, stop: int, per_step: int = 417) -> tuple[list, list]:
    """Steps `start`..`stop`-1, each after `per_step` weight changes at the next step (as PUTs
    make them): the state before each step, and the steps."""
    states, batches = [], []
    for step in range(start, stop):
        for i in range(step * per_step, (step + 1) * per_step):
            feed.set_weights(_weights(i))
        states.append(json.loads(json.dumps(feed.get_state())))
        batches.append(feed.next_step().to_pydict())
    return states, batches


def test_many_weight_changes_keep_the_history_bounded_and_the_schedule_exact(tmp_path):
    """5,004 changes over 12 steps: the batches equal a run given only the last change of each
    step, the history and the state stay small, and a resume continues exactly."""
    cfg = _cfg(tmp_path, mode="concat")
    hammered, reference = (
        StepFeed(cfg, executor=iter_blocks_local),
        StepFeed(cfg, executor=iter_blocks_local),
    )
    try:
        states, batches = _hammer(hammered, 0, 12)
        want = []
        for step in range(12):
            reference.set_weights(_weights((step + 1) * 417 - 1))
            want.append(reference.next_step().to_pydict())
        assert batches == want
        history = hammered.mixer.history
        assert len(history) <= HISTORY_PAST + 2, len(history)
        assert hammered.mixer.history_dropped == 12 * 417 + 1 - len(history)
        assert history[-1].weights == _weights(12 * 417 - 1)  # the change in effect now
        size = len(json.dumps(hammered.get_state()))
        assert size < 8_000, size
    finally:
        hammered.close()
        reference.close()
    for k in (3, 11):
        resumed = StepFeed(cfg, executor=iter_blocks_local, state=states[k])
        try:
            first = resumed.next_step().to_pydict()  # step k: its changes are in the state
            _, again = _hammer(resumed, k + 1, 12)
        finally:
            resumed.close()
        assert [first, *again] == batches[k:]


def test_a_resume_after_the_history_was_trimmed_continues_exactly(tmp_path):
    """Changes scheduled ahead (a config-like schedule), then many at the next step: the
    state after trimming resumes into the same steps, changes still to come included."""
    cfg = _cfg(tmp_path, mode="bfd")
    feed = StepFeed(cfg, executor=iter_blocks_local)
    try:
        for step in range(15):
            feed.set_weights(_weights(step))
            assert feed.next_step() is not None or feed.finished
            if feed.finished:
                break
        mid = feed.step
        feed.set_weights(_weights(1000), effective_step=mid + 2)
        state = json.loads(json.dumps(feed.get_state()))
        straight = [feed.next_step() for _ in range(4)]
        assert len(feed.mixer.history) <= HISTORY_PAST + 2
    finally:
        feed.close()
    assert state["packer"]["mixer"]["history_dropped"] > 0
    resumed = StepFeed(cfg, executor=iter_blocks_local, state=state)
    try:
        again = [resumed.next_step() for _ in range(4)]
    finally:
        resumed.close()
    assert [b and b.to_pydict() for b in again] == [b and b.to_pydict() for b in straight]


def test_a_state_taken_right_after_a_resume_that_removed_a_stream_is_accepted(run, tmp_path):
    """The service records the state of its first step at start: after a resume that removed
    a stream, its weights are shares that sum to less than 1 until the next step begins. The
    content checks take what a writer can produce."""
    cfg, state, _ = run
    only_a = parse_config(
        cfg.model_dump(mode="json") | {"streams": {"a": cfg.streams["a"].model_dump(mode="json")}}
    )
    feed = StepFeed(only_a, executor=iter_blocks_local, state=state, allow_config_change=True)
    try:
        first = json.loads(json.dumps(feed.get_state()))
        after = [feed.next_step() for _ in range(2)]
    finally:
        feed.close()
    assert sum(first["packer"]["mixer"]["weights"].values()) < 1
    _check(only_a, first)
    resumed = StepFeed(only_a, executor=iter_blocks_local, state=first)
    try:
        assert all(resumed.next_step().equals(want) for want in after)
    finally:
        resumed.close()


def test_export_resume_from_a_file_holding_null_fails_and_names_the_file(run, tmp_path):
    import subprocess
    import sys

    import yaml

    cfg, _, _ = run
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    (tmp_path / "null.json").write_text("null")
    args = [sys.executable, "-m", "service", "export", "--config", str(tmp_path / "c.yaml"),
            "--out", str(tmp_path / "out"), "--steps", "2", "--local",
            "--resume", str(tmp_path / "null.json")]  # fmt: skip
    r = subprocess.run(args, capture_output=True, text=True, timeout=patient(300))
    assert r.returncode != 0, r.stdout
    assert "null.json" in r.stderr and "must be a JSON object" in r.stderr, r.stderr
    assert not (tmp_path / "out" / "step-00000000-rank-0.parquet").exists()
