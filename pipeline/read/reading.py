"""Read + tokenize, fused into one Ray Data task per *unit* (a group of consecutive pieces).

Why fused and grouped: on a small machine Ray's per-task overhead dominates when tasks are
small (measured here: 23% of the tokenizer limit with 64 small blocks, 63% with 8 large
ones). A unit therefore covers ``read.block_bytes`` of input (default 8 MiB), except the first
few units of an epoch, which ramp up from ``read.first_block_bytes`` so the first batch comes
quickly. The task body lives in this importable module so that each Ray worker process keeps
its tokenizer in `engines._CACHE` across tasks.

Output block schema (one row per record, in record order):
    unit    int32           the unit's index in its epoch (a read position is (unit, row))
    doc_id  uint64          (file_index << 32) | record_index
    tokens  list<int32>     BOS/EOS applied; empty for a bad record
    loss    list<int8>      per-token loss mask (chat streams only; null for pretrain)
    error   string          null for a good record, else the reason it is bad
    backend int8            which tokenizer backend encoded the row (encoders.BACKEND_*)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.config import REVEAL_SECRETS, StreamConfig, TokenizerConfig
from pipeline.read import formats
from pipeline.read.access import WHOLE_FILE, Access, Piece
from pipeline.read.sources import read_piece
from pipeline.tokenize.chat import ChatEncoder, lone_surrogate, validate_messages
from pipeline.tokenize.encoders import BACKEND_NONE
from pipeline.tokenize.engines import LoadedTokenizer, load_tokenizer
from wire.arrays import numeric, strings

BLOCK_SCHEMA = pa.schema(
    [
        ("unit", pa.int32()),
        ("doc_id", pa.uint64()),
        ("tokens", pa.large_list(pa.int32())),
        ("loss", pa.large_list(pa.int8())),
        ("error", pa.string()),
        ("backend", pa.int8()),
    ]
)
_ENCODE_BATCH_BYTES = 1 << 20
# An executor reads and tokenizes units into blocks, in unit order: Ray Data or in-process.
Executor = Callable[[list, StreamConfig, TokenizerConfig], Iterator[pa.Table]]


@dataclass(frozen=True)
class Unit:
    """The pieces one read task handles, in order. `index` is its position in the epoch."""

    index: int
    pieces: tuple[Piece, ...]

    def to_json(self) -> str:
        return json.dumps({"index": self.index, "pieces": [p.to_json() for p in self.pieces]})

    @property
    def work(self) -> int:
        """Its pieces' weight (Piece.work): what `group_units` sizes it by."""
        return sum(p.work for p in self.pieces)

    @staticmethod
    def from_json(s: str) -> Unit:
        d = json.loads(s)
        return Unit(d["index"], tuple(Piece(**p) for p in d["pieces"]))


def group_units(pieces: Iterable[Piece], block_bytes: int, first_block_bytes: int,
                keys: Iterable | None = None,
                small: tuple[int, int] = (0, 0)) -> list[Unit]:  # fmt: skip
    """Group consecutive pieces into units of about `block_bytes`, ramping up from the first.
    `keys` (one per piece): a unit never holds two pieces of one key (two parts of a piece,
    stages/plan.py), it ends before the second. `small` = (n, nbytes): the units of the first
    n pieces hold at most about `nbytes` (where the reads must follow the draws closely)."""
    units: list[Unit] = []
    current: list[Piece] = []
    held: set = set()
    size = 0
    target = min(first_block_bytes, block_bytes)
    keyed = keys if keys is not None else itertools.repeat(None)
    for k, (p, key) in enumerate(zip(pieces, keyed, strict=False)):
        if key is not None:
            if key in held:
                units.append(Unit(len(units), tuple(current)))
                current, size, held = [], 0, set()  # not full: the same target next
            held.add(key)
        current.append(p)
        size += p.work
        if size >= (min(target, small[1]) if k < small[0] else target):
            units.append(Unit(len(units), tuple(current)))
            current, size, held = [], 0, set()
            target = min(target * 2, block_bytes)
    if current:
        units.append(Unit(len(units), tuple(current)))
    return units


def validate_text(value) -> tuple[str | None, str | None]:
    if value is None:
        return None, "field is null"
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"invalid UTF-8 at byte {e.start}"
    if not isinstance(value, str):
        return None, f"field has type {type(value).__name__}, expected a string"
    if not value.strip():
        return None, "empty document"
    bad = lone_surrogate(value)
    if bad:
        return None, f"text has {bad}"
    return value, None


def record_field(stream: StreamConfig) -> str:
    if stream.tokens_field is not None:
        return stream.tokens_field
    return stream.messages_field if stream.kind == "chat" else stream.text_field


def read_spec(stream: StreamConfig) -> formats.ReadSpec:
    return formats.ReadSpec(
        record_field(stream),
        tokens=stream.tokens_field is not None,
        tokens_dtype=stream.tokens_dtype,
        access=Access.of(stream),
    )


def validate_tokens(value) -> tuple[tuple | None, str | None]:
    tokens, _ = value
    if len(tokens) == 0:
        return None, "empty document"
    return value, None


_INT32_MAX = np.iinfo(np.int32).max


def token_ids(value, dtype: str | None) -> tuple[tuple | None, str | None]:
    """A `tokens_field` value as (int32 ids, None), or the reason it is not token ids.

    Takes a list of ints, an integer numpy array (MDS `ndarray:*`, Arrow `list<int>`), or raw
    bytes read as `dtype` (MDS `bytes`, as LLM-Foundry's `--concat_tokens` wrote int64).
    """
    if value is None:
        return None, "field is null"
    if isinstance(value, bytes | bytearray | memoryview):
        if dtype is None:
            return None, "field holds raw bytes; set tokens_dtype (e.g. int64) to read them"
        width = np.dtype(dtype).itemsize
        if len(value) % width:
            return None, f"{len(value)} bytes is not a whole number of {dtype} token ids"
        ids = np.frombuffer(value, dtype=dtype)
    elif isinstance(value, np.ndarray | list | tuple):
        try:
            ids = np.asarray(value)
        except (ValueError, OverflowError) as e:
            return None, f"field is not a list of token ids ({e})"
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            return None, f"field holds {ids.dtype} values of shape {ids.shape}, expected token ids"
    else:
        return None, f"field has type {type(value).__name__}, expected token ids"
    if ids.size == 0:
        return None, "empty document"
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi > _INT32_MAX:
        return None, f"token id {lo if lo < 0 else hi} is out of range"
    return (ids.astype(np.int32), None), None


def validator(stream: StreamConfig):
    if stream.tokens_field is not None:
        return functools.partial(token_ids, dtype=stream.tokens_dtype)
    assert stream.format is not None  # load_config resolves every stream's format
    if formats.get(stream.format).pretokenized:
        return validate_tokens
    return validate_messages if stream.kind == "chat" else validate_text


def iter_records(unit: Unit, stream: StreamConfig):
    """Yield (doc_id, value | None, error | None) for every record of the unit, validated."""
    spec, validate = read_spec(stream), validator(stream)
    for piece in unit.pieces:
        base = piece.file_index << 32
        for rec, value, err in read_piece(piece, spec):
            if err is None:
                value, err = validate(value)
            yield base | rec, value, err


def _with_specials(
    flat: np.ndarray, offsets: np.ndarray, bos: int | None, eos: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Insert BOS before and/or EOS after every document, vectorized."""
    extra = (bos is not None) + (eos is not None)
    if not extra:
        return flat, offsets
    n = len(offsets) - 1
    lens = np.diff(offsets)
    new_offsets = offsets + np.arange(n + 1, dtype=np.int64) * extra
    out = np.empty(len(flat) + n * extra, dtype=np.int32)
    shift = np.repeat(np.arange(n, dtype=np.int64) * extra + (bos is not None), lens)
    out[np.arange(len(flat), dtype=np.int64) + shift] = flat
    if bos is not None:
        out[new_offsets[:-1]] = bos
    if eos is not None:
        out[new_offsets[1:] - 1] = eos
    return out, new_offsets


def _encode_pretrain(texts: list[str], tok: LoadedTokenizer):
    """Yield (flat ids, offsets, backend per text, {index in batch: reason}) per batch of
    about _ENCODE_BATCH_BYTES of text. A text the tokenizer failed on (`encode_records`) has
    no ids, not even BOS/EOS: its row becomes a bad record."""
    bos = tok.bos_id if tok.add_bos else None
    eos = tok.eos_id if tok.add_eos else None
    start = 0
    while start < len(texts):
        stop, nbytes = start, 0
        while stop < len(texts) and (stop == start or nbytes < _ENCODE_BATCH_BYTES):
            nbytes += len(texts[stop])
            stop += 1
        flat, offsets, backends, failed = tok.encode_records(texts[start:stop])
        flat, offsets = _with_specials(flat, offsets, bos, eos)
        if failed:  # drop the BOS/EOS given to a failed text
            keep = np.ones(len(flat), dtype=bool)
            lens = np.diff(offsets)
            for i in failed:
                keep[offsets[i] : offsets[i + 1]] = False
                lens[i] = 0
            flat = flat[keep]
            offsets = np.concatenate([[0], np.cumsum(lens)])
        yield flat, offsets, backends, failed
        start = stop


# One ChatEncoder per tokenizer, for every thread of the process: encoders are immutable
# (see ChatEncoder), so two threads that build one at once lose nothing but a build.
_CHAT_ENCODERS: dict[int, ChatEncoder] = {}


def _chat_encoder(tok: LoadedTokenizer) -> ChatEncoder:
    enc = _CHAT_ENCODERS.get(id(tok))
    if enc is None:
        enc = _CHAT_ENCODERS[id(tok)] = ChatEncoder(tok)
    return enc


def tokenize_unit(unit: Unit, stream: StreamConfig, tok: LoadedTokenizer) -> pa.Table:
    """Read and tokenize one unit into a block (see module docstring)."""
    ids: list[int] = []
    errors: list[str | None] = []
    values: list = []
    rows: list[int] = []
    for doc_id, value, err in iter_records(unit, stream):
        if err is None:
            rows.append(len(ids))
            values.append(value)
        ids.append(doc_id)
        errors.append(err)
    lens = np.zeros(len(ids), dtype=np.int64)
    backends = np.zeros(len(ids), dtype=np.int8)
    flats: list[np.ndarray] = []
    losses: list[np.ndarray] | None = None
    assert stream.format is not None  # load_config resolves every stream's format
    if formats.is_pretokenized(stream.format, stream.tokens_field):
        losses = [] if stream.kind == "chat" else None
        _pretokenized(rows, values, stream, tok, errors, lens, backends, flats, losses)
    elif stream.kind == "chat":
        losses = []
        results, chat_backends = _chat_encoder(tok).encode_with_backend(values)
        for row, result in zip(rows, results, strict=True):
            if isinstance(result, str):
                errors[row] = result
                continue
            flats.append(result[0])
            losses.append(result[1])
            lens[row] = len(result[0])
        backends[np.asarray(rows, dtype=np.int64)] = chat_backends
    else:
        done = 0
        for flat, offsets, text_backends, failed in _encode_pretrain(values, tok):
            n = len(offsets) - 1
            where = np.asarray(rows[done : done + n], dtype=np.int64)
            lens[where] = np.diff(offsets)
            backends[where] = text_backends
            for i, reason in failed.items():
                errors[rows[done + i]] = reason
            flats.append(flat)
            done += n
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    values_arr = np.concatenate(flats) if flats else np.zeros(0, dtype=np.int32)
    tokens = pa.LargeListArray.from_arrays(numeric(offsets), numeric(values_arr))
    if losses is None:
        loss = pa.nulls(len(ids), pa.large_list(pa.int8()))
    else:
        loss_values = np.concatenate(losses) if losses else np.zeros(0, dtype=np.int8)
        loss = pa.LargeListArray.from_arrays(numeric(offsets), numeric(loss_values))
    columns = [
        numeric(np.full(len(ids), unit.index, dtype=np.int32)),
        numeric(np.asarray(ids, dtype=np.uint64)),
        tokens,
        loss,
        strings(errors),
        numeric(backends),
    ]
    return pa.Table.from_arrays(columns, schema=BLOCK_SCHEMA)


def _pretokenized(rows, values, stream, tok, errors, lens, backends, flats, losses) -> None:
    """Token documents as they were read, no tokenizer run (backend `pretokenized`).

    An export's documents are used as they are (EOS included); a `tokens_field` document gets
    BOS/EOS as a text document would. A document with an id outside the tokenizer's vocabulary
    is a bad record (a corpus tokenized for another model).
    """
    vocab = tok.vocab_size
    raw = stream.tokens_field is not None
    bos = tok.bos_id if raw and tok.add_bos else None
    eos = tok.eos_id if raw and tok.add_eos else None
    if not rows:
        return
    sizes = np.fromiter((len(t) for t, _ in values), dtype=np.int64, count=len(values))
    starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    flat = np.concatenate([t for t, _ in values])
    # Every document's largest id at once (none is empty: `validate_tokens`).
    tops = np.maximum.reduceat(flat, starts)
    good = tops < vocab
    kept = np.asarray(rows, dtype=np.int64)
    if not good.all():
        for i in np.flatnonzero(~good).tolist():
            errors[rows[i]] = (
                f"token id {int(tops[i])} is outside the tokenizer's vocabulary (size {vocab})"
            )
        flat, sizes, kept = flat[np.repeat(good, sizes)], sizes[good], kept[good]
        values = [v for v, g in zip(values, good.tolist(), strict=True) if g]
        if not values:
            return
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if losses is not None:
        losses.extend(loss for _, loss in values)
    flat, offsets = _with_specials(flat, offsets, bos, eos)
    flats.append(flat)
    lens[kept] = np.diff(offsets)
    backends[kept] = BACKEND_NONE


def read_tokenize_batch(batch: pa.Table, *, stream: dict, tokenizer: dict) -> pa.Table:
    """Ray Data `map_batches` body: one row per unit (JSON), one block per unit out."""
    tables = [tokenize_unit_json(u, stream, tokenizer) for u in batch.column("unit").to_pylist()]
    return pa.concat_tables(tables) if len(tables) != 1 else tables[0]


def tokenize_unit_json(unit: str, stream: dict, tokenizer: dict) -> pa.Table:
    """A worker's task body (Ray Data's, or a pool actor's): one unit (`Unit.to_json`)."""
    # One tokenizer thread per Ray worker: Ray already runs one worker per core. (Set here,
    # before the first encode builds rayon's pool, not through a job runtime_env: see
    # client/cluster.py `connect`.)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = load_tokenizer(TokenizerConfig.model_validate(tokenizer))
    return tokenize_unit(Unit.from_json(unit), StreamConfig.model_validate(stream), tok)


# ---------------------------------------------------------------------------------------------
# Executors: the same units through Ray Data (the real path) or in-process (check, tests).


def iter_blocks_local(
    units: list[Unit], stream: StreamConfig, tok_cfg: TokenizerConfig
) -> Iterator[pa.Table]:
    tok = load_tokenizer(tok_cfg)
    for unit in units:
        yield tokenize_unit(unit, stream, tok)


class Prefetcher:
    """Pull an iterator on a background thread into a bounded queue.

    Started at construction, so every stream's Ray Data execution begins at once instead of
    when the packer first asks for that stream. An exception on the thread is re-raised in
    the consumer with its traceback; nothing is swallowed and the consumer never hangs.
    `close()`, or dropping the last reference, stops the thread and so the execution (the
    thread holds only the queue and the stop flag, never the prefetcher itself).
    """

    _END = object()

    def __init__(self, make_iter, depth: int):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_prefetch,
            args=(make_iter, self._q, self._stop, self._END),
            name="tokenmill-prefetch",
            daemon=True,
        )
        weakref.finalize(self, self._stop.set)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        item, err = self._q.get()
        if err is not None:
            raise err
        if item is self._END:
            raise StopIteration
        return item

    def close(self, timeout: float = 60.0) -> None:
        """Stop, and wait until the execution has been shut down.

        The thread may be blocked inside Ray Data waiting for a block; it notices the stop
        when that block arrives (one task's time at most), then closes the iterator, which
        shuts the execution down. Waiting here means nothing of it outlives the caller, e.g.
        into a `ray.shutdown()`.
        """
        self._stop.set()
        while True:  # unblock a put, if the thread is in one
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout)
        with contextlib.suppress(queue.Full):  # a consumer blocked in `next`: it sees the end
            self._q.put_nowait((self._END, None))


def _prefetch(make_iter, q: queue.Queue, stop: threading.Event, end) -> None:
    it = make_iter()
    try:
        for item in it:
            while not stop.is_set():
                try:
                    q.put((item, None), timeout=0.5)
                    break
                except queue.Full:
                    continue
            if stop.is_set():
                return
        q.put((end, None))
    except BaseException as e:  # carried to the consumer
        if not stop.is_set():
            q.put((end, e))
    finally:
        close = getattr(it, "close", None)
        if close is not None:  # a generator: ends Ray Data's execution now, not at GC
            close()


def iter_blocks_ray(
    units: list[Unit],
    stream: StreamConfig,
    tok_cfg: TokenizerConfig,
    prefetch: int = 2,
    ready: Future | None = None,
) -> Iterator[pa.Table]:
    """Stream the units' blocks through Ray Data, in unit order, with bounded memory.

    Execution starts at once (on a background thread), not at the first `next`; with
    `ready`, once that future is done (Ray connecting in the background) or with its error.
    """

    def blocks():
        if not units:
            return
        if ready is not None:
            ready.result()
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        # One execution per stream and epoch (two at a time while reading ahead): Ray Data's
        # per-dataset INFO lines ("execution finished", "registers for logging...") are noise.
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        ds = ray.data.from_items(
            [{"unit": u.to_json()} for u in units], override_num_blocks=len(units)
        )
        ds = ds.map_batches(
            read_tokenize_batch,
            batch_size=1,
            batch_format="pyarrow",
            zero_copy_batch=True,
            fn_kwargs={
                # The real storage_options: the workers must reach the files.
                "stream": stream.model_dump(mode="json", context=REVEAL_SECRETS),
                "tokenizer": tok_cfg.model_dump(mode="json"),
            },
            num_cpus=1,
        )
        yield from ds.iter_batches(
            batch_size=None, batch_format="pyarrow", prefetch_batches=prefetch
        )

    return Prefetcher(blocks, prefetch)


def read_ahead(executor: Executor, depth: int = 1) -> Executor:
    """`executor`, run on a thread of its own (`Prefetcher`) up to `depth` blocks ahead of the
    consumer, and one more being made: the same blocks, in the same order.

    A lane that reads its share itself (`read.in_lanes`) tokenizes a whole read unit when its
    packer first needs a document of it: up to `read.block_bytes` (8 MiB) of text, ~0.2 s on a
    core, while the other lanes, whose steps wait for this one's, stand still. Read ahead, the
    unit is made while the lane waits for the others or for window room, and its steps come
    evenly. The fast engines release the GIL while they encode (`LoadedTokenizer` is shared by
    the threads of a process: engines.py)."""

    def run(units: list[Unit], stream: StreamConfig, tok_cfg: TokenizerConfig):
        return Prefetcher(lambda: executor(units, stream, tok_cfg), depth)

    return run


def ray_executor(ready: Future | None = None) -> Executor:
    """The Ray Data executor; with `ready`, its executions wait for Ray to be connected."""
    return functools.partial(iter_blocks_ray, ready=ready)


def with_head_start(executor: Executor, ready: Future | None = None,
                    paced: bool = False) -> Executor:  # fmt: skip
    """`executor`, with this process tokenizing until its workers deliver (headstart.py);
    `paced` (a service's): only once this process falls behind the steps' consumer."""
    from pipeline.read.headstart import HeadStart

    def run(units: list[Unit], stream: StreamConfig, tok_cfg: TokenizerConfig):
        return HeadStart(units, stream, tok_cfg, executor, ready, iter_blocks_local, paced)

    return run


__all__ = [
    "BLOCK_SCHEMA",
    "Prefetcher",
    "WHOLE_FILE",
    "Unit",
    "group_units",
    "iter_blocks_local",
    "iter_blocks_ray",
    "ray_executor",
    "read_ahead",
    "with_head_start",
]
