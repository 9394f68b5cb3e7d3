"""Tokenizers: loading once per worker process, and batched encoding into flat numpy arrays.

Where the tokenizer.json comes from (the offline cl100k default, a file, the Hub cache) is
`pipeline.tokenize.files`; the proofs behind the fast backend are `pipeline.tokenize.proofs`;
its encoders, how one is chosen for a tokenizer.json and the sample that checks each call are
`pipeline.tokenize.encoders`. Here: `LoadedTokenizer` (encode, verify, fall back, chat glue)
and the loader (`load_tokenizer`, once per process).

The HF tokenizer is the reference: its ids are the ids. An optional *fast backend* encodes
instead where it is exact. It is rank-order BPE over the tokenizer's own ranks behind its own
split regex, run by one of two engines: `fastokens` (Rust BPE, PCRE2's JIT for the split: ~5x
tiktoken on one core here, ~18x HF) where its wheel is installed, else tiktoken (~3.5x HF).
Exactness is proven where it can be: at load, `prove_fast` checks over the whole vocabulary and
merge list that rank-order BPE over these ranks and the HF BPE model give the same ids on every
pre-token (the verdict is cached on disk by the tokenizer.json's sha256); both engines
implement rank-order BPE. The split into pre-tokens runs the same regex on different engines
(Oniguruma; fancy-regex or PCRE2). Its character classes are proven at load over every code
point (`proofs.split_exceptions`): a text holding a code point where the engines' classes
differ (U+180E for cl100k on PCRE2) is encoded by HF (`SplitGuard`, `hf_split`). Its
structure is sampled: a fixed probe set at load, then a byte-proportional sample of every
encode call is also encoded by the HF tokenizer and compared; any mismatch sends that whole
call to the HF tokenizer (or is an error under ``tokenizer.backend: tiktoken`` or
``fastokens``). Every decision is a function of the call's texts only, so output stays
deterministic whichever process encodes it.

Threads: a `LoadedTokenizer` is immutable once loaded and shared by every thread of a process
(see its docstring); `_CACHE` is filled under `_LOADING`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.config import TokenizerConfig, tokenizer_digest
from pipeline.tokenize.files import (
    CL100K_SPECIALS,
    DEFAULT_CHAT_TEMPLATE,
    TokenizerFile,
    cache_dir,
    default_tokenizer_file,
    open_tokenizer,
)
from pipeline.tokenize.proofs import (
    FastGuarantees,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

from pipeline.tokenize.encoders import (
    BACKEND_HF,
    BACKEND_HF_FALLBACK,
    BACKEND_HF_SPLIT,
    FastBackendError,
    FastEncoder,
    SplitGuard,
    fast_backend,
    flatten,
    hf_ids,
    preload_fastokens,
    verify_sample,
)

# Guards the one-time build of every LoadedTokenizer's glue tokenizer (`with_specials`).
_GLUE_LOCK = threading.Lock()
_GLUE_IDS_LOCK = threading.Lock()
GLUE_KEEP = 4096  # glue texts kept per tokenizer (LoadedTokenizer.encode_glue)


@dataclass(frozen=True)
class LoadedTokenizer:
    """A `tokenizers.Tokenizer` plus the special ids the pipeline needs.

    `guarantees`: what was proven about the fast backend at load (`FastGuarantees`), or None
    where none was considered (backend hf, or no byte-level BPE form).

    Shared by every thread of a process (the feed, the head start's threads, one per stream,
    a pool actor's calls): it is immutable once `load_tokenizer` returns it. `tokenizer`
    encodes special-token text as text (`encode_special_tokens` set at load and never again);
    chat template glue, which needs special tokens recognised, goes to a second HF tokenizer
    (`with_specials`), built once under `_GLUE_LOCK` and never mutated either. Toggling the
    flag on the one shared tokenizer "just for this call" raised "Already borrowed" in the
    other thread's encode, or let it encode user text with special tokens recognised.
    The fast engines (tiktoken, fastokens) encode through `&self`: concurrent calls are safe.
    """

    tokenizer: Tokenizer
    bos_id: int | None
    eos_id: int | None
    pad_id: int
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    name: str
    fast: FastEncoder | None = None
    backend: str = "hf"
    verify_fraction: float = 0.01
    guarantees: FastGuarantees | None = None
    split_guard: SplitGuard | None = None
    # The tokenizer.json `tokenizer` was read from unchanged (but for the flag), with its
    # (size, mtime_ns) then: the glue copy is read from it again (`with_specials`).
    source: tuple[Path, tuple[int, int]] | None = None
    # Ids in the vocabulary, added tokens included: asked once at load (`Tokenizer.
    # get_vocab_size` builds the whole vocabulary on each call, ~40 ms for 100k ids: too slow
    # to ask per unit read).
    vocab_size: int = 0
    # Glue ids by text (`encode_glue`), this process's: filled from the glue file and by
    # encoding what it lacks; written under _GLUE_IDS_LOCK only.
    _glue_ids: dict = field(default_factory=dict, repr=False, compare=False)
    _glue_key: list = field(default_factory=list, repr=False, compare=False)
    # The glue tokenizer, once built (see the class docstring); written under _GLUE_LOCK only.
    _glue: list = field(default_factory=list, repr=False, compare=False)

    def with_specials(self) -> Tokenizer:
        """A copy of `tokenizer` that recognises special-token text (for chat template glue).

        Built on first use (only chat streams need it: ~0.5 s and ~50 MB for cl100k), under a
        lock so that threads asking at once build it once; never mutated after."""
        if not self._glue:
            with _GLUE_LOCK:
                if not self._glue:
                    from tokenizers import Tokenizer

                    glue = self._reread() or Tokenizer.from_str(self.tokenizer.to_str())
                    glue.encode_special_tokens = False  # before anyone else can see it
                    self._glue.append(glue)
        return self._glue[0]

    def _reread(self) -> Tokenizer | None:
        """The tokenizer read again from its file if that is unchanged since the load: the
        same tokenizer as a copy through `to_str`, which holds the GIL (the feed's start
        stalled on it); `from_file` lets go of it while it parses (`read_text` + `from_str`
        and `from_buffer` do not)."""
        path = self._unchanged_source()
        if path is None:
            return None  # rewritten since: copy the loaded one instead
        from tokenizers import Tokenizer

        glue = Tokenizer.from_file(str(path))
        return glue if self._unchanged_source() is not None else None

    def _unchanged_source(self) -> Path | None:
        """The tokenizer.json `tokenizer` was read from, if its (size, mtime) are as at the
        load; else None (none, gone, or rewritten since)."""
        if self.source is None:
            return None
        path, seen = self.source
        try:
            st = path.stat()
        except OSError:
            return None
        return path if (st.st_size, st.st_mtime_ns) == seen else None

    def glue_in_background(self) -> None:
        """Start building the glue copy (`with_specials`) on a thread, for a feed with a chat
        stream: its first unit then finds it made, instead of the first step waiting for it
        (the parse lets go of the GIL, so it runs beside the feed's start). Not where a glue
        file holds this tokenizer's glue already (`encode_glue`): likely no copy is needed."""
        path = self._glue_file()
        if not self._glue and not (path is not None and path.exists()):
            threading.Thread(target=self.with_specials, name="tokenmill-glue", daemon=True).start()

    def encode_glue(self, texts: list[str]) -> list[list[int]]:
        """Chat template glue as ids, special tokens recognised (the glue copy's encoding).

        A template's glue is a handful of distinct strings ("<|im_start|>user\n", ...): each
        is encoded once and kept, in this process and in a file under the cache directory
        named by the tokenizer file's sha256 and the tokenizers version, so that the next
        process (a worker, a service's actor) reads them instead of building the glue copy
        (~0.45 CPU-s and ~50 MB for cl100k). A text it lacks is encoded by the copy, as
        before. The ids are the copy's own: the file only remembers them. Past GLUE_KEEP
        texts (a template whose glue varies with the records) nothing more is kept."""
        ids = self._glue_ids
        with _GLUE_IDS_LOCK:
            if not ids:
                ids.update(self._read_glue_file())
            missing = list(dict.fromkeys(t for t in texts if t not in ids))
        if not missing:
            return [ids[t] for t in texts]
        glue = self.with_specials()
        fast = getattr(glue, "encode_batch_fast", glue.encode_batch)
        made = {
            t: e.ids for t, e in zip(missing, fast(missing, add_special_tokens=False), strict=True)
        }
        with _GLUE_IDS_LOCK:
            if len(ids) + len(made) <= GLUE_KEEP:
                ids.update(made)
                self._write_glue_file(ids)
        return [made[t] if t in made else ids[t] for t in texts]

    def _glue_file(self) -> Path | None:
        """Where this tokenizer's glue ids persist; None unless it was read from a file that
        is unchanged since (its sha256 names the file, with the tokenizers version)."""
        if not self._glue_key:
            path = self._unchanged_source()
            if path is None:
                return None
            import tokenizers

            from pipeline.config import file_digest  # cached: the config hash computed it

            try:
                digest = file_digest(path)[:32]
            except OSError:
                return None
            self._glue_key.append(f"{digest}-tokenizers{tokenizers.__version__}")

        return cache_dir() / "glue" / f"{self._glue_key[0]}.json"

    def _read_glue_file(self) -> dict[str, list[int]]:
        path = self._glue_file()
        try:
            found = json.loads(path.read_text(encoding="utf-8")) if path is not None else {}
        except (OSError, ValueError):
            return {}  # none yet, or unreadable: encoded afresh (and written again)
        ok = isinstance(found, dict) and all(
            isinstance(v, list) and all(isinstance(i, int) for i in v) for v in found.values()
        )
        return found if ok else {}

    def _write_glue_file(self, ids: dict[str, list[int]]) -> None:
        path = self._glue_file()
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(ids), encoding="utf-8")
            os.replace(tmp, path)  # whole or not at all, whoever writes at the same time
        except OSError:
            pass  # a read-only cache: kept in this process only

    def describe(self) -> str:
        """One line on what was loaded, for `tokenmill check`."""

        def token(i: int | None) -> str:
            return "none" if i is None else f"{i} {self.tokenizer.id_to_token(i)!r}"

        if self.fast is not None:
            classes = self.guarantees.split_classes if self.guarantees else "not checked"
            backend = (
                f"{self.fast.name} where exact (BPE proven, split classes {classes}, "
                "split structure sampled)"
            )
        elif self.guarantees is not None:
            why = self.guarantees.failed or self.guarantees.pretokenizer
            backend = f"hf (no fast engine is exact: {why})"
        else:
            backend = "hf"
        return (
            f"tokenizer {self.name}: {self.vocab_size} ids,"
            f" bos {token(self.bos_id)} (add_bos {str(self.add_bos).lower()}), eos "
            f"{token(self.eos_id)} (add_eos {str(self.add_eos).lower()}), pad {self.pad_id}, "
            f"{'a' if self.chat_template else 'no'} chat template, backend {backend}"
        )

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Encode a batch with the HF tokenizer: (flat int32 ids, int64 offsets)."""
        return flatten(hf_ids(self.tokenizer, texts))

    def encode_verified(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        """Encode a batch with the fastest exact backend: (flat, offsets, backend code).

        The fast backend's ids are kept only if a sample of this batch (`verify_sample`: whole
        texts, or a window of a long one) encodes identically with the HF tokenizer; otherwise
        HF re-encodes the batch.

        The fast backend exists only where `prove_fast` proved its BPE exact, and a batch
        with a text holding a code point where the engines' character classes differ goes to
        HF whole (`SplitGuard`, `hf_split`), so a difference here could only come from the
        regex's structure (or a Unicode normalizer): that is all the sample checks. Its budget
        stays `verify_fraction` (default 1% of the characters): regex disagreements are rare
        and input-shaped (cl100k's digit-run trap touched 0.03% of tokens, only on some files),
        so a batch must be sampled at all to be caught. Its cost is not small: HF is ~20-30x
        slower per token than fastokens, so 1% of the characters costs ~20-35% of the fast
        path's time (documents of 10k characters: 11.4M tokens/s verified, 17.9M fastokens
        alone, this VM). Exactness first: a smaller `verify_fraction` buys that time back.
        """
        if self.fast is None or not texts:
            return *self.encode(texts), BACKEND_HF
        if self.split_guard is not None and self.split_guard.hits(texts):
            return *self.encode(texts), BACKEND_HF_SPLIT
        flat, offsets = self.fast.encode_flat(texts)
        picked = verify_sample(texts, self.verify_fraction)
        pieces = [texts[i][a:b] for i, a, b in picked]
        reference = hf_ids(self.tokenizer, pieces)
        for (i, a, b), piece, want in zip(picked, pieces, reference, strict=True):
            whole = a == 0 and b == len(texts[i])
            got = flat[offsets[i] : offsets[i + 1]] if whole else self.fast.encode_flat([piece])[0]
            if got.tolist() != want:
                if self.backend != "auto":
                    raise FastBackendError(
                        f"tokenizer.backend {self.backend}: differs from {self.name!r} on a "
                        f"text starting {piece[:60]!r}; use backend auto or hf"
                    )
                return *self.encode(texts), BACKEND_HF_FALLBACK
        return flat, offsets, self.fast.code

    def encode_records(
        self, texts: list[str]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
        """`encode_verified` per record: (flat, offsets, int8 backend per text, {index:
        reason}), where a text the tokenizer fails on is one failed record, without ids.

        A text holding a code point the split guard names goes to HF alone (`hf_split`), the
        others to `encode_verified` as one call: one such text does not send its whole batch
        to HF. Both parts are functions of the texts alone, so the output is too.
        """
        guard = self.split_guard if self.fast is not None else None
        to_hf = [i for i, t in enumerate(texts) if guard is not None and guard.hits([t])]
        if not to_hf:
            return self._encode_isolating(texts, self.encode_verified)
        ids: list = [None] * len(texts)
        backends = np.zeros(len(texts), dtype=np.int8)
        failed: dict[int, str] = {}
        guarded = set(to_hf)
        rest = [i for i in range(len(texts)) if i not in guarded]
        for part, encode in ((to_hf, self._encode_split_guarded), (rest, self.encode_verified)):
            if not part:
                continue
            flat, offsets, codes, bad = self._encode_isolating([texts[i] for i in part], encode)
            for k, i in enumerate(part):
                ids[i] = flat[offsets[k] : offsets[k + 1]]
                backends[i] = codes[k]
                if k in bad:
                    failed[i] = bad[k]
        return *flatten(ids), backends, failed

    def _encode_split_guarded(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        return *self.encode(texts), BACKEND_HF_SPLIT

    def _encode_isolating(
        self, texts: list[str], encode: Callable[[list[str]], tuple[np.ndarray, np.ndarray, int]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
        """`encode(texts)`, where a text the tokenizer fails on is one failed record.

        The batch is encoded as one call first. If that fails (`tokenizer_failure`), each
        text is encoded alone, by the fast engine where `encode` uses one, to find the
        culprits; the others are encoded as one call again (the same texts give the same
        call, so the output is still a function of the texts alone). A culprit of the fast
        engine gets the HF tokenizer's exact ids if HF can encode it (`hf_fallback`), else it
        fails. If every text of a batch of several fails alone, the failure is not the
        records': it is raised.
        """
        try:
            flat, offsets, backend = encode(texts)
            return flat, offsets, np.full(len(texts), backend, dtype=np.int8), {}
        except BaseException as e:
            if not tokenizer_failure(e):
                raise
            first = e
        fast = self.fast if encode == self.encode_verified else None
        alone = fast.encode_flat if fast is not None else self.encode
        culprits: dict[int, BaseException] = {}
        for i, text in enumerate(texts):
            try:
                alone([text])
            except BaseException as e:
                if not tokenizer_failure(e):
                    raise
                culprits[i] = e
        if len(texts) > 1 and len(culprits) == len(texts):
            raise first
        ids: dict[int, np.ndarray] = {}
        backends = np.zeros(len(texts), dtype=np.int8)
        failed: dict[int, str] = {}
        for i, error in culprits.items():
            reason = f"the tokenizer failed on this record: {failure_reason(error)}"
            if fast is not None:
                try:
                    ids[i] = self.encode([texts[i]])[0]
                    backends[i] = BACKEND_HF_FALLBACK
                    continue
                except BaseException as hf_error:
                    if not tokenizer_failure(hf_error):
                        raise
                    reason += f"; HF's too: {failure_reason(hf_error)}"
            failed[i] = reason
            ids[i] = np.zeros(0, dtype=np.int32)
        rest = [i for i in range(len(texts)) if i not in culprits]
        if rest:
            flat, offsets, backend = encode([texts[i] for i in rest])
            for k, i in enumerate(rest):
                ids[i] = flat[offsets[k] : offsets[k + 1]]
                backends[i] = backend
        flat, offsets = flatten([ids[i] for i in range(len(texts))])
        return flat, offsets, backends, failed


def tokenizer_failure(e: BaseException) -> bool:
    """Whether `e` is a tokenizer failing on its input, to be charged to the record.

    Any Exception (fastokens: "ValueError: ... PCRE2: match limit exceeded" on 10 MB of
    spaces), and a Rust panic: PyO3 raises `pyo3_runtime.PanicException`, a BaseException
    (HF's Oniguruma: "retry-limit-in-match over"). Matched by type name, as PyO3 exposes the
    class nowhere importable; KeyboardInterrupt, SystemExit and the like stay what they are.
    """
    if isinstance(e, Exception):
        return True
    kind = type(e)
    return kind.__name__ == "PanicException" and kind.__module__ == "pyo3_runtime"


def failure_reason(e: BaseException) -> str:
    """A record's reject reason for tokenizer failure `e`: its type and first line, short."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:300]}"


# Loaded tokenizers by config and content (`tokenizer_digest`). Written under _LOADING only;
# read without it (a dict lookup is atomic, and entries are immutable and never removed).
_CACHE: dict[tuple[TokenizerConfig, str | None], LoadedTokenizer] = {}
_LOADING = threading.Lock()


def load_tokenizer(cfg: TokenizerConfig) -> LoadedTokenizer:
    """Load a tokenizer once per process (module-level cache; workers import this module).

    Once, also when several threads ask at the same moment (the feed and its head start
    did, and paid the ~0.7 s load twice on the same two cores). Keyed by the tokenizer's
    content as well as its config: a warm pool actor outlives exports, and a tokenizer.json
    rewritten under the same path between two of them is loaded afresh (it kept encoding
    with the old one: 756 of 4,123 tokens differed)."""
    key = (cfg, tokenizer_digest(cfg.name))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    with _LOADING:
        hit = _CACHE.get(key)
        if hit is None:
            hit = _CACHE[key] = _load_tokenizer(cfg)
        return hit


def load_in_background(cfg: TokenizerConfig) -> Future:
    """`load_tokenizer(cfg)` on a thread of its own (~0.6 s, its parse lets go of the GIL),
    while the caller goes on: the Future holds the tokenizer, or the error for whoever needs
    it to raise (the cache above makes a later `load_tokenizer` of it wait for this one)."""
    done: Future = Future()

    def load() -> None:
        try:
            done.set_result(load_tokenizer(cfg))
        except BaseException as e:
            done.set_exception(e)

    threading.Thread(target=load, name="tokenmill-tokenizer", daemon=True).start()
    return done


def _first_or(default: int, *ids: int | None) -> int:
    return next((i for i in ids if i is not None), default)


def _load_tokenizer(cfg: TokenizerConfig) -> LoadedTokenizer:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    preloaded = preload_fastokens(cfg)
    if cfg.name == "default":
        source: Path | None = default_tokenizer_file()
        eot = CL100K_SPECIALS["<|endoftext|>"]
        found = TokenizerFile(
            Tokenizer.from_file(str(source)), source, None, eot, eot, False, DEFAULT_CHAT_TEMPLATE
        )
    else:
        found = open_tokenizer(cfg.name)
    tok, source = found.tokenizer, found.source
    template = cfg.chat_template or found.chat_template
    # Text is text: a literal "<|endoftext|>" inside a document must not become EOS. Special
    # tokens enter only where the config says (add_bos/add_eos) or a chat template puts them.
    tok.encode_special_tokens = True
    bos = cfg.bos_id if cfg.bos_id is not None else found.bos_id
    eos = cfg.eos_id if cfg.eos_id is not None else found.eos_id
    pad = cfg.pad_id if cfg.pad_id is not None else _first_or(0, found.pad_id, eos)
    add_bos = cfg.add_bos if cfg.add_bos is not None else found.add_bos
    vocab = tok.get_vocab_size(with_added_tokens=True)
    for key, value in (("bos_id", cfg.bos_id), ("eos_id", cfg.eos_id), ("pad_id", cfg.pad_id)):
        if value is not None and value >= vocab:
            raise ValueError(
                f"tokenizer.{key}: {value} is not an id of {cfg.name!r} (its vocabulary has "
                f"{vocab} ids, 0..{vocab - 1})"
            )
    if add_bos and bos is None:
        raise ValueError(f"tokenizer.add_bos: {cfg.name!r} has no BOS token; set tokenizer.bos_id")
    if cfg.add_eos and eos is None:
        why = (
            f"its special tokens {list(found.eos_candidates)} could each be it"
            if found.eos_candidates
            else "it declares none"
        )
        raise ValueError(
            f"tokenizer.add_eos: cannot tell the EOS token of {cfg.name!r} ({why}); "
            "set tokenizer.eos_id"
        )
    fast = guarantees = guard = None
    if cfg.backend != "hf":
        fast, guarantees, guard = fast_backend(tok, cfg, source, preloaded)
    loaded = LoadedTokenizer(
        tok,
        bos,
        eos,
        pad,
        add_bos,
        cfg.add_eos,
        template,
        cfg.name,
        fast=fast,
        backend=cfg.backend,
        verify_fraction=cfg.verify_fraction,
        guarantees=guarantees,
        split_guard=guard,
        source=_stamp(source),
        vocab_size=vocab,
    )
    return loaded


def _stamp(source: Path | None) -> tuple[Path, tuple[int, int]] | None:
    """`source` with its (size, mtime_ns) now (LoadedTokenizer.source), None if unreadable."""
    if source is None:
        return None
    try:
        st = source.stat()
    except OSError:
        return None
    return source, (st.st_size, st.st_mtime_ns)
