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
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pipeline.documents import Doc
from pipeline.mixing import DeficitMixer


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


class Packer:
    """Common part: pulling documents per stream, overflow handling, exhaustion policy."""

    def __init__(
        self,
        seq_len: int,
        overflow: str,
        sources: list[Iterator[Doc]],
        mixer: DeficitMixer,
        on_exhausted: str = "stop",
    ):
        self.seq_len = seq_len
        self.overflow = overflow
        self.sources = sources
        self.mixer = mixer
        self.on_exhausted = on_exhausted
        self.counters = [PackCounters() for _ in sources]
        self.source_done = [False] * len(sources)
        self.finished = False  # set when the run must stop (exhaustion with on_exhausted=stop)
        self.exhausted_log: list[str] = []

    def _pieces(self, doc: Doc) -> list[Segment]:
        n, L = len(doc), self.seq_len
        if n <= L:
            return [Segment(doc, 0, n)] if n else []
        c = self.counters[doc.stream]
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
        """The next document's pieces from stream `s`, or None when the stream has ended."""
        while not self.source_done[s]:
            doc = next(self.sources[s], None)
            if doc is None:
                self.source_done[s] = True
                break
            pieces = self._pieces(doc)
            if pieces:
                return pieces
        return None

    def _dry(self, s: int) -> None:
        """Stream `s` has nothing left: stop the run or renormalize, per `on_exhausted`."""
        if not self.mixer.alive[s]:
            return
        name = self.mixer.names[s]
        others = [i for i in range(len(self.sources)) if i != s and self.mixer.alive[i]]
        if self.on_exhausted == "stop" or not others:
            self.finished = True
            self.exhausted_log.append(f"stream {name!r} exhausted: stopping the run")
        else:
            self.exhausted_log.append(f"stream {name!r} exhausted: renormalizing the others")
        self.mixer.retire(s)

    def next_row(self) -> Row | None:
        raise NotImplementedError

    # -- resumable state: counters plus what is needed to rebuild buffers by replay --------

    def state(self, next_cursors: list) -> dict:
        """JSON-able state; `next_cursors[s]` is stream s's cursor after its last pulled doc.

        Returns it with "restart": per stream, the cursor a resumed stream must start from.
        """
        return {
            "source_done": list(self.source_done),
            "finished": self.finished,
            "exhausted_log": list(self.exhausted_log),
            "counters": [c.as_dict() for c in self.counters],
        }

    def restore(self, state: dict) -> None:
        """Rebuild buffers by replay (sources must start at the state's restart cursors)."""
        self._replay(state)
        self.source_done = list(state["source_done"])
        self.finished = state["finished"]
        self.exhausted_log = list(state["exhausted_log"])
        self.counters = [PackCounters(**c) for c in state["counters"]]

    def _replay(self, state: dict) -> None:
        raise NotImplementedError


class ConcatPacker(Packer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending: list[deque[Segment]] = [deque() for _ in self.sources]
        self._pulled: list[int] = [0] * len(self.sources)  # tokens in the current doc's pieces

    def _has_piece(self, s: int) -> bool:
        if self._pending[s]:
            return True
        pieces = self._pull(s)
        if pieces is None:
            self._dry(s)
            return False
        self._pending[s].extend(pieces)
        self._pulled[s] = sum(p.length for p in pieces)
        return True

    def state(self, next_cursors: list) -> dict:
        out = super().state(next_cursors)
        consumed, restart = [], []
        for s, pending in enumerate(self._pending):
            if pending:  # mid-document: re-pull it and skip what was already placed
                consumed.append(self._pulled[s] - sum(p.length for p in pending))
                restart.append(pending[0].doc.cursor)
            else:
                consumed.append(None)
                restart.append(next_cursors[s])
        return out | {"consumed": consumed, "restart": restart}

    def _replay(self, state: dict) -> None:
        for s, consumed in enumerate(state["consumed"]):
            if consumed is None:
                continue
            pieces = self._pull(s)
            if pieces is None:
                raise ValueError(
                    f"resume: stream {self.mixer.names[s]!r} has no document at its cursor"
                )
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

    def next_row(self) -> Row | None:
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
            pieces[0].doc.arrival = int(self.arrivals[s])
            for p in pieces:
                pool.add(int(self.arrivals[s]), p)
                self.arrivals[s] += 1

    def state(self, next_cursors: list) -> dict:
        out = super().state(next_cursors)
        pools, restart = [], []
        for s, pool in enumerate(self.pools):
            if pool:
                oldest = min((p.doc for p in pool.items.values()), key=lambda d: d.arrival)
                restart.append(oldest.cursor)
                base = oldest.arrival
            else:
                restart.append(next_cursors[s])
                base = int(self.arrivals[s])
            pools.append(
                {"base": base, "arrivals": int(self.arrivals[s]), "pool": sorted(pool.items)}
            )
        return out | {"pools": pools, "restart": restart, "rows": self.rows}

    def _replay(self, state: dict) -> None:
        self.rows = int(state["rows"])
        for s, saved in enumerate(state["pools"]):
            keep = set(saved["pool"])
            self.arrivals[s] = saved["base"]
            while self.arrivals[s] < saved["arrivals"]:
                pieces = self._pull(s)
                if pieces is None:
                    raise ValueError(
                        f"resume: stream {self.mixer.names[s]!r} ended while replaying the "
                        "documents its state buffers: its sources changed since the state was "
                        "written (see the rejects)"
                    )
                pieces[0].doc.arrival = int(self.arrivals[s])
                for p in pieces:
                    if int(self.arrivals[s]) in keep:
                        self.pools[s].add(int(self.arrivals[s]), p)
                    self.arrivals[s] += 1
            if self.arrivals[s] != saved["arrivals"] or len(self.pools[s]) != len(keep):
                raise ValueError(
                    f"resume: stream {self.mixer.names[s]!r} replay does not match the state"
                )

    def _first_piece(self, s: int) -> Segment:
        pool = self.pools[s]
        oldest = pool.oldest_arrival()
        if oldest < self.arrivals[s] - 2 * self.buffer:
            return pool.pop_arrival(oldest)
        return pool.pop_largest_fitting(self.seq_len)

    def next_row(self) -> Row | None:
        if self.finished:
            return None
        n = len(self.sources)
        for s in range(n):
            if self.mixer.alive[s] and self.mixer.weights[s] > 0:
                self._top_up(s)
                if not self.pools[s] and self.source_done[s]:
                    self._dry(s)
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
            self._top_up(i)
            row.append(piece)
            self.mixer.place(i, piece.length)
            room -= piece.length
        self.rows += 1
        return row


def make_packer(
    mode: str, seq_len: int, overflow: str, sources, mixer, on_exhausted: str, buffer: int,
    ramp_rows: int = 1,
) -> Packer:  # fmt: skip
    if mode == "concat":
        return ConcatPacker(seq_len, overflow, sources, mixer, on_exhausted)
    return BfdPacker(
        seq_len, overflow, sources, mixer, on_exhausted, buffer=buffer, ramp_rows=ramp_rows
    )
