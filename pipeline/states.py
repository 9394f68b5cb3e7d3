"""Resumable states on disk and over the wire: sealed with a digest, validated on load.

A state is a few KB of human-readable JSON (pipeline/feed.py builds it). Trainer checkpoints,
`GET /v1/state` and `export --state-every` hand it around, and people edit files. A corrupted
or hand-edited state must never resume "successfully" into wrong data (a negative cursor
once repeated 14 served documents and skipped 29), so:

- `seal` adds `digest`, a SHA-256 over the state's canonical JSON (sorted keys, no spaces).
  `check_state` recomputes it and refuses a state whose content no longer matches: the state
  stays readable, and is tamper-evident.
- Beyond the digest, every field is checked for type and bounds (counts and cursors are
  non-negative integers, cursors have their 8 fields, shares are finite, per-stream lists have
  one entry per stream), so a state from a buggy writer fails with the field's path, too.

Version 1 states (before the digest) still load, checked field by field, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math

STATE_VERSION = 2
LEGACY_VERSIONS = (1,)
CURSOR_FIELDS = 8


class StateError(ValueError):
    """A resume state that is malformed, corrupted, or does not fit this config."""


def digest(state: dict) -> str:
    body = {k: v for k, v in state.items() if k != "digest"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def seal(state: dict) -> dict:
    state["digest"] = digest(state)
    return state


def check_state(state, config_hash: str, names: list[str], allow_config_change: bool) -> None:
    """Raise StateError naming the problem, unless `state` is whole and fits this config."""
    if not isinstance(state, dict):
        raise StateError(f"resume state must be a JSON object, got {type(state).__name__}")
    version = state.get("version")
    if version not in (STATE_VERSION, *LEGACY_VERSIONS):
        raise StateError(f"resume state has version {version!r}, expected {STATE_VERSION}")
    if version == STATE_VERSION:
        try:
            ok = state.get("digest") == digest(state)
        except (TypeError, ValueError) as e:  # NaN, or something that is not JSON
            raise StateError(f"resume state is not plain JSON: {e}") from None
        if not ok:
            raise StateError(
                "resume state digest does not match its content: the state was edited or "
                "corrupted (states are checked whole; use the file as it was written)"
            )
    else:
        logging.getLogger("tokenmill").warning("resuming a version %s state (no digest)", version)
    _check_fields(state, names)
    if state["config_hash"] != config_hash:
        if not allow_config_change:
            raise StateError(
                f"resume state was written by config {state['config_hash']}, this config is "
                f"{config_hash}; pass --allow-config-change to resume anyway (weights from the "
                "new config apply from the resume step and are recorded)"
            )
        logging.getLogger("tokenmill").warning(
            "resuming a state of config %s with config %s", state["config_hash"], config_hash
        )


def _check_fields(state: dict, names: list[str]) -> None:
    n = len(names)
    _count(state, "step")
    _type(state, "config_hash", str)
    streams = _type(state, "streams", dict)
    if sorted(streams) != sorted(names):
        raise StateError(f"resume state has streams {sorted(streams)}, config has {sorted(names)}")
    for name, st in streams.items():
        st = _type(streams, name, dict, f"streams.{name}")
        for key in ("restart", "next"):
            _cursor(st, key, f"streams.{name}.{key}")
        mark = _list(st, "reported", 3, f"streams.{name}.reported")  # (epoch, unit, row)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= -1 for v in mark):
            raise StateError(f"resume state: streams.{name}.reported must be integers >= -1")
    _type(state, "packer", dict)
    mixer = _type(state, "mixer", dict)
    for key in ("target", "weights"):
        values = _list(mixer, key, n, f"mixer.{key}")
        if not all(_finite(v) and v >= 0 for v in values):
            raise StateError(f"resume state: mixer.{key} must be finite numbers >= 0, got {values}")
    _counts(mixer, "placed", "mixer.placed", n)
    alive = _list(mixer, "alive", n, "mixer.alive")
    if not all(isinstance(a, bool) for a in alive):
        raise StateError(f"resume state: mixer.alive must be booleans, got {alive}")
    _count(mixer, "step", "mixer.step")
    for i, change in enumerate(_type(mixer, "history", list, "mixer.history")):
        where = f"mixer.history.{i}"
        change = _type({"c": change}, "c", dict, where)
        _count(change, "step", f"{where}.step")
        weights = _type(change, "weights", dict, f"{where}.weights")
        if not all(_finite(v) and v >= 0 for v in weights.values()):
            raise StateError(f"resume state: {where}.weights must be finite numbers >= 0")
    feed = _type(state, "feed", dict)
    _count(feed, "rows", "feed.rows")
    _count(feed, "real_tokens", "feed.real_tokens")
    _counts(feed, "docs_emitted", "feed.docs_emitted", n)
    _type(feed, "finished", bool, "feed.finished")


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
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise StateError(f"resume state: {where} must be integers >= 0, got {value!r:.80}")
    return value


def _cursor(obj: dict, key: str, where: str) -> None:
    _counts(obj, key, where, CURSOR_FIELDS)


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
