"""Packing documents into rows of `seq_len` tokens, with the mixer choosing the streams.

Both packers pull documents from per-stream iterators and ask the `DeficitMixer` which stream
supplies the next segment, so mixing is exact in either mode.

Overlong documents (longer than `seq_len`) are handled first, per `overflow`: `split` cuts them
into pieces of `seq_len` (each piece keeps its `doc_offset`), `truncate` keeps the first
`seq_len` tokens, `drop` skips them. Each outcome is counted per stream.

`concat` (pretraining) lays segments end to end and cuts rows at exactly `seq_len`: every row
but the last is full, and a document crossing a row boundary continues at the start of the
next row with a new segment (positions restart there, as the attention mask requires).

`bfd` keeps every piece whole within a row. It is best-fit-decreasing over a bounded pool:
each stream keeps a pool of up to `buffer` pieces sorted by length. A row starts with the
largest piece of the stream the mixer picks, and the rest of the row is filled, again and
again, with the largest piece that still fits, taken from the fitting stream the mixer picks.
Compared with packing a whole buffer at once and flushing it (TRL's `bfd` over a dataset
batch), the pool never empties between rows, so there are always small pieces to close the
gap and efficiency stays ≥ 99% at steady state; the cost is O(log buffer) per piece. To
bound how long any piece can wait (and hence how far back a resume must replay), a piece that
has waited for more than 2 × `buffer` arrivals starts the next row of its stream.
"""

from __future__ import annotations

import bisect
import copy
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from pipeline.stages.mixing import DeficitMixer
from pipeline.stages.stage import Doc, Stage, StateError


@dataclass(slots=True)
class Segment:
    """`length` tokens of `doc`, starting at token `offset`."""

    doc: Doc
    offset: int
    length: int


Row = list[Segment]


@dataclass
class PackCounters:
    split: int = 0  # documents longer than seq_len, split into pieces
    truncated: int = 0
    dropped: int = 0
    truncated_tokens: int = 0
    dropped_tokens: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Pool:
    """Pieces of one stream, sorted by (length, arrival)."""

    keys: list[tuple[int, int]] = field(default_factory=list)
    items: dict[int, Segment] = field(default_factory=dict)  # arrival -> piece, oldest first

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, arrival: int, piece: Segment) -> None:
        bisect.insort(self.keys, (piece.length, arrival))
        self.items[arrival] = piece

    def min_length(self) -> int:
        return self.keys[0][0]

    def _pop_at(self, i: int) -> Segment:
        _, arrival = self.keys.pop(i)
        return self.items.pop(arrival)

    def pop_largest_fitting(self, room: int) -> Segment | None:
        i = bisect.bisect_right(self.keys, (room, 1 << 62)) - 1
        return self._pop_at(i) if i >= 0 else None

    def oldest_arrival(self) -> int:
        return next(iter(self.items))

    def pop_arrival(self, arrival: int) -> Segment:
        piece = self.items[arrival]
        self.keys.pop(bisect.bisect_left(self.keys, (piece.length, arrival)))
        return self.items.pop(arrival)


# Packer state keys. Per stream, by name: STREAMS -> {name: {INPUT, DONE, COUNTERS, ...}}
STREAMS = "streams"
INPUT = "input"  # the stream's state at the oldest document the packer still holds
DONE = "done"  # the stream has ended (as far as this packer pulled)
COUNTERS = "counters"
MIXER = "mixer"
FINISHED = "finished"
CONSUMED = "consumed"  # concat: tokens of the held document already placed (None: none held)
BASE, ARRIVALS, POOL = "base", "arrivals", "pool"  # bfd: arrival numbers (see BfdPacker)
ROWS = "rows"  # bfd: rows made (the pool grows with them)
# Documents left out at a resume (absent: none): per stream the ids left out (`docs`,
# ascending), those met so far (`met`, in the order met), and why and when each set was added.
SKIPS, SKIP_DOCS, SKIP_MET, SKIP_LOG = "skips", "docs", "met", "log"


class Packer:
    """Common part: pulling documents per stream, overflow handling, resumable state.

    A stage (pipeline/stages/stage.py) over one document stage per stream, keyed by name, and the
    mixer. Its state nests, per stream, the stream's state at the oldest document the packer
    still holds, and the mixer's; the held documents are rebuilt by replay on resume.
    """

    def __init__(
        self, seq_len: int, overflow: str, sources: Mapping[str, Stage[Doc]], mixer: DeficitMixer
    ):
        assert list(sources) == mixer.names, "the mixer's streams are the packer's"
        self.seq_len = seq_len
        self.overflow = overflow
        self.names = list(sources)
        self.sources = list(sources.values())
        self.mixer = mixer
        self.counters = [PackCounters() for _ in self.sources]
        self.source_done = [False] * len(self.sources)
        self.finished = False  # the run must stop (exhaustion with on_exhausted=stop)
        self._resumed: dict | None = None  # a state set, replayed at the first row
        # Documents left out (`leave_out`): per stream their ids, those met (distinct, in the
        # order met), and the log of the sets added.
        self.skip: list[set[int]] = [set() for _ in self.sources]
        self.met: list[list[int]] = [[] for _ in self.sources]
        self._met: list[set[int]] = [set() for _ in self.sources]
        self.skip_log: list[dict] = []

    @property
    def exhausted_log(self) -> list[str]:
        return self.mixer.exhausted_log

    def _pieces(self, doc: Doc, count: bool = True) -> list[Segment]:
        """`doc` cut to seq_len by `overflow`; its overflow counted unless not `count`."""
        n, L = len(doc), self.seq_len
        if n <= L:
            return [Segment(doc, 0, n)] if n else []
        c = self.counters[doc.stream] if count else PackCounters()
        if self.overflow == "split":
            c.split += 1
            return [Segment(doc, o, min(L, n - o)) for o in range(0, n, L)]
        if self.overflow == "truncate":
            c.truncated += 1
            c.truncated_tokens += n - L
            return [Segment(doc, 0, L)]
        c.dropped += 1
        c.dropped_tokens += n
        return []

    def _pull(self, s: int) -> list[Segment] | None:
        """The next document's pieces from stream `s`; [] for a document left out (`skip`),
        which still takes its arrival numbers (`_left_out`); None when the stream has ended."""
        while not self.source_done[s]:
            doc = next(self.sources[s], None)
            if doc is None:
                self.source_done[s] = True
                break
            if doc.doc_id in self.skip[s]:
                if doc.doc_id not in self._met[s]:
                    self._met[s].add(doc.doc_id)
                    self.met[s].append(doc.doc_id)
                self._left_out(s, len(self._pieces(doc, count=False)))
                return []
            pieces = self._pieces(doc)
            if pieces:
                return pieces
        return None

    def _left_out(self, s: int, slots: int) -> None:
        """A document of stream `s` that would have been `slots` pieces was left out."""

    def leave_out(self, docs: Mapping[str, Iterable[int]], step: int, why: str) -> dict[str, int]:
        """Leave these documents (ids per stream) out from now on, in every epoch, as if
        they had been read and dropped where they leave the shuffle: the others enter the
        packer in the order they would have, and a left-out document still takes the arrival
        numbers it would have (so that a state's replay is the same whichever documents are
        left out). Pieces of them already held are dropped at the replay. Before the replay
        (`StepFeed` calls it right after `set_state`). Returns how many ids each stream added."""
        unknown = sorted(set(docs) - set(self.names))
        if unknown:
            raise ValueError(f"documents to leave out name streams {unknown}, not in the config")
        added = {}
        for s, name in enumerate(self.names):
            new = {int(d) for d in docs.get(name, ())} - self.skip[s]
            if new:
                self.skip[s] |= new
                added[name] = len(new)
        if added:
            self.skip_log.append({"step": int(step), "docs": added, "why": why})
        return added

    def _skips_state(self) -> dict:
        if not any(self.skip):
            return {}
        return {
            SKIPS: {
                SKIP_DOCS: {
                    n: sorted(self.skip[s]) for s, n in enumerate(self.names) if self.skip[s]
                },
                SKIP_MET: {n: list(self.met[s]) for s, n in enumerate(self.names) if self.met[s]},
                SKIP_LOG: copy.deepcopy(self.skip_log),
            }
        }

    def _set_skips(self, state: dict) -> None:
        skips = state.get(SKIPS) or {}
        for s, name in enumerate(self.names):
            self.skip[s] = set(skips.get(SKIP_DOCS, {}).get(name, ()))
            self.met[s] = list(skips.get(SKIP_MET, {}).get(name, ()))
            self._met[s] = set(self.met[s])
        self.skip_log = copy.deepcopy(skips.get(SKIP_LOG, []))

    def _dry(self, s: int) -> None:
        """Stream `s` has nothing left: the mixer applies `on_exhausted`."""
        self.mixer.exhausted(s)
        self.finished = self.finished or self.mixer.stopped

    def __iter__(self) -> Packer:
        return self

    def __next__(self) -> Row:
        row = self.next_row()
        if row is None:
            raise StopIteration
        return row

    def next_row(self) -> Row | None:
        """The next row, or None when the data (or the run, on exhaustion) has ended."""
        self.replay()
        return self._row()

    def replay(self) -> None:
        """After `set_state`: pull the held documents again (done by the first `next_row`
        otherwise; the feed calls it once every stream's reading has begun)."""
        if self._resumed is not None:
            state, self._resumed = self._resumed, None
            for s, name in enumerate(self.names):
                saved = state[STREAMS].get(name)
                if saved is None:
                    continue
                self._replay(s, saved)
                # The run had seen the stream end: so must the resumed one (its state, too).
                if saved[DONE] and self._pull(s) is not None:
                    raise StateError(f"resume: stream {name!r} has documents past its end")
                # as saved: replaying counted the held documents' overflow once more
                self.counters[s] = PackCounters(**saved[COUNTERS])

    def _row(self) -> Row | None:
        raise NotImplementedError

    # -- resumable state: counters plus what is needed to rebuild buffers by replay --------

    def get_state(self) -> dict:
        if self._resumed is not None:  # set, not yet replayed: the state as it was set
            state = copy.deepcopy(self._resumed)
            state.pop(SKIPS, None)
            return state | self._skips_state()  # with the documents left out since
        return (
            {
                STREAMS: {
                    name: {
                        INPUT: self.sources[s].get_state(at=self._held_cursor(s)),
                        DONE: self.source_done[s],
                        COUNTERS: self.counters[s].as_dict(),
                    }
                    | self._stream_state(s)
                    for s, name in enumerate(self.names)
                },
                MIXER: self.mixer.get_state(),
                FINISHED: self.finished,
            }
            | self._own_state()
            | self._skips_state()
        )

    def set_state(self, state: dict) -> None:
        """Position every stream at its oldest held document, and the mixer; the held
        documents are pulled again (replayed) at the first row. A stream the state does not
        name (added at a resume) starts fresh."""
        for s, name in enumerate(self.names):
            st = state[STREAMS].get(name)
            if st is not None:
                self.sources[s].set_state(st[INPUT])
        self.mixer.set_state(state[MIXER])
        self.finished = bool(state[FINISHED])
        self._set_skips(state)
        self._resumed = state

    def _held_cursor(self, s: int):
        """The cursor of stream s's oldest document still held, or None (none held)."""
        raise NotImplementedError

    def _stream_state(self, s: int) -> dict:
        """What this packing mode keeps per stream, besides the common part."""
        return {}

    def _own_state(self) -> dict:
        """What this packing mode keeps for all streams."""
        return {}

    def _replay(self, s: int, state: dict) -> None:
        raise NotImplementedError


class ConcatPacker(Packer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[deque[Segment]] = [deque() for _ in self.sources]
        self._pulled: list[int] = [0] * len(self.sources)  # tokens in the current doc's pieces

    def _has_piece(self, s: int) -> bool:
        if self._pending[s]:
            return True
        pieces = self._pull(s)
        while pieces == []:  # a document left out
            pieces = self._pull(s)
        if pieces is None:
            self._dry(s)
            return False
        self._pending[s].extend(pieces)
        self._pulled[s] = sum(p.length for p in pieces)
        return True

    def _held_cursor(self, s: int):
        pending = self._pending[s]
        return pending[0].doc.cursor if pending else None

    def _stream_state(self, s: int) -> dict:
        pending = self._pending[s]
        # mid-document: re-pull it and skip what was already placed
        consumed = self._pulled[s] - sum(p.length for p in pending) if pending else None
        return {CONSUMED: consumed}

    def _replay(self, s: int, state: dict) -> None:
        consumed = state[CONSUMED]
        if consumed is not None:
            pieces = self._pull(s)
            if pieces is None:
                raise StateError(f"resume: stream {self.names[s]!r} has no document at its cursor")
            if not pieces:  # the held document is left out now: its rest goes too
                return
            self._pulled[s] = sum(p.length for p in pieces)
            pending = deque(pieces)
            while consumed > 0:
                head = pending[0]
                if head.length <= consumed:
                    consumed -= head.length
                    pending.popleft()
                else:
                    pending[0] = Segment(head.doc, head.offset + consumed, head.length - consumed)
                    consumed = 0
            self._pending[s] = pending

    def _row(self) -> Row | None:
        row: Row = []
        room = self.seq_len
        while room > 0 and not self.finished:
            live = [
                s
                for s in range(len(self.sources))
                if self.mixer.alive[s] and self.mixer.weights[s] > 0
            ]
            candidates = [s for s in live if self._has_piece(s)]
            if self.finished:
                break
            s = self.mixer.pick(candidates)
            if s is None:
                if not any(self.mixer.alive):
                    self.finished = True
                break
            piece = self._pending[s][0]
            take = min(piece.length, room, self.mixer.quota(s, self.seq_len))
            last = row[-1] if row else None
            if (
                last is not None
                and last.doc is piece.doc
                and last.offset + last.length == piece.offset
            ):
                # The next piece of the document just placed: one segment, positions go on
                # (a long document's pieces are cut at seq_len, not at this row's edge).
                row[-1] = Segment(last.doc, last.offset, last.length + take)
            else:
                row.append(Segment(piece.doc, piece.offset, take))
            self.mixer.place(s, take)
            if take == piece.length:
                self._pending[s].popleft()
            else:
                self._pending[s][0] = Segment(piece.doc, piece.offset + take, piece.length - take)
            room -= take
        return row or None


class BfdPacker(Packer):
    FIRST_POOL = 32

    def __init__(self, *args, buffer: int = 512, ramp_rows: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.buffer = buffer
        self.ramp_rows = max(1, ramp_rows)
        self.rows = 0
        self.pools = [_Pool() for _ in self.sources]
        self.arrivals = np.zeros(len(self.sources), dtype=np.int64)
        self._left_slots: list[range] = []  # arrival numbers of left-out documents (replay)

    def _pool_target(self) -> int:
        """The pool fills to 32 pieces for the first `ramp_rows` rows (a global step), then
        doubles every `ramp_rows` rows up to `buffer`: the first step needs a few dozen pieces
        per stream, not `buffer` of them. A pure function of the row count: deterministic."""
        return min(self.buffer, self.FIRST_POOL << min(self.rows // self.ramp_rows, 40))

    def _top_up(self, s: int) -> None:
        pool = self.pools[s]
        target = self._pool_target()
        while len(pool) < target:
            pieces = self._pull(s)
            if pieces is None:
                return
            if not pieces:  # left out (its arrival numbers taken)
                continue
            pieces[0].doc.arrival = int(self.arrivals[s])
            for p in pieces:
                pool.add(int(self.arrivals[s]), p)
                self.arrivals[s] += 1

    def _oldest(self, s: int) -> Doc | None:
        pool = self.pools[s]
        if not pool:
            return None
        return min((p.doc for p in pool.items.values()), key=lambda d: d.arrival)

    def _held_cursor(self, s: int):
        oldest = self._oldest(s)
        return oldest.cursor if oldest is not None else None

    def _stream_state(self, s: int) -> dict:
        """Arrival numbers: pieces `base`.. `arrivals` - 1 were pulled since the oldest held
        document; `pool` lists those still held."""
        oldest = self._oldest(s)
        base = oldest.arrival if oldest is not None else int(self.arrivals[s])
        return {BASE: base, ARRIVALS: int(self.arrivals[s]), POOL: sorted(self.pools[s].items)}

    def _own_state(self) -> dict:
        return {ROWS: self.rows}

    def set_state(self, state: dict) -> None:
        super().set_state(state)
        self.rows = int(state[ROWS])

    def _left_out(self, s: int, slots: int) -> None:
        start = int(self.arrivals[s])
        self.arrivals[s] += slots
        self._left_slots.append(range(start, start + slots))

    def _replay(self, s: int, saved: dict) -> None:
        keep = set(saved[POOL])
        self.arrivals[s] = saved[BASE]
        self._left_slots = []
        while self.arrivals[s] < saved[ARRIVALS]:
            pieces = self._pull(s)
            if pieces is None:
                raise StateError(
                    f"resume: stream {self.names[s]!r} ended while replaying the documents its "
                    "state buffers: its sources changed since the state was written (see the "
                    "rejects)"
                )
            if not pieces:  # left out: a held piece of it is dropped now
                continue
            pieces[0].doc.arrival = int(self.arrivals[s])
            for p in pieces:
                if int(self.arrivals[s]) in keep:
                    self.pools[s].add(int(self.arrivals[s]), p)
                self.arrivals[s] += 1
        held = len(keep - {a for r in self._left_slots for a in r})
        if self.arrivals[s] != saved[ARRIVALS] or len(self.pools[s]) != held:
            raise StateError(f"resume: stream {self.names[s]!r} replay does not match the state")

    def _first_piece(self, s: int) -> Segment:
        pool = self.pools[s]
        oldest = pool.oldest_arrival()
        if oldest < self.arrivals[s] - 2 * self.buffer:
            return pool.pop_arrival(oldest)
        piece = pool.pop_largest_fitting(self.seq_len)
        assert piece is not None  # s has a non-empty pool, and _pieces cuts pieces to seq_len
        return piece

    def _row(self) -> Row | None:
        if self.finished:
            return None
        n = len(self.sources)
        for t in range(n):
            if self.mixer.alive[t] and self.mixer.weights[t] > 0:
                self._top_up(t)
                if not self.pools[t] and self.source_done[t]:
                    self._dry(t)
        if self.finished:
            return None
        live = [s for s in range(n) if self.mixer.alive[s] and self.pools[s]]
        s = self.mixer.pick(live)
        if s is None:
            if not any(self.mixer.alive):
                self.finished = True
            return None
        first = self._first_piece(s)
        self._top_up(s)  # keep the pool full within the row: a stream of tiny pieces can fill it
        row: Row = [first]
        self.mixer.place(s, first.length)
        room = self.seq_len - first.length
        while room > 0:
            fitting = [i for i in live if self.pools[i] and self.pools[i].min_length() <= room]
            i = self.mixer.pick(fitting)
            if i is None:
                break
            piece = self.pools[i].pop_largest_fitting(room)
            assert piece is not None  # i is in `fitting`: its shortest piece fits
            self._top_up(i)
            row.append(piece)
            self.mixer.place(i, piece.length)
            room -= piece.length
        self.rows += 1
        return row


def make_packer(
    mode: str, seq_len: int, overflow: str, sources: Mapping[str, Stage[Doc]],
    mixer: DeficitMixer, buffer: int, ramp_rows: int = 1,
) -> Packer:  # fmt: skip
    if mode == "concat":
        return ConcatPacker(seq_len, overflow, sources, mixer)
    return BfdPacker(seq_len, overflow, sources, mixer, buffer=buffer, ramp_rows=ramp_rows)
