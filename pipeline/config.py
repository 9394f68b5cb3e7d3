"""The run configuration, validated once at the edge into frozen models: the bottom of
`pipeline/`, importing nothing else of tokenmill, so that every layer may read it.

Everything past `load_config` (pipeline/read/resolve.py: the file read and its paths resolved)
trusts these objects. Validation errors name the key and the offending value, e.g.
``streams.code.weight: must be > 0, got -1``. Here too is what identifies a run's sequence
(`Config.config_hash`, with the content of the tokenizer it names: `tokenizer_digest`) and
what a valid mixture is (`normalize_weights`).
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

# Token id columns of raw bytes (`tokens_dtype`): LLM-Foundry's `--concat_tokens` wrote int64.
TokensDtype = Literal["uint16", "int16", "uint32", "int32", "int64"]
# `model_dump(context=REVEAL_SECRETS)` keeps `storage_options` values: only for handing the
# config to the processes that read (Ray tasks, the service actor), never for output.
REVEAL_SECRETS = {"reveal_secrets": True}
REDACTED = "***"


def redact(options) -> dict:
    """Storage options with their keys kept and every value replaced (they hold secrets)."""
    return {k: REDACTED for k in (options or {})}


# --- Stream weights: what a valid mixture is (the config's, a schedule's, a PUT's) ---


def normalize_weights(weights: Mapping[str, float], names: list[str]) -> np.ndarray:
    """Validate and normalize; streams not named get weight 0. Raises ValueError with the key."""
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"unknown stream {unknown[0]!r}; streams are {names}")
    w = np.zeros(len(names), dtype=np.float64)
    for i, name in enumerate(names):
        v = weights.get(name, 0.0)
        w[i] = check_weight(name, v)
    with np.errstate(over="ignore"):
        total = w.sum()
    if total <= 0:
        raise ValueError("weights must not all be zero")
    if not math.isfinite(total):  # e.g. 1e308 + 1e308: scale first, the shares are the same
        w = w / w.max()
        total = w.sum()
    return w / total


def check_weight(name: str, v) -> float:
    """One weight as a finite float >= 0, or a ValueError that names the stream."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"weight of {name!r} must be a number, got {v!r}")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"weight of {name!r} is too large ({len(str(v))} digits)") from None
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"weight of {name!r} must be finite and >= 0, got {f}")
    return f


# --- What a tokenizer.name holds: its files' content, for cache keys and the config hash ---

# The files of a tokenizer directory (or Hub repo) that shape its ids; weights are not read.
TOKENIZER_FILE_NAMES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
    "chat_template.jinja", "chat_template.json",
)  # fmt: skip
# path -> (its stat signature, its sha256): a file is hashed again only when its stat changes.
# Shared by every thread of a process (the feed, the head start, a pool actor's calls); the
# lock guards it, and is not held while hashing (two threads may hash one file at once).
_DIGESTS: dict[str, tuple[tuple, str]] = {}
_DIGESTS_LOCK = threading.Lock()


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, hashed again only when its stat changes."""
    st = path.stat()
    signature = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
    key = str(path)
    with _DIGESTS_LOCK:
        hit = _DIGESTS.get(key)
    if hit is not None and hit[0] == signature:
        return hit[1]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS[key] = (signature, digest)
    return digest


def tokenizer_digest(name: str) -> str | None:
    """The sha256 of what tokenizer `name` is read from: a file's bytes, or a directory's
    (or a locally cached Hub repo's) tokenizer files (TOKENIZER_FILE_NAMES), by name and
    content. None for 'default' (pinned: CL100K_SHA256 and the conversion recipe) and for a
    name with no local files. Re-hashed only when a file's stat changes (~10 us a call
    otherwise; hashing cl100k's 14 MB tokenizer.json takes ~0.02 s).
    """
    if name == "default":
        return None
    path = Path(name).expanduser()
    if path.is_file():
        return file_digest(path)
    files: dict[str, Path] = {}
    if path.is_dir():
        files = {f: path / f for f in TOKENIZER_FILE_NAMES if (path / f).is_file()}
    elif not name.startswith((".", "/", "~")):
        try:
            from huggingface_hub import try_to_load_from_cache

            for f in TOKENIZER_FILE_NAMES:
                cached = try_to_load_from_cache(name, f)
                if isinstance(cached, str):
                    files[f] = Path(cached)
        except (ImportError, ValueError):
            return None
    if not files:
        return None
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f"{f}\0{file_digest(files[f])}\0".encode())
    return h.hexdigest()


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the value."""


def _scalar_kinds(annotation: Any) -> set[type] | None:
    """The scalar types (int, float, bool, None) an annotation admits, or None when it admits
    anything else too (a str, a model, a list)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else (annotation,)  # fmt: skip
    kinds = {type(None) if a is type(None) else a for a in args}
    return kinds if kinds <= {int, float, bool, type(None)} else None


def _check_scalar(kinds: set[type], value: Any, where: str = "") -> None:
    """Strict scalars: no bool where a number is meant, no number where a bool is, no string
    for either (YAML's `"2"` or `yes` would otherwise be coerced quietly), no float for an int,
    and only finite floats (a time of `.inf` would wait for ever)."""
    if value is None and type(None) in kinds:
        return
    if isinstance(value, bool):
        ok = bool in kinds
    elif isinstance(value, int):
        ok = int in kinds or float in kinds
    elif isinstance(value, float):
        ok = float in kinds and math.isfinite(value)
    else:
        ok = False
    if not ok:
        want = " or ".join(sorted("null" if k is type(None) else "a finite number" if k is float
                                  else k.__name__ for k in kinds))  # fmt: skip
        raise ValueError(f"{where}must be {want}" + (f", got {value!r}" if where else ""))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        """Pydantic's lax mode turns `true` into 1 and `"2"` into 2; a config says what it means."""
        annotation = cls.model_fields[info.field_name].annotation if info.field_name else None
        if (kinds := _scalar_kinds(annotation)) is not None:
            _check_scalar(kinds, value)
        elif (
            typing.get_origin(annotation) is dict
            and isinstance(value, Mapping)
            and (kinds := _scalar_kinds(typing.get_args(annotation)[1])) is not None
        ):
            for key, item in value.items():
                _check_scalar(kinds, item, f"[{key!r}] ")
        return value


class TokenizerConfig(_Frozen):
    """Which tokenizer, and the explicit BOS/EOS policy.

    `name` is 'default' (the offline cl100k_base tokenizer), a Hugging Face hub name, a local
    directory, a `tokenizer.json` file or a SentencePiece `.model` file. Pretrain documents get
    EOS appended, and BOS prepended where the tokenizer's own config does so; ids left as None
    come from the tokenizer itself.
    """

    name: str = "default"
    # None: what the tokenizer itself says (tokenizer_config.json's add_bos_token, or a
    # post-processor that puts BOS first, as Llama's do); False for 'default'.
    add_bos: bool | None = None
    add_eos: bool = True
    bos_id: int | None = Field(default=None, ge=0)
    eos_id: int | None = Field(default=None, ge=0)
    pad_id: int | None = Field(default=None, ge=0)
    chat_template: str | None = None
    # `auto` encodes with a fast engine (fastokens, else tiktoken) where it is proven to give
    # this tokenizer's ids (a probe at load, then `verify_fraction` of every batch re-encoded
    # by HF and compared; a mismatch sends the batch to HF). `hf` never uses one; `tiktoken`
    # and `fastokens` name the engine and make a mismatch an error.
    # Neither changes the batches, so neither is in the config hash.
    backend: Literal["auto", "hf", "tiktoken", "fastokens"] = "auto"
    verify_fraction: float = Field(default=0.01, gt=0, le=1)


class PackingConfig(_Frozen):
    """`concat` cuts a token stream into rows; `bfd` keeps documents whole (best fit, decreasing)."""

    mode: Literal["concat", "bfd"] = "bfd"
    buffer: int = Field(default=512, ge=1, le=1_000_000)
    overflow: Literal["split", "truncate", "drop"] = "split"


class ShuffleConfig(_Frozen):
    """How a stream's documents are shuffled, per epoch (pipeline/stages/shuffle.py).

    - `files`: false reads the files, and each file's pieces, in order (no piece order, no
      interleave); with `window: 1` that is the files' own order.
    - `pieces`: the pieces (byte ranges, row groups, shards; every file's) are read in a seeded
      order across the stream, this many open at once, their documents merged by a seeded
      schedule. Memory: the open pieces' tokens plus one read unit, per stream: about
      `pieces` x `piece_bytes` + `read.block_bytes` (72 MiB by default); time to the first
      step: a few pieces (one opens per 2 documents drawn); a resume re-reads the open
      pieces (64 MiB by default). 0: the window-only shuffle of tokenmill's first releases
      (seeded file order, each file's pieces in order, one at a time).
    - `piece_bytes`: files are cut this fine for the shuffle (JSONL byte ranges, Arrow batch
      runs; a Parquet row group or an MDS shard is one piece whatever its size), at most
      `read.piece_bytes`. Smaller pieces mix more pieces for the same memory, at one seek each.
    - `window`: a permutation inside consecutive windows of this many documents, on top
      (memory: the window's documents; the first window of an epoch holds 8).
    """

    files: bool = True
    pieces: int = Field(default=256, ge=0, le=65536)
    piece_bytes: int = Field(default=256 << 10, ge=4 << 10)
    window: int = Field(default=256, ge=1, le=10_000_000)

    @property
    def interleaved(self) -> bool:
        """Whether pieces are read in a seeded order across files and interleaved."""
        return self.files and self.pieces > 0


MAX_RECORD_BYTES = 64 << 20


class ReadConfig(_Frozen):
    """How reading is cut into Ray Data tasks (see docs/architecture.md)."""

    block_bytes: int = Field(default=8 << 20, ge=1 << 10)
    first_block_bytes: int = Field(default=1 << 20, ge=1 << 10)

    @property
    def piece_bytes(self) -> int:
        """Large files are cut this fine, so that the ramp-up units can be small."""
        return min(self.block_bytes, self.first_block_bytes)

    max_in_flight: int = Field(default=0, ge=0)  # 0: 2 x the cluster's CPUs
    # With interleaved pieces: the first `shuffle.pieces` pieces of the first epoch are read
    # in up to this many parts each, their first rows ahead of the rest, so that the first
    # steps ask a few times their own tokens tokenized, not all of those pieces'
    # (stages/plan.py `ramp_parts`). 1: whole pieces. None (the default): 5 where ranks wait
    # on the first steps (`serve`, a Feed), 1 in `export`, which wants throughput: there the
    # parts' re-reads and smaller units cost ~9% CPU on a 128 MiB export. The same documents
    # in the same order either way, so not in the config hash.
    ramp_parts: int | None = Field(default=None, ge=1)
    # A JSONL record (line) or text-format file longer than this is a counted reject, read
    # past without being held: one huge line (a decompression bomb, a file without line
    # endings) cannot exhaust memory.
    max_record_bytes: int = Field(default=MAX_RECORD_BYTES, gt=0)
    # With `lanes` > 1: each lane reads and tokenizes its share in its own process (true:
    # one tokenizing process per lane, no block crossing processes), or hands that to Ray
    # Data's tasks (false: more tokenizing processes than lanes, for a slow tokenizer).
    # The blocks are the same either way, so it is not in the config hash.
    in_lanes: bool = True
    # With `in_lanes`: true, a lane actor reads its share on a thread of its own, up to a read
    # unit ahead of its packer (pipeline/read/reading.py `read_ahead`), on cores the lanes
    # leave idle. Where a lane's process has a core to spare it makes more (the mean lane of
    # 16 with two cores: 12.4M tokens/s against 10.3M); where its threads share one it costs
    # (6.9M against 7.7M). False (the default): read as the lane packs. The same blocks
    # either way, so not in the config hash either.
    ahead: bool = False


class StreamConfig(_Frozen):
    """One named stream. `format` is a module of pipeline/read/formats/ (jsonl, parquet, text, mds,
    arrow, export), inferred from the files when omitted.

    `tokens_field` (pretrain only) reads token ids from that field or column, with no
    tokenizer: BOS/EOS are still added per `tokenizer`, and an id outside the tokenizer's
    vocabulary makes the record bad. `tokens_dtype` says how to read a raw `bytes` value.
    `storage_options` go to fsspec for URLs (endpoint_url, key, secret, anon, profile, ...);
    they are secrets: shown as "***" in every dump, repr and message, left out of the hash.
    """

    kind: Literal["pretrain", "chat"] = "pretrain"
    paths: list[str]
    format: str | None = None
    text_field: str = "text"
    messages_field: str = "messages"
    tokens_field: str | None = None
    tokens_dtype: TokensDtype | None = None
    weight: float = 1.0
    repeat: int = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    storage_options: dict[str, Any] = Field(default_factory=dict)

    @field_serializer("storage_options")
    def _hide_secrets(self, v: dict[str, Any], info: SerializationInfo) -> dict[str, Any]:
        if (info.context or {}).get("reveal_secrets"):
            return v
        return redact(v)

    def __repr_args__(self):
        for k, v in super().__repr_args__():
            yield k, redact(v) if k == "storage_options" else v

    @model_validator(mode="after")
    def _tokens_field_fits(self) -> StreamConfig:
        if self.tokens_field is not None and self.kind != "pretrain":
            raise ValueError(f"tokens_field is for kind pretrain, got kind {self.kind!r}")
        if self.tokens_field is not None and self.format in ("text", "export"):
            raise ValueError(f"tokens_field does not apply to format {self.format!r}")
        if self.tokens_dtype is not None and self.tokens_field is None:
            raise ValueError("tokens_dtype needs tokens_field")
        return self

    @field_validator("paths")
    @classmethod
    def _non_empty_paths(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must list at least one path")
        if any(not p.strip() for p in v):
            raise ValueError(f"contains an empty path: {v!r}")
        return v

    @field_validator("weight")
    @classmethod
    def _positive_weight(cls, v: float) -> float:
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"must be a finite number > 0, got {v}")
        return v


class PolicyConfig(_Frozen):
    """`mixing.policy`: weights that follow each stream's training loss, as the trainer ranks
    report it (pipeline/stages/policy.py has the rule; README "Mixing that follows the loss").
    Decision k reads the mean loss of steps [k*every - every, k*every) and takes effect at
    step k*every + delay."""

    every: int = Field(ge=1, le=1 << 20)  # N: steps per loss window, and between decisions
    # D: steps from a window's end to its decision. The producer waits at step kN + D for the
    # ranks' reports of steps up to kN - 1; meanwhile the ranks train on the D steps made.
    delay: int = Field(default=40, ge=1, le=1 << 20)
    eta: float = Field(default=1.0, gt=0, le=100)  # the multiplicative step size
    smoothing: float = Field(default=0.0, ge=0, le=1)  # the share of the config's weights kept
    reference: dict[str, float] = {}  # per stream, the loss counted as no excess (default 0)
    # Per stream, the lowest and highest share the policy may give (default: half and twice
    # the config's share, at most 1).
    bounds: dict[str, tuple[float, float]] = {}
    # How long the service waits for a window's loss (every rank's report) before it fails
    # with an error naming the steps and ranks; not part of the sequence (not hashed).
    wait_s: float = Field(default=600.0, gt=0)

    @field_validator("reference")
    @classmethod
    def _finite_references(cls, v: dict[str, float]) -> dict[str, float]:
        for name, loss in v.items():
            if not math.isfinite(loss) or loss < 0:
                raise ValueError(f"reference[{name!r}] must be a finite loss >= 0, got {loss}")
        return v

    @field_validator("bounds")
    @classmethod
    def _ordered_bounds(cls, v: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        for name, (lo, hi) in v.items():
            if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo <= hi <= 1):
                raise ValueError(f"bounds[{name!r}] must be [lo, hi] with 0 <= lo <= hi <= 1, "
                                 f"got [{lo}, {hi}]")  # fmt: skip
        return v

    def bounds_for(self, base: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
        """Per stream (in `base`'s order: the config's shares), the lowest and highest share
        the policy may give: the configured bounds, else half and twice the config's share
        (at most 1)."""
        pairs = [self.bounds.get(n, (w / 2, min(1.0, 2 * w))) for n, w in base.items()]
        return (np.array([a for a, _ in pairs], dtype=np.float64),
                np.array([b for _, b in pairs], dtype=np.float64))  # fmt: skip


class MixingConfig(_Frozen):
    """What happens when a stream runs dry: end the run, or renormalize the other weights;
    and the opt-in policy that moves the weights with the loss (None: off)."""

    on_exhausted: Literal["stop", "renormalize"] = "stop"
    policy: PolicyConfig | None = None


class ScheduleEntry(_Frozen):
    """Weights that take effect at global step `step` (a curriculum, or a recorded change)."""

    step: int = Field(ge=0)
    weights: dict[str, float]


class AutoscaleConfig(_Frozen):
    """`service.autoscale`: ask the cluster's autoscaler for CPUs while the ranks wait for
    data, and withdraw the request when the service is ahead (service/demand.py)."""

    max_cpus: int = Field(ge=1, le=1 << 20)  # never ask for more
    up_wait: float = Field(default=0.05, gt=0, lt=1)  # the worst rank's data-wait share
    cooldown_s: float = Field(default=60.0, ge=0, le=86_400)  # between two changes
    # How long the signals (the ranks' wait, the producer's state) are judged over, at most
    # the minute of waits the service keeps; no decision before half of it is seen. Shorter
    # reacts sooner to a burst, and judges on less.
    window_s: float = Field(default=60.0, ge=4, le=60)


class ServiceConfig(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: a free port, the one bound recorded
    # A rank not heard from for this long is reported lost and stops holding steps back;
    # None: never (a step then waits for every rank, however long).
    rank_timeout_s: float | None = Field(default=600.0, gt=0)
    # Serve mode appends skipped records here (relative: to the `serve` working directory);
    # None: count them only.
    rejects: str | None = "rejects.jsonl"
    # Custom Ray resources the batch-server actor and its lanes ask for, to place them on
    # chosen nodes (e.g. {"data": 1} with `ray start --resources '{"data": 8}'` on the data
    # nodes); the lanes are spread over the nodes that have them.
    resources: dict[str, float] = Field(default_factory=dict)
    # What the batch server (the control: hello, weights, states, the API's answers) asks
    # instead, when it should not sit with the lanes: e.g. {"head": 0.01} keeps it on a node
    # that is never lost with a data node. None: `resources`, as the lanes.
    control_resources: dict[str, float] | None = None
    # Global steps the server may make ahead of the slowest rank. None: 32, fewer when 32
    # steps would hold more than 256 MB of token ids, never fewer than 8 (batch_server.py,
    # prefetch_window). A rank takes up to this many in one call; a mixture change lands at
    # most this many steps after the ranks' position.
    prefetch: int | None = Field(default=None, ge=1, le=4096)
    # None: the service never asks the cluster for CPUs (service/demand.py says when it does).
    autoscale: AutoscaleConfig | None = None
    # With `lanes` > 1: how many times each lane's actor is started again when its process
    # dies (killed, its node lost), from its state at the oldest step it holds; it makes the
    # same steps again and the ranks wait for them. Past it, the service fails naming the lane.
    lane_restarts: int = Field(default=3, ge=0, le=1000)
    # How long an actor of the service (the batch server, a lane, a lane started again) may
    # take to be placed on a node and started before the run fails naming it, what it asks
    # (`resources`) and what the nodes lack. None: wait for ever (an autoscaler that takes
    # longer to add a node). A note says what it waits for after 10 s.
    place_timeout_s: float | None = Field(default=600.0, gt=0)


class Config(_Frozen):
    seed: int = 0
    seq_len: Annotated[int, Field(ge=8, le=1 << 20)] = 1024
    global_batch_size: Annotated[int, Field(ge=1)] = 16
    # Independent feeds that each read, mix and pack their share of every stream and make
    # their G/K rows of every global step (pipeline/lanes/). 1: one feed, as always.
    # The sequence is a function of (config, seed, lanes): changing it is a new sequence.
    lanes: Annotated[int, Field(ge=1, le=1024)] = 1
    tokenizer: TokenizerConfig = TokenizerConfig()
    packing: PackingConfig = PackingConfig()
    shuffle: ShuffleConfig = ShuffleConfig()
    read: ReadConfig = ReadConfig()
    on_error: Literal["skip", "fail"] = "skip"
    drop_last: bool = False
    streams: dict[str, StreamConfig]
    mixing: MixingConfig = MixingConfig()
    schedule: list[ScheduleEntry] = []
    service: ServiceConfig = ServiceConfig()

    @field_validator("streams")
    @classmethod
    def _some_streams(cls, v: dict[str, StreamConfig]) -> dict[str, StreamConfig]:
        if not v:
            raise ValueError("must name at least one stream")
        for name in v:
            if not name or not all(c.isalnum() or c in "-_." for c in name):
                raise ValueError(f"stream name {name!r} must be non-empty [A-Za-z0-9._-]")
        return v

    @model_validator(mode="after")
    def _lanes_divide_the_step(self) -> Config:
        if self.global_batch_size % self.lanes:
            raise ValueError(
                f"lanes: {self.lanes} must divide global_batch_size {self.global_batch_size} "
                "(each lane makes G/lanes rows of every step)"
            )
        return self

    @model_validator(mode="after")
    def _policy_fits(self) -> Config:
        policy = self.mixing.policy
        if policy is None:
            return self
        for key in ("reference", "bounds"):
            unknown = sorted(set(getattr(policy, key)) - set(self.streams))
            if unknown:
                raise ValueError(f"mixing.policy.{key} names unknown stream(s) {unknown} "
                                 f"(streams: {', '.join(self.streams)})")  # fmt: skip
        lo, hi = policy.bounds_for(self.weights)
        if lo.sum() > 1 + 1e-9 or hi.sum() < 1 - 1e-9:
            raise ValueError(
                f"mixing.policy.bounds: the lowest shares sum to {lo.sum():.4g} and the "
                f"highest to {hi.sum():.4g}; weights summing to 1 need lowest <= 1 <= highest"
            )
        return self

    @model_validator(mode="after")
    def _schedule_names_streams(self) -> Config:
        last = -1
        for i, entry in enumerate(self.schedule):
            try:
                normalize_weights(entry.weights, list(self.streams))
            except ValueError as e:
                raise ValueError(f"schedule.{i}.weights: {e}") from None
            if entry.step < last:
                raise ValueError(
                    f"schedule.{i}.step: steps must not decrease, got {entry.step} after {last}"
                )
            last = entry.step
        return self

    @property
    def weights(self) -> dict[str, float]:
        """Normalized target token shares."""
        total = sum(s.weight for s in self.streams.values())
        return {name: s.weight / total for name, s in self.streams.items()}

    def config_hash(self) -> str:
        """A stable hash of everything that shapes the batch sequence (not `service`).

        That includes the tokenizer's content, not only its name: a tokenizer.json changed
        under the same path gives other ids, so a state written with the old one is refused
        at a resume (`tokenizer_digest`: the file's sha256, or a directory's tokenizer
        files'). The default tokenizer is pinned (its ranks' sha256 and its conversion), so
        its configs keep their hashes."""
        data = self.model_dump(
            mode="json", exclude={"service": True, "tokenizer": {"backend", "verify_fraction"}}
        )
        content = tokenizer_digest(self.tokenizer.name)
        if content is not None:
            data["tokenizer"]["content_sha256"] = content
        if data["tokenizer"]["add_bos"] is None:  # hashed as the False it was before None
            data["tokenizer"]["add_bos"] = False
        if not self.shuffle.interleaved:  # the window-only shuffle: its configs' hashes
            del data["shuffle"]["pieces"], data["shuffle"]["piece_bytes"]
        for how in ("in_lanes", "ahead", "ramp_parts"):  # who tokenizes and when, not what
            del data["read"][how]
        if data["mixing"]["policy"] is None:
            del data["mixing"]["policy"]  # off: the hashes of configs from before it
        else:
            del data["mixing"]["policy"]["wait_s"]  # how long to wait, not what is made
        if data["lanes"] == 1:
            del data["lanes"]  # one lane is the sequence of configs that had no lanes
        if data["read"]["max_record_bytes"] == MAX_RECORD_BYTES:
            del data["read"]["max_record_bytes"]  # the default keeps older configs' hashes
        for stream in data["streams"].values():
            # How the files are reached (credentials, endpoints) is not what they hold.
            del stream["storage_options"]
            for key in ("tokens_field", "tokens_dtype"):  # unset: older configs' hashes
                if stream[key] is None:
                    del stream[key]
        blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
