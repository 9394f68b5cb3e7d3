"""Resumable states on disk and over the wire: sealed with a digest, validated on load.

A state is a few KB of human-readable JSON (pipeline/feed.py builds it). Trainer checkpoints,
`GET /v1/state` and `export --state-every` hand it around, and people edit files. A corrupted
or malformed state must never resume "successfully" into wrong data (a negative cursor once
repeated 14 served documents and skipped 29), so a state is checked in two ways.

**The seal detects corruption, not tampering** (`SEAL`). `seal` adds
`digest`, a plain SHA-256 over the state's canonical JSON (sorted keys, no spaces), with no
key: a byte flipped on disk, a truncated copy or an edit made without re-sealing is refused,
but anyone can recompute the digest, so a state edited *and re-sealed* passes it. An HMAC
with a key the service holds would make states unforgeable, but the states an export or a
trainer checkpoint holds must resume on other machines, under other processes, days later:
the key would have to be configured everywhere a run resumes, or travel with the states
(where it authenticates nothing). A state is the user's own checkpoint, so what it may hold
is checked instead:

- Every field is checked for type and bounds (counts and positions are non-negative
  integers, shares are finite, per-stream mappings name the state's streams).
- And for what a writer can produce (`_check_consistent`): the bfd pool's arrival numbers
  are strictly increasing (no duplicates) within [`base`, `arrivals`), a window's offset is
  within its window, the read mark is unset or a position, the mixture history is in step
  order with a change in effect, the mixer's step is not past the state's, the weights are
  shares (at most 1 in all), the feed's rows are the packer's and its tokens at least the
  mixer's.

A state that passes both resumes into the run it describes: an impossible one (duplicate
pool entries, a position out of bounds) is refused with the field's path; a possible one that
someone re-sealed by hand resumes into the run that state describes, which is the editor's.

Layout (version 3): each stage's state nests its input's (pipeline/stages/stage.py), per stream by
name, with the keys as constants in the stages' modules:

    {version, config_hash, step, digest,
     feed: {rows, real_tokens, docs_emitted: {name: n}, finished},
     packer: {finished, [rows], mixer: {history, [history_dropped], target, placed, alive,
                                         weights, ...},
              [skips: {docs: {name: [id]}, met: {name: [id]}, log}],
              streams: {name: {done, counters, consumed | base, arrivals, pool,
                               input: {window, offset, epoch,            (WindowShuffle)
                                       input: {position, reported}}}}}}  (DocSource)

Versions 1 (no digest) and 2 (per-stream lists in config order) are migrated on load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields

from pipeline.stages import documents as doc_keys
from pipeline.stages import mixing as mixing_keys
from pipeline.stages import packing as packing_keys
from pipeline.stages import shuffle as shuffle_keys
from pipeline.stages.packing import PackCounters
from pipeline.stages.policy import LOSSES as POLICY_LOSSES
from pipeline.stages.positions import SourcePos
from pipeline.stages.stage import StateError as StateError  # re-exported: its usual home
from wire.protocol import is_int

POSITION_FIELDS = len(fields(SourcePos))
PACK_COUNTERS = [f.name for f in fields(PackCounters)]

STATE_VERSION = 3
# What the digest is: a keyless SHA-256 that detects corruption, not tampering; what
# a state may hold is validated instead (the module docstring says why not an HMAC).
SEAL = "sha256"
LEGACY_VERSIONS = (1, 2)  # migrated on load (`migrate`)

# StepFeed state keys (the stages' own keys are in their modules)
VERSION = "version"
CONFIG_HASH = "config_hash"
STEP = "step"
PACKER = "packer"
FEED = "feed"
ROWS = "rows"
REAL_TOKENS = "real_tokens"
DOCS_EMITTED = "docs_emitted"
FINISHED = "finished"
DIGEST = "digest"
LANES = "lanes"  # a laned feed's state: its lanes' states, in lane order (pipeline/lanes/)


def load_state(path: str) -> dict:
    """The state in the JSON file at `path`, which must hold an object (`null` is no state).

    What `--resume` reads: a file that is not JSON, or JSON that is not an object, is a
    StateError naming the file, never "no state" (which would start the run from step 0)."""
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise StateError(f"{path}: cannot read the state: {e}") from None
    if not isinstance(state, dict):
        raise StateError(
            f"{path}: a resume state must be a JSON object, got {type(state).__name__} (a "
            "state-N.json that `export --state-every` wrote, or the body of GET /v1/state)"
        )
    return state


def digest(state: dict) -> str:
    """The seal: SHA-256 of the canonical JSON. It detects corruption, not tampering: anyone can
    recompute it (`SEAL`).

    A laned state (`lanes: [...]`) is sealed over its lanes' digests, not their JSON: each lane's
    state is sealed and checked on its own (`check_laned_state`), so its digest stands for it,
    and the control, which seals a state of K lanes at every step, encodes K digests instead
    of K states (16 lanes: ~19 kB of JSON per step). A laned state sealed over its lanes'
    whole JSON (an older release's form) is accepted too (`_check_seal`)."""
    body = {k: v for k, v in state.items() if k != DIGEST}
    parts = body.get(LANES)
    if isinstance(parts, list):
        body[LANES] = [p.get(DIGEST) if isinstance(p, dict) else p for p in parts]
    return _sha(body)


def _sha(body: dict) -> str:
    return hashlib.sha256(_canonical(body).encode()).hexdigest()


def _canonical(body: dict) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)


def seal(state: dict) -> dict:
    state[DIGEST] = digest(state)
    return state


@dataclass(frozen=True)
class Kept:
    """A sealed state kept as its JSON text: what a service keeps for every recent step
    (service/producer.py `states`, up to 10,000) and a lane sends with each step it makes.

    Kept as dicts, a 16-lane service held ~800 Python objects per step, some 8M over its
    window of states: the cyclic garbage collector walked them all on its full passes, and
    unpickling the lanes' states as dicts fed it more. That was ~0.7 of the control actor's
    3.4 ms of CPU per step (16 lanes, 16 ranks, 2 cores, `bench.serve_ranks`: `gc.disable()`
    in the actor gave 2.7 ms). Kept, a state is three objects, and a dict again (`unpack`)
    only when asked for (a rank's resume, `GET /v1/state`, a seek, provenance): 2.3 ms."""

    step: int
    digest: str
    text: str  # the sealed state's JSON (with its digest)

    @classmethod
    def seal(cls, state: dict) -> Kept:
        """A feed's state (no `lanes`), sealed and kept in one encoding: the text is the
        canonical JSON the digest is of, with the digest added (`seal(state)`, kept, without
        encoding it twice: a lane seals a state at every step)."""
        assert LANES not in state, "a laned state is sealed over its lanes (nest_kept)"
        canonical = _canonical({k: v for k, v in state.items() if k != DIGEST})
        sealed = hashlib.sha256(canonical.encode()).hexdigest()
        return cls(int(state[STEP]), sealed, f'{canonical[:-1]},"{DIGEST}":"{sealed}"}}')

    def unpack(self) -> dict:
        return json.loads(self.text)


class Nested:
    """A laned state (`{version, config_hash, step, lanes: [...], digest}`) kept as its lanes'
    kept states, and sealed and joined (`kept`) only when asked for: the control keeps one
    for every step, and few are ever asked for (a rank's checkpoint, `GET /v1/state`, a seek).
    Sealed at every step, it was a sixth of the time the control held the GIL (16 lanes,
    16 ranks; py-spy --gil). It holds the lanes' digests and texts as tuples of strings,
    which the cyclic garbage collector leaves alone, not the lanes' Kept objects."""

    __slots__ = ("step", "_version", "_config_hash", "_digests", "_texts", "_kept")

    def __init__(self, version: int, config_hash: str, lanes: list[Kept]):
        self.step = lanes[0].step
        self._version, self._config_hash = version, config_hash
        self._digests: tuple[str, ...] | None = tuple(k.digest for k in lanes)
        self._texts: tuple[str, ...] | None = tuple(k.text for k in lanes)
        self._kept: Kept | None = None

    @property
    def kept(self) -> Kept:
        """The state sealed over the lanes' digests (`digest`), with no lane state decoded;
        once sealed, the lanes' parts are let go (one copy of the text is kept). Two threads
        asking at once may both seal it, to the same."""
        kept = self._kept
        if kept is not None:
            return kept
        digests, texts = self._digests, self._texts
        if digests is None or texts is None:  # sealed by another thread meanwhile
            assert self._kept is not None
            return self._kept
        body = {VERSION: self._version, CONFIG_HASH: self._config_hash, STEP: self.step}
        sealed = _sha(body | {LANES: list(digests)})
        head = json.dumps(body | {DIGEST: sealed}, separators=(",", ":"))
        kept = Kept(self.step, sealed, f'{head[:-1]},"{LANES}":[{",".join(texts)}]}}')
        self._kept = kept  # before the parts go: a thread that finds them gone finds this
        self._digests = self._texts = None
        return kept

    @property
    def digest(self) -> str:
        return self.kept.digest

    def unpack(self) -> dict:
        return self.kept.unpack()


def nest_kept(version: int, config_hash: str, lanes: list[Kept]) -> Nested:
    """A laned state of its lanes' kept states (Nested: sealed when asked for)."""
    return Nested(version, config_hash, lanes)


def _check_seal(state: dict) -> None:
    """StateError unless the state's digest is that of its content."""
    try:
        ok = state.get(DIGEST) == digest(state)
        if not ok and LANES in state:  # sealed over the lanes' whole JSON (before `digest` above)
            ok = state.get(DIGEST) == _sha({k: v for k, v in state.items() if k != DIGEST})
    except (TypeError, ValueError) as e:  # NaN, or something that is not JSON
        raise StateError(f"resume state is not plain JSON: {e}") from None
    if not ok:
        raise StateError(
            "resume state digest does not match its content: the state was corrupted or "
            "edited (states are checked whole; use the file as it was written)"
        )


def check_state(
    state, config_hash: str, names: list[str], allow_config_change: bool,
    packing: str | None = None, global_batch_size: int | None = None,
) -> dict:  # fmt: skip
    """The state, migrated to this version, if it is whole and fits this config (`names`: its
    streams, `packing`: its packing mode, `global_batch_size`: the rows a step of this feed
    makes, if known: a lane's share of G for a lane's state); else StateError naming the
    problem."""
    if not isinstance(state, dict):
        raise StateError(f"resume state must be a JSON object, got {type(state).__name__}")
    version = state.get(VERSION)
    if not is_int(version) or version not in (STATE_VERSION, *LEGACY_VERSIONS):
        raise StateError(f"resume state has version {version!r}, expected {STATE_VERSION}")
    if version != 1:
        _check_seal(state)
    else:
        logging.getLogger("tokenmill").warning("resuming a version %s state (no digest)", version)
    if LANES in state:
        raise StateError(
            f"resume state holds {len(state[LANES]) if isinstance(state[LANES], list) else '?'} "
            "lanes and this config has lanes: 1: a run resumes with the lanes it was written "
            "with (changing lanes is a new sequence)"
        )
    written = _packing_of(state)
    if packing is not None and written != packing:
        raise StateError(
            f"resume state was written with packing {written!r}, this config packs {packing!r}: "
            "the packing mode cannot change at a resume"
        )
    if version != STATE_VERSION:
        state = migrate(state, written)
    _check_fields(state, written)
    _check_consistent(state, written)
    feed = state[FEED]
    _check_step(state, feed[ROWS], feed[FINISHED],
                global_batch_size if state[CONFIG_HASH] == config_hash else None)  # fmt: skip
    streams = sorted(state[PACKER][packing_keys.STREAMS])
    if streams != sorted(names) and not allow_config_change:
        raise StateError(
            f"resume state has streams {streams}, the config has {sorted(names)}; pass "
            "--allow-config-change to add or remove streams at a resume (recorded in the "
            "mixture history; added streams start from their beginning)"
        )
    if state[CONFIG_HASH] != config_hash:
        if not allow_config_change:
            raise StateError(
                f"resume state was written by config {state[CONFIG_HASH]}, this config is "
                f"{config_hash}; pass --allow-config-change to resume anyway (weights from the "
                "new config apply from the resume step and are recorded)"
            )
        logging.getLogger("tokenmill").warning(
            "resuming a state of config %s with config %s", state[CONFIG_HASH], config_hash
        )
    return state


def check_laned_state(
    state, config_hash: str, names: list[str], allow_config_change: bool, packing: str,
    lanes: int, global_batch_size: int | None = None,
) -> list[dict]:  # fmt: skip
    """The lanes' states of a laned feed's state (`{version, config_hash, step, lanes: [...],
    digest}`), each checked as a feed's state; StateError if the state is not whole, has
    another number of lanes, or its lanes stand at other steps."""
    if not isinstance(state, dict):
        raise StateError(f"resume state must be a JSON object, got {type(state).__name__}")
    if LANES not in state:
        raise StateError(
            f"resume state is a single feed's and this config has lanes: {lanes}: a run "
            "resumes with the lanes it was written with (changing lanes is a new sequence)"
        )
    if state.get(VERSION) != STATE_VERSION:
        raise StateError(
            f"resume state has version {state.get(VERSION)!r}, expected {STATE_VERSION}"
        )
    _check_seal(state)
    _only(state, {VERSION, CONFIG_HASH, STEP, LANES, DIGEST, POLICY_LOSSES}, "the state")
    parts = state[LANES]
    if not isinstance(parts, list) or len(parts) != lanes:
        got = len(parts) if isinstance(parts, list) else type(parts).__name__
        raise StateError(
            f"resume state has {got} lanes, this config has lanes: {lanes}: a run resumes with "
            "the lanes it was written with (changing lanes is a new sequence)"
        )
    step = _count(state, STEP)
    out = []
    for k, part in enumerate(parts):
        try:
            part = check_state(part, config_hash, names, allow_config_change, packing)
        except StateError as e:
            raise StateError(f"lane {k}: {e}") from None
        if part[STEP] != step:
            raise StateError(f"lane {k}: at step {part[STEP]}, the state is at step {step}")
        out.append(part)
    rows = sum(part[FEED][ROWS] for part in out)  # each lane makes its share of every step
    same = all(part[CONFIG_HASH] == config_hash for part in out)
    _check_step(state, rows, any(part[FEED][FINISHED] for part in out),
                global_batch_size if same else None, "the lanes' feed.rows")  # fmt: skip
    return out


def _packing_of(state: dict) -> str:
    """The packing mode a state was written with: only bfd keeps a row count."""
    packer = _type(state, PACKER, dict)
    return "bfd" if ("pools" if state[VERSION] != STATE_VERSION else ROWS) in packer else "concat"


# Steps are counted in int64 by the trainers and the wire (the API takes steps up to 2**62).
MAX_STEP = 1 << 62


def _only(obj: dict, allowed: set[str], where: str) -> None:
    """No key a writer does not write: an unknown one is a typo or an edit, never ignored."""
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        raise StateError(
            f"resume state: {where} has unknown key(s) {unknown}; it may hold {sorted(allowed)}"
        )


def _check_step(state: dict, rows: int, finished: bool, global_batch_size: int | None,
                where: str = "feed.rows") -> None:  # fmt: skip
    """The step agrees with the rows the state says were made: G rows a step, the last step
    of a finished run possibly short. Checked when the state's config is this one (a resume
    with another config may change G)."""
    step = state[STEP]
    if step > MAX_STEP:
        raise StateError(f"resume state: step must be at most 2**62, got {step}")
    G = global_batch_size
    if G is None:
        return
    ok = (step - 1) * G < rows <= step * G if finished and step else rows == step * G
    if not ok:
        raise StateError(
            f"resume state: step {step} does not agree with {where} {rows} ({G} rows a step"
            + (", the last one possibly short)" if finished else ")")
        )


def _check_fields(state: dict, packing: str) -> None:
    _only(state, {VERSION, CONFIG_HASH, STEP, PACKER, FEED, DIGEST, POLICY_LOSSES}, "the state")
    _count(state, STEP)
    _type(state, CONFIG_HASH, str)
    packer = _type(state, PACKER, dict)
    streams = _type(packer, packing_keys.STREAMS, dict, "packer.streams")
    names = list(streams)
    for name in names:
        _check_stream(streams, name, packing)
    _type(packer, packing_keys.FINISHED, bool, "packer.finished")
    if packing == "bfd":
        _count(packer, packing_keys.ROWS, "packer.rows")
    _check_mixer(_type(packer, packing_keys.MIXER, dict, "packer.mixer"), names)
    if packing_keys.SKIPS in packer:
        _check_skips(_type(packer, packing_keys.SKIPS, dict, "packer.skips"), names)
    _only(packer, {packing_keys.STREAMS, packing_keys.MIXER, packing_keys.FINISHED,
                   packing_keys.SKIPS} | ({packing_keys.ROWS} if packing == "bfd" else set()),
          "packer")  # fmt: skip
    feed = _type(state, FEED, dict)
    _only(feed, {ROWS, REAL_TOKENS, DOCS_EMITTED, FINISHED}, "feed")
    _count(feed, ROWS, "feed.rows")
    _count(feed, REAL_TOKENS, "feed.real_tokens")
    _per_stream(feed, DOCS_EMITTED, "feed.docs_emitted", names, _is_count)
    _type(feed, FINISHED, bool, "feed.finished")


def _check_stream(streams: dict, name: str, packing: str) -> None:
    where = f"packer.streams.{name}"
    st = _type(streams, name, dict, where)
    own = {packing_keys.CONSUMED} if packing == "concat" else {packing_keys.BASE, packing_keys.ARRIVALS, packing_keys.POOL}  # fmt: skip
    _only(st, {packing_keys.INPUT, packing_keys.DONE, packing_keys.COUNTERS} | own, where)
    window = _type(st, packing_keys.INPUT, dict, f"{where}.input")  # WindowShuffle's state
    _only(window, {shuffle_keys.WINDOW, shuffle_keys.OFFSET, shuffle_keys.EPOCH,
                   shuffle_keys.INPUT}, f"{where}.input")  # fmt: skip
    _count(window, shuffle_keys.WINDOW, f"{where}.input.window")
    _count(window, shuffle_keys.OFFSET, f"{where}.input.offset")
    _count(window, shuffle_keys.EPOCH, f"{where}.input.epoch")
    source = _type(window, shuffle_keys.INPUT, dict, f"{where}.input.input")  # DocSource's
    _only(source, {doc_keys.POSITION, doc_keys.REPORTED, doc_keys.OPEN}, f"{where}.input.input")
    if doc_keys.OPEN in source:
        try:
            doc_keys.open_pieces(source[doc_keys.OPEN], name)
        except ValueError as e:
            raise StateError(f"{e} (at {where}.input.input.open)") from None
    _counts(source, doc_keys.POSITION, f"{where}.input.input.position", POSITION_FIELDS)
    mark = _list(source, doc_keys.REPORTED, 3, f"{where}.input.input.reported")
    if not all(is_int(v) and v >= -1 for v in mark):  # (epoch, unit, row)
        raise StateError(f"resume state: {where}.input.input.reported must be integers >= -1")
    _type(st, packing_keys.DONE, bool, f"{where}.done")
    counters = _type(st, packing_keys.COUNTERS, dict, f"{where}.counters")
    _only(counters, set(PACK_COUNTERS), f"{where}.counters")
    for key in PACK_COUNTERS:
        _count(counters, key, f"{where}.counters.{key}")
    if packing == "concat":
        if packing_keys.CONSUMED not in st:
            raise StateError(f"resume state: {where}.consumed is missing (a state of bfd packing?)")
        if st[packing_keys.CONSUMED] is not None:
            _count(st, packing_keys.CONSUMED, f"{where}.consumed")
    else:
        if packing_keys.POOL not in st:
            raise StateError(f"resume state: {where}.pool is missing (a state of concat packing?)")
        _count(st, packing_keys.BASE, f"{where}.base")
        _count(st, packing_keys.ARRIVALS, f"{where}.arrivals")
        _counts(st, packing_keys.POOL, f"{where}.pool")


def _entries(obj: dict, key: str, where: str, text: str) -> Iterator[tuple[dict, str]]:
    """A log's entries (the mixture history, the skip log) and their paths: each an object
    with a `step` count and a string `text` (its source, its why)."""
    for i, entry in enumerate(_type(obj, key, list, where)):
        at = f"{where}.{i}"
        entry = _type({"e": entry}, "e", dict, at)
        _count(entry, "step", f"{at}.step")
        _type(entry, text, str, f"{at}.{text}")
        yield entry, at


def _check_skips(skips: dict, names: list[str]) -> None:
    """Documents left out (packing.leave_out): ids per stream (ascending, distinct), those
    met (each one of them, once), and the log of the sets added."""
    docs = _type(skips, packing_keys.SKIP_DOCS, dict, "packer.skips.docs")
    met = _type(skips, packing_keys.SKIP_MET, dict, "packer.skips.met")
    for key, table in (("docs", docs), ("met", met)):
        unknown = sorted(set(table) - set(names))
        if unknown:
            raise StateError(
                f"resume state: packer.skips.{key} names streams {unknown}, not the state's"
            )
        for name in table:
            _counts(table, name, f"packer.skips.{key}.{name}")
    for name, ids in docs.items():
        if any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
            raise StateError(
                f"resume state: packer.skips.docs.{name} must be ascending and distinct"
            )
    for name, ids in met.items():
        if len(set(ids)) != len(ids) or not set(ids) <= set(docs.get(name, ())):
            raise StateError(
                f"resume state: packer.skips.met.{name} must list distinct documents of "
                f"packer.skips.docs.{name}"
            )
    for entry, where in _entries(skips, packing_keys.SKIP_LOG, "packer.skips.log", "why"):
        counts = _type(entry, "docs", dict, f"{where}.docs")
        if not all(_is_count(v) for v in counts.values()):
            raise StateError(f"resume state: {where}.docs must be counts")


def _check_mixer(mixer: dict, names: list[str]) -> None:
    def weight(v) -> bool:
        return _finite(v) and v >= 0

    _only(mixer, {mixing_keys.HISTORY, mixing_keys.TARGET, mixing_keys.PLACED, mixing_keys.ALIVE,
                  mixing_keys.WEIGHTS, mixing_keys.STEP, mixing_keys.STOPPED,
                  mixing_keys.EXHAUSTED, mixing_keys.HISTORY_DROPPED}, "packer.mixer")  # fmt: skip

    _per_stream(mixer, mixing_keys.TARGET, "packer.mixer.target", names, weight)
    _per_stream(mixer, mixing_keys.WEIGHTS, "packer.mixer.weights", names, weight)
    _per_stream(mixer, mixing_keys.PLACED, "packer.mixer.placed", names, _is_count)
    _per_stream(mixer, mixing_keys.ALIVE, "packer.mixer.alive", names,
                lambda v: isinstance(v, bool))  # fmt: skip
    _count(mixer, mixing_keys.STEP, "packer.mixer.step")
    _type(mixer, mixing_keys.STOPPED, bool, "packer.mixer.stopped")
    exhausted = _type(mixer, mixing_keys.EXHAUSTED, list, "packer.mixer.exhausted")
    if not all(isinstance(line, str) for line in exhausted):
        raise StateError("resume state: packer.mixer.exhausted must be a list of strings")
    if mixing_keys.HISTORY_DROPPED in mixer:
        _count(mixer, mixing_keys.HISTORY_DROPPED, "packer.mixer.history_dropped")
    for change, where in _entries(mixer, mixing_keys.HISTORY, "packer.mixer.history", "source"):
        weights = _type(change, "weights", dict, f"{where}.weights")
        if not weights or not all(weight(v) for v in weights.values()):
            raise StateError(f"resume state: {where}.weights must be finite numbers >= 0")


def _check_consistent(state: dict, packing: str) -> None:
    """What a writer can produce, beyond each field's own type and bounds: a state edited and
    re-sealed into something no run can be in (duplicate pool entries, a position past its
    window) is refused here, naming the field (the digest cannot tell, module docstring)."""
    packer, feed = state[PACKER], state[FEED]
    for name, st in packer[packing_keys.STREAMS].items():
        where = f"packer.streams.{name}"
        window = st[packing_keys.INPUT]
        k, offset = window[shuffle_keys.WINDOW], window[shuffle_keys.OFFSET]
        if offset > shuffle_keys.window_size(1 << 62, k):
            raise StateError(
                f"resume state: {where}.input.offset {offset} is past the end of window {k} "
                f"(at most {shuffle_keys.window_size(1 << 62, k)} documents)"
            )
        mark = window[shuffle_keys.INPUT][doc_keys.REPORTED]
        if -1 in mark and mark != [-1, -1, -1]:
            raise StateError(
                f"resume state: {where}.input.input.reported must be unset ([-1, -1, -1]) or "
                f"a read position, got {mark}"
            )
        if packing == "bfd":
            _check_pool(st, where)
    mixer = packer[packing_keys.MIXER]
    history = mixer[mixing_keys.HISTORY]
    steps = [change["step"] for change in history]
    if not steps or steps != sorted(steps):
        raise StateError(
            "resume state: packer.mixer.history must hold the weight changes in step order, "
            f"got steps {steps!r:.80}"
        )
    if mixer[mixing_keys.STEP] > state[STEP] or steps[0] > mixer[mixing_keys.STEP]:
        raise StateError(
            f"resume state: packer.mixer.step {mixer[mixing_keys.STEP]} must be within the "
            f"first weight change's step {steps[0]} and the state's step {state[STEP]}"
        )
    # Shares: at most 1 in all (less for a moment after a resume that removed a stream).
    total = sum(mixer[mixing_keys.WEIGHTS].values())
    if total > 1 + 1e-6:
        raise StateError(f"resume state: packer.mixer.weights are shares, their sum is {total}")
    if not feed[FINISHED]:  # a last short step dropped (drop_last) is counted by the packer only
        if packing == "bfd" and packer[packing_keys.ROWS] != feed[ROWS]:
            raise StateError(
                f"resume state: packer.rows {packer[packing_keys.ROWS]} must equal feed.rows "
                f"{feed[ROWS]}"
            )
        placed = sum(mixer[mixing_keys.PLACED].values())
        if placed > feed[REAL_TOKENS]:
            raise StateError(
                f"resume state: packer.mixer.placed ({placed} tokens in all) is more than "
                f"feed.real_tokens {feed[REAL_TOKENS]}"
            )


def _check_pool(st: dict, where: str) -> None:
    """A bfd stream's held pieces: arrival numbers, strictly increasing (no piece held twice),
    within [base, arrivals); `base` is the oldest held document's first piece, so it is at most
    the first held one, and `arrivals` itself when nothing is held."""
    base, arrivals = st[packing_keys.BASE], st[packing_keys.ARRIVALS]
    pool = st[packing_keys.POOL]
    if any(b <= a for a, b in zip(pool, pool[1:], strict=False)):
        raise StateError(
            f"resume state: {where}.pool must be strictly increasing arrival numbers (no "
            f"duplicates), got {pool!r:.80}"
        )
    if base > arrivals or (pool and (pool[0] < base or pool[-1] >= arrivals)):
        raise StateError(
            f"resume state: {where}.pool must lie within base {base} and arrivals {arrivals}, "
            f"got {pool!r:.80}"
        )
    if not pool and base != arrivals:
        raise StateError(
            f"resume state: {where}.base must equal arrivals when its pool is empty, got base "
            f"{base}, arrivals {arrivals}"
        )


def _per_stream(obj: dict, key: str, where: str, names: list[str], ok) -> None:
    """A mapping stream name -> value, one entry per stream of the state."""
    value = _type(obj, key, dict, where)
    if sorted(value) != sorted(names):
        raise StateError(
            f"resume state: {where} must name the streams {names}, got {sorted(value)}"
        )
    bad = {k: v for k, v in value.items() if not ok(v)}
    if bad:
        raise StateError(f"resume state: {where} has bad values {bad!r:.80}")


def migrate(state: dict, packing: str) -> dict:
    """A version 1 or 2 state as version 3. Versions 1 and 2 kept per-stream values in lists in
    the config's stream order (the order of `streams`), and one cursor of 8 fields per stream
    for both the shuffle window and the read position; version 3 nests each stage's state in
    the packer's, keyed by stream name. The positions mean the same, so the run continues
    exactly as the old version would have."""
    try:
        return _migrate(state, packing)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, StateError):
            raise
        raise StateError(
            f"resume state of version {state.get(VERSION)} is malformed ({type(e).__name__}: "
            f"{e}); it cannot be migrated to version {STATE_VERSION}"
        ) from None


def _migrate(old: dict, packing: str) -> dict:
    streams = _type(old, "streams", dict)
    names = list(streams)
    packer, mixer, feed = old["packer"], old["mixer"], old["feed"]
    new_streams = {}
    for i, name in enumerate(names):
        st = _type(streams, name, dict, f"streams.{name}")
        for key in ("restart", "next"):
            _counts(st, key, f"streams.{name}.{key}", 8)
        e, k, unit, row, docs, tokens, skipped, offset = st["restart"]
        source = {doc_keys.POSITION: [e, unit, row, docs, tokens, skipped],
                  doc_keys.REPORTED: _list(st, "reported", 3, f"streams.{name}.reported")}  # fmt: skip
        entry = {
            packing_keys.INPUT: {
                shuffle_keys.WINDOW: k,
                shuffle_keys.OFFSET: offset,
                shuffle_keys.EPOCH: e,
                shuffle_keys.INPUT: source,
            },  # fmt: skip
            packing_keys.DONE: packer["source_done"][i],
            packing_keys.COUNTERS: packer["counters"][i],
        }
        if packing == "concat":
            entry[packing_keys.CONSUMED] = packer["consumed"][i]
        else:
            entry |= packer["pools"][i]  # base, arrivals, pool: the same keys
        new_streams[name] = entry

    def by_name(values: list) -> dict:
        if len(values) != len(names):
            raise StateError(f"resume state: per-stream lists must have {len(names)} entries")
        return dict(zip(names, values, strict=True))

    log = list(packer["exhausted_log"])
    new_packer = {
        packing_keys.STREAMS: new_streams,
        packing_keys.MIXER: {
            mixing_keys.HISTORY: mixer["history"],
            mixing_keys.TARGET: by_name(mixer["target"]),
            mixing_keys.PLACED: by_name(mixer["placed"]),
            mixing_keys.ALIVE: by_name(mixer["alive"]),
            mixing_keys.WEIGHTS: by_name(mixer["weights"]),
            mixing_keys.STEP: mixer["step"],
            mixing_keys.STOPPED: any(line.endswith("stopping the run") for line in log),
            mixing_keys.EXHAUSTED: log,
        },
        packing_keys.FINISHED: packer["finished"],
    }
    if packing == "bfd":
        new_packer[packing_keys.ROWS] = packer["rows"]
    return seal({
        VERSION: STATE_VERSION,
        CONFIG_HASH: old["config_hash"],
        STEP: old["step"],
        PACKER: new_packer,
        FEED: {ROWS: feed["rows"], REAL_TOKENS: feed["real_tokens"],
               DOCS_EMITTED: by_name(feed["docs_emitted"]), FINISHED: feed["finished"]},
    })  # fmt: skip


def _type(obj: dict, key: str, kind: type, where: str | None = None):
    where = where or key
    if key not in obj:
        raise StateError(f"resume state: {where} is missing")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise StateError(f"resume state: {where} must be {kind.__name__}, got {value!r:.80}")
    return value


def _count(obj: dict, key: str, where: str | None = None) -> int:
    value = _type(obj, key, int, where)
    if value < 0:
        raise StateError(f"resume state: {where or key} must be >= 0, got {value}")
    return value


def _list(obj: dict, key: str, length: int | None, where: str) -> list:
    value = _type(obj, key, list, where)
    if length is not None and len(value) != length:
        raise StateError(f"resume state: {where} must have {length} entries, got {len(value)}")
    return value


def _counts(obj: dict, key: str, where: str, length: int | None = None) -> list:
    value = _list(obj, key, length, where)
    if not all(_is_count(v) for v in value):
        raise StateError(f"resume state: {where} must be integers >= 0, got {value!r:.80}")
    return value


def _is_count(v) -> bool:
    return is_int(v) and v >= 0


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
