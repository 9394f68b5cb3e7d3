"""Hostile resume states (SPEC M7, M13): a corrupted, hand-edited or malformed state is
refused with a message naming the problem; an intact one resumes exactly."""

import contextlib
import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.feed import StepFeed
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import parse_config
from pipeline.state.resume import StateError, check_state, digest, seal
from tests.conftest import stdlib_texts, write_jsonl


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run: the state after step 3 and the batches of steps 3..6."""
    d = tmp_path_factory.mktemp("states")
    write_jsonl(d / "a.jsonl", stdlib_texts(8, max_bytes=1500))
    write_jsonl(d / "b.jsonl", stdlib_texts(8, start=30, max_bytes=1500))
    cfg = parse_config({"seed": 3, "seq_len": 64, "global_batch_size": 2, "shuffle": {"window": 3},
                        "packing": {"mode": "bfd", "buffer": 8},
                        "streams": {"a": {"paths": [str(d / "a.jsonl")], "weight": 0.6},
                                    "b": {"paths": [str(d / "b.jsonl")], "weight": 0.4}}})  # fmt: skip
    feed = StepFeed(cfg, executor=iter_blocks_local)
    for _ in range(3):
        feed.next_step()
    state = json.loads(json.dumps(feed.get_state()))
    after = [feed.next_step() for _ in range(4)]
    feed.close()
    return cfg, state, after


def resumes_exactly(cfg, state, after) -> None:
    feed = StepFeed(cfg, executor=iter_blocks_local, state=state)
    try:
        for want in after:
            assert feed.next_step().equals(want)
    finally:
        feed.close()


def names(cfg):
    return list(cfg.streams)


def test_an_intact_state_resumes_exactly_and_is_a_few_kb(run):
    cfg, state, after = run
    assert state["version"] == 3 and state["digest"] == digest(state)
    assert len(json.dumps(state)) < 8_000
    resumes_exactly(cfg, state, after)


def source_of(state, name):
    """A stream's DocSource state, nested in the packer's and the shuffle window's."""
    return state["packer"]["streams"][name]["input"]["input"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: source_of(s, "a")["position"].__setitem__(2, -1), "digest does not match"),
        (lambda s: s["feed"].__setitem__("finished", True), "digest does not match"),
        (lambda s: s.__setitem__("digest", "0" * 64), "digest does not match"),
        (lambda s: s.pop("digest"), "digest does not match"),
    ],
)
def test_an_edited_state_is_refused_by_its_digest(run, edit, message):
    cfg, state, _ = run
    bad = copy.deepcopy(state)
    edit(bad)
    with pytest.raises(StateError, match=message):
        check_state(bad, cfg.config_hash(), names(cfg), False)


MIXER = ("packer", "mixer")


def at(state, *path):
    for key in path:
        state = state[key]
    return state


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda s: source_of(s, "a")["position"].__setitem__(2, -1),
            r"packer.streams.a.input.input.position must be integers >= 0",
        ),
        (
            lambda s: source_of(s, "a").__setitem__("position", [0, 1]),
            r"packer.streams.a.input.input.position must have 6 entries",
        ),
        (
            lambda s: s["packer"]["streams"]["a"]["input"].__setitem__("window", "x"),
            r"packer.streams.a.input.window must be int",
        ),
        (lambda s: at(s, *MIXER, "target").__setitem__("a", float("nan")), "not plain JSON|bad"),
        (lambda s: at(s, *MIXER, "placed").__setitem__("b", -5), r"packer.mixer.placed has bad"),
        (lambda s: at(s, *MIXER, "placed").pop("b"), r"packer.mixer.placed must name"),
        (lambda s: s.__setitem__("step", -1), "step must be >= 0"),
        (lambda s: s["feed"].__setitem__("finished", "yes"), "feed.finished must be bool"),
        (lambda s: s["packer"].pop("mixer"), "packer.mixer is missing"),
        (lambda s: s["packer"]["streams"].pop("b"), "streams"),
        (lambda s: s["packer"].pop("rows"), "packing 'concat', this config packs 'bfd'"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_field_even_when_resealed(run, edit, message):
    cfg, state, _ = run
    bad = copy.deepcopy(state)
    edit(bad)
    with contextlib.suppress(ValueError):  # NaN is not JSON: refused either way
        seal(bad)  # a buggy writer: the digest fits, the content does not
    with pytest.raises(StateError, match=message):
        check_state(bad, cfg.config_hash(), names(cfg), False, cfg.packing.mode)


@pytest.mark.parametrize("bad", [None, [], "state", 3])
def test_a_state_that_is_not_an_object_is_refused(run, bad):
    cfg, _, _ = run
    with pytest.raises(StateError, match="must be a JSON object"):
        check_state(bad, cfg.config_hash(), names(cfg), False)


def leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, (*path, k))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from leaves(v, (*path, i))
    else:
        yield path


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=5), st.lists(st.integers(-3, 3), max_size=9),
)  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_every_mutation_is_refused_or_resumes_exactly(run, data):
    """Corruption: one value anywhere replaced by another. (A writer that re-seals what it
    edited makes a different state, checked field by field above.)"""
    cfg, state, after = run
    paths = sorted(leaves(state), key=repr)
    path = data.draw(st.sampled_from(paths))
    bad = copy.deepcopy(state)
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = data.draw(VALUES)
    try:
        check_state(bad, cfg.config_hash(), names(cfg), False)
        feed = StepFeed(cfg, executor=iter_blocks_local, state=bad)
    except (StateError, ValueError):
        return  # refused, with a message
    try:
        for want in after:
            assert feed.next_step().equals(want), f"mutating {path} resumed into other data"
    finally:
        feed.close()


def _typed(value):
    """A value with the type of every part of it: equal only if a JSON round trip kept them
    all (a tuple, an int key or a float that JSON turns into something else is not)."""
    if isinstance(value, dict):
        return ("dict", sorted((_typed(k), _typed(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, [_typed(v) for v in value])
    return (type(value).__name__, value)


@pytest.mark.parametrize("mode", ["bfd", "concat"])
def test_a_kept_state_unpacks_to_the_state_with_its_types(tmp_path, mode):
    """The batch server keeps a state as its JSON text (`Kept`) and hands out what that text
    parses to, not the dict the feed built: every stage's state must come back from JSON as
    it was, types included (a tuple would come back a list, an int key a string), with a
    mixture change, a chat stream and the end of the data on the way."""
    code = write_jsonl(tmp_path / "a.jsonl", stdlib_texts(10, max_bytes=3_000))
    chats = [{"messages": [{"role": "user", "content": t[:60]},
                           {"role": "assistant", "content": t[:400]}]}
             for t in stdlib_texts(10, start=40, max_bytes=3_000)]  # fmt: skip
    chat = write_jsonl(tmp_path / "c.jsonl", chats)
    cfg = parse_config({"seed": 5, "seq_len": 128, "global_batch_size": 2,
                        "shuffle": {"window": 4}, "packing": {"mode": mode},
                        "schedule": [{"step": 2, "weights": {"code": 0.2, "chat": 0.8}}],
                        "streams": {"code": {"paths": [str(code)], "weight": 0.7},
                                    "chat": {"paths": [str(chat)], "kind": "chat",
                                             "weight": 0.3}}})  # fmt: skip
    feed = StepFeed(cfg, executor=iter_blocks_local)
    seen = 0
    while True:
        kept, state = feed.kept_state(), feed.get_state()
        assert _typed(kept.unpack()) == _typed(state), feed.step
        assert kept.digest == state["digest"] == digest(kept.unpack())
        seen += 1
        if not feed.steps(1):
            break
    feed.close()
    assert seen > 4


def test_a_kept_laned_state_is_the_sealed_nest_of_its_lanes(tmp_path):
    """The batch server keeps each step's state as JSON text (`Kept`), a laned one nested
    from its lanes' kept states without decoding them (`nest_kept`): unpacked, it is the
    state a nest of the lanes' dicts seals to, digest included, and it resumes as one."""
    from pipeline.state.resume import (
        CONFIG_HASH,
        LANES,
        STATE_VERSION,
        STEP,
        VERSION,
        check_laned_state,
        nest_kept,
        seal,
    )  # fmt: skip
    from tests.conftest import stdlib_texts, write_jsonl

    src = write_jsonl(tmp_path / "a.jsonl", stdlib_texts(8, max_bytes=4_000))
    cfg = parse_config({"seq_len": 128, "global_batch_size": 4, "lanes": 2,
                        "streams": {"a": {"paths": [str(src)]}}})  # fmt: skip
    lanes = [StepFeed(cfg, executor=iter_blocks_local, lane=k) for k in range(2)]
    for feed in lanes:
        feed.steps(3)
    states = [feed.get_state() for feed in lanes]
    kept_lanes = [feed.kept_state() for feed in lanes]  # sealed and kept in one encoding
    for kept_lane, state in zip(kept_lanes, states, strict=True):
        assert kept_lane.unpack() == state and kept_lane.digest == state["digest"]
    want = seal({VERSION: STATE_VERSION, CONFIG_HASH: cfg.config_hash(), STEP: 3,
                 LANES: states})  # fmt: skip
    kept = nest_kept(STATE_VERSION, cfg.config_hash(), kept_lanes)
    assert kept.step == 3 and kept.digest == want["digest"]
    assert kept.unpack() == want
    names = list(cfg.streams)
    got = check_laned_state(kept.unpack(), cfg.config_hash(), names, False, cfg.packing.mode, 2)
    assert got == states
