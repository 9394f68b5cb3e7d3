"""Provenance: which documents fed a step. For every row of a global step, each segment's
stream, source file, record (line / row / sample index in that file), the token range of the
document it holds, and optionally its decoded text.

Identity. Every segment carries `doc_id = (file_index << 32) | record_index`, where
`file_index` indexes the stream's sorted data files (`sources.data_files` over the paths the
config resolved: for MDS, the shards) and `record_index` is the record's place in its file. Both depend on the config's paths and
the files only, never on the world size, the lane of a worker or a resume, so a step's
provenance is the same whoever asks and whenever. `doc_offset` is the segment's first token
within its document, so a split document's pieces are told apart.

Where the step comes from, cheapest first:
- an export's directory: the step's files (one per rank), read as they are;
- a running service: the step, if the server still holds it; else the state the producer kept
  for a step at or before it (`service.keep_states`, the last 10,000), replayed from there;
- a state plus its config: the feed is rebuilt at the state (its buffer replayed, seconds) and
  run forward to the step. The cost is the steps between the state and the one asked for, read
  and tokenized in this process: with states every K steps, at most K steps, never the run's
  prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa

from pipeline.config import Config
from pipeline.feed import rank_rows

RECORD_BITS = 32


def stream_files(cfg: Config) -> dict[str, list[str]]:
    """Per stream, the files `file_index` refers to (as `documents.DocSource.files`)."""
    from pipeline.read.access import Access
    from pipeline.read.sources import data_files

    found = {}
    for name, s in cfg.streams.items():
        assert s.format is not None  # load_config resolves every stream's format
        found[name] = data_files(list(s.paths), s.format, Access.of(s))
    return found


def segments(
    batch: pa.RecordBatch,
    step: int,
    files: dict[str, list[str]],
    world_size: int = 1,
    global_batch_size: int | None = None,
    text=None,
) -> list[dict]:
    """Every segment of a global step's rows (a full or compact batch of every row), in row
    order: {step, row, rank, stream, source, record, doc_id, tokens: [start, end), row_span:
    [start, end)} (+ `text` when `text` is a decode function of a list of ids)."""
    G = global_batch_size or batch.num_rows
    ranks = [0] * batch.num_rows
    for r in range(world_size):
        rows = rank_rows(batch.num_rows, r, world_size, G)
        for i in range(rows.start, rows.stop):
            ranks[i] = r
    ids = batch.column("input_ids").flatten().to_numpy(zero_copy_only=False)
    L = batch.column("input_ids").type.list_size
    lens = batch.column("seq_lens").to_pylist()
    streams = batch.column("stream").to_pylist()
    doc_ids = batch.column("doc_id").to_pylist()
    offsets = batch.column("doc_offset").to_pylist()
    out = []
    for row in range(batch.num_rows):
        at = 0
        for n, name, doc, off in zip(
            lens[row], streams[row], doc_ids[row], offsets[row], strict=True
        ):
            fi, rec = int(doc) >> RECORD_BITS, int(doc) & ((1 << RECORD_BITS) - 1)
            stream_files = files.get(name, [])
            seg = {
                "step": step,
                "row": row,
                "rank": ranks[row],
                "stream": name,
                "source": stream_files[fi] if fi < len(stream_files) else f"<file {fi}>",
                "record": rec,
                "doc_id": int(doc),
                "tokens": [int(off), int(off) + int(n)],
                "row_span": [at, at + int(n)],
            }
            if text is not None:
                seg["text"] = text(ids[row * L + at : row * L + at + int(n)].tolist())
            out.append(seg)
            at += int(n)
    return out


def decoder(cfg: Config):
    """A function of a list of ids to their text, with the run's tokenizer."""
    from pipeline.tokenize.engines import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer).tokenizer
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def export_step(out: Path, step: int) -> tuple[pa.RecordBatch, int]:
    """A global step of an export's directory as one batch of every row (its rank files
    joined in rank order), and the world size it was written with."""
    from wire.layout import read_step

    files = sorted(Path(out).glob(f"step-{step:08d}-rank-*.*"))
    files = [f for f in files if f.suffix in (".parquet", ".arrow")]
    if not files:
        held = sorted(Path(out).glob("step-*-rank-0.*"))
        span = f"{held[0].name}..{held[-1].name}" if held else "none"
        raise FileNotFoundError(
            f"{out}: no files of step {step} (step files there: {span}; an MDS export has no "
            "step files: trace it from a state and its config instead)"
        )
    files.sort(key=lambda f: int(f.stem.rsplit("-", 1)[1]))
    parts = [read_step(f) for f in files]
    joined = pa.concat_batches([p.replace_schema_metadata(None) for p in parts])
    return joined, len(files)


def state_steps(
    cfg: Config, state: dict, steps: Iterable[int]
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Global steps `steps` (ascending) recomputed from `state` (at or before the first), in
    this process: the feed is rebuilt once and run forward once, past every step asked for."""
    from pipeline.feed import StepFeed
    from pipeline.lanes import LanedFeed
    from pipeline.read.reading import iter_blocks_local

    wanted = sorted(set(steps))
    at = int(state["step"])
    if wanted and wanted[0] < at:
        raise ValueError(f"the state is at step {at}: it cannot give the earlier step {wanted[0]}")
    if not wanted:
        return
    _check_policy(cfg, state, at, wanted[-1])
    feed = (
        StepFeed(cfg, executor=iter_blocks_local, state=state)
        if cfg.lanes == 1
        else LanedFeed(cfg, local=True, state=state)  # every lane, here, from its state
    )
    try:
        for step in range(at, wanted[-1] + 1):
            batch = feed.next_step()
            if batch is None:
                raise ValueError(f"the data ends before step {step}")
            if step in wanted:
                yield step, batch
    finally:
        feed.close()


def _check_policy(cfg: Config, state: dict, at: int, last: int) -> None:
    """Under `mixing.policy`, a state knows the weights of the decisions up to its step only:
    later ones came from the trainer's loss. ValueError if steps up to `last` need one."""
    from pipeline.stages.policy import SOURCE, window_for

    policy = cfg.mixing.policy
    if policy is None:
        return
    feed = state["lanes"][0] if "lanes" in state else state  # every lane has the history
    history = feed.get("packer", {}).get("mixer", {}).get("history", [])
    decided = {c.get("step") for c in history if c.get("source") == SOURCE}
    for t in range(at, last + 1):
        if window_for(t, policy.every, policy.delay) and t not in decided:
            raise ValueError(
                f"step {t} takes the weights the mixing policy chose from the trainer's loss, "
                f"which the state at step {at} does not hold: recompute from a state at or "
                f"after step {t} (a service keeps every step's state: "
                "GET /v1/steps/{n}/provenance)"
            )


def state_step(cfg: Config, state: dict, step: int) -> pa.RecordBatch:
    """Global step `step` recomputed from `state` (at or before it), in this process."""
    return next(state_steps(cfg, state, [step]))[1]


class RankOutsideWorld(ValueError):
    """A rank asked for that the world the rows are split among does not have."""


def trace(
    cfg: Config,
    steps: Iterable[int],
    *,
    out: Path | None = None,
    state: dict | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    text: bool = False,
) -> list[dict]:
    """The provenance of `steps`, from an export's directory (`out`) or a state."""
    files = stream_files(cfg)
    decode = decoder(cfg) if text else None
    found: list[dict] = []
    if out is not None:
        batches = ((step, *export_step(out, step)) for step in steps)
    elif state is not None:
        batches = ((step, batch, 1) for step, batch in state_steps(cfg, state, steps))
    else:
        raise ValueError("trace needs an export's directory or a state")
    for step, batch, written_world in batches:
        world = world_size or written_world
        if rank is not None and not 0 <= rank < world:
            raise RankOutsideWorld(f"rank {rank} is outside world size {world} (step {step})")
        segs = segments(batch, step, files, world, cfg.global_batch_size, decode)
        found += [s for s in segs if rank is None or s["rank"] == rank]
    return found


def documents_of(segs: Iterable[dict]) -> list[dict]:
    """The distinct documents of some segments: {stream, source, record, doc_id}, in order."""
    seen, docs = set(), []
    for s in segs:
        key = (s["stream"], s["doc_id"])
        if key not in seen:
            seen.add(key)
            docs.append({k: s[k] for k in ("stream", "source", "record", "doc_id")})
    return docs


def steps_documents(cfg: Config, steps: list[int], *, out: Path | None = None,
                    state: dict | None = None) -> list[dict]:  # fmt: skip
    """The distinct documents `steps` drew ({stream, source, record, doc_id}): from an
    export's directory where it holds them all, else recomputed from `state` (at or before
    the first of them)."""
    if out is not None:
        try:
            return documents_of(trace(cfg, steps, out=out))
        except FileNotFoundError:
            if state is None:
                raise
    if state is None:
        raise ValueError("the documents of steps come from an export's directory or a state")
    return documents_of(trace(cfg, steps, state=state))


def format_steps(steps: list[int]) -> str:
    """Ascending steps as `parse_steps` reads them: [3, 4, 5, 9] -> "3-5,9"."""
    out, run = [], [steps[0]] if steps else []
    for s in steps[1:]:
        if s == run[-1] + 1:
            run.append(s)
        else:
            out.append(run)
            run = [s]
    out += [run] if run else []
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out)


def parse_steps(text: str) -> list[int]:
    """`12`, `41230-41240` or `3,7,9-11`: the steps, ascending, each once (at most 100,001
    per range). ValueError otherwise."""
    steps: set[int] = set()
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise ValueError(f"{text!r}: expected N, N-M or a comma list of them") from None
        if lo < 0 or hi < lo or hi - lo > 100_000:
            raise ValueError(f"{text!r}: {part!r} is not a range of steps")
        steps.update(range(lo, hi + 1))
    return sorted(steps)


def read_documents(cfg: Config, path: str) -> list[dict]:
    """Documents named in a file: a JSON list or JSON lines of objects, each with `stream`
    and either `doc_id` or `source` and `record` (what `tokenmill trace --json` prints, so
    its output can be edited down and passed on). A line that names neither is an error
    naming the file and the line."""
    import json

    text = Path(path).read_text(encoding="utf-8")
    try:
        parsed = json.loads(text)
        entries = parsed if isinstance(parsed, list) else [parsed]
        lines = list(range(1, len(entries) + 1))
    except ValueError:
        entries, lines = [], []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{path}: line {n}: not JSON: {e}") from None
                lines.append(n)
    return named_documents(cfg, entries, [f"{path}: entry {n}" for n in lines])


def named_documents(cfg: Config, entries: list, where: list[str]) -> list[dict]:
    """The documents `entries` name ({stream, doc_id} or {stream, source, record}), as
    {stream, doc_id}; ValueError naming the entry (`where[i]`) that names none."""
    files = stream_files(cfg)
    index = {name: {f: i for i, f in enumerate(fs)} for name, fs in files.items()}
    docs = []
    for at, entry in zip(where, entries, strict=True):
        if not isinstance(entry, dict) or entry.get("stream") not in files:
            raise ValueError(f"{at}: needs a 'stream' of the config {sorted(files)}")
        stream = entry["stream"]
        if isinstance(entry.get("doc_id"), int) and not isinstance(entry["doc_id"], bool):
            doc_id = entry["doc_id"]
        elif entry.get("source") in index[stream] and isinstance(entry.get("record"), int):
            doc_id = (index[stream][entry["source"]] << RECORD_BITS) | entry["record"]
        else:
            raise ValueError(
                f"{at}: needs a 'doc_id', or a 'source' (one of stream {stream!r}'s files) "
                "and a 'record'"
            )
        docs.append({"stream": stream, "doc_id": doc_id})
    return docs


def leave_out(docs: Iterable[dict], why: str):
    """A `feed.LeaveOut` of documents ({stream, doc_id, ...})."""
    from pipeline.feed import LeaveOut

    ids: dict[str, set[int]] = {}
    for d in docs:
        ids.setdefault(d["stream"], set()).add(int(d["doc_id"]))
    return LeaveOut({k: frozenset(v) for k, v in ids.items()}, why)
