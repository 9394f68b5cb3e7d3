"""Load-time proofs: what makes the fast backend exact, checked over the whole vocabulary.

`prove_fast` shows, for one tokenizer.json and the ranks of the tiktoken encoder built from
it, that tiktoken's BPE gives the HF BPE model's ids on every pre-token; `FastGuarantees` is
its verdict, part by part, and `prove_cached` caches verdicts on disk by the file's sha256.
The split into pre-tokens runs on two regex engines: `split_exceptions` finds, over every code
point, where their character classes differ (such texts go to HF); the split's structure is
sampled by `pipeline.tokenize.engines`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.tokenize.files import cache_dir


def bytes_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def byte_level_vocab(vocab: dict[str, int]) -> dict[bytes, int]:
    """A byte-level vocabulary as the bytes its tokens stand for -> id.

    Tokens with a character outside GPT-2's byte alphabet are left out: no input byte maps to
    such a character, so the HF model can never produce them, and tiktoken cannot hold them.
    (str.translate + latin-1 decodes 100k tokens in ~0.08 s, 3x a per-character loop.)
    """
    table = {ord(ch): b for ch, b in bytes_decoder().items()}
    alphabet = set(table)
    return {
        token.translate(table).encode("latin-1"): idx
        for token, idx in vocab.items()
        if alphabet.issuperset(map(ord, token))
    }


# Bump when a proof changes: verdicts cached by older code are then not read.
PROOF_VERSION = 1
# What the fast backend needs proven, in the order failures are reported. vocab_roundtrip is
# not among them: it is a lemma that proves two of them, which can also hold without it.
REQUIRED = ("same_vocab", "merges_ordered", "whole_piece_lookup", "added_tokens")


@dataclass(frozen=True)
class FastGuarantees:
    """What was proven at load about the fast backend, one field per part of the encoder.

    True where proven over the whole vocabulary (`prove_fast` has the argument):
      same_vocab: one plain byte-level BPE vocabulary on both sides (tiktoken rank == HF id).
      merges_ordered: HF's merge order is tiktoken's rank order wherever it matters.
      whole_piece_lookup: a pre-token that is a token becomes that token on both sides.
      vocab_roundtrip: HF's merges alone (no lookup) encode every token to itself; a lemma,
        not required: it proves the other two where `ignore_merges` or the merge list cannot.
      added_tokens: no added token is matched inside text (all are special, and this module
        encodes special-token text as text).
    Not provable, so checked on a sample of every batch (`LoadedTokenizer.encode_verified`):
      pretokenizer: the regex split (Oniguruma vs fancy-regex): "sampled", or "failed probe"
        where the load-time probe already differed.
      normalizer: "none", or "sampled" (HF's Unicode normalization vs Python's).
    Proven at load about the split, per code point (`split_exceptions`):
      split_classes: where the two regex engines' character classes agree; a text holding a
        code point where they do not is encoded by HF (`hf_split` in the summary).
    `failed`: why each field is not proven (after a failed same_vocab, the proofs about that
    vocabulary are not run), or None.
    """

    same_vocab: bool
    merges_ordered: bool
    whole_piece_lookup: bool
    vocab_roundtrip: bool
    added_tokens: bool
    pretokenizer: str = "sampled"
    normalizer: str = "none"
    failed: str | None = None
    # The split's character classes, checked on every code point at load (`split_exceptions`):
    # "proven", "proven; to hf: U+180E" (texts holding those go to HF), or "not checked".
    split_classes: str = "not checked"

    @property
    def proven(self) -> bool:
        """Everything the fast backend needs is proven, the sampled parts aside."""
        return all(getattr(self, name) for name in REQUIRED)

    def as_dict(self) -> dict[str, bool | str | None]:
        return asdict(self)


def _merge_pairs(model: dict) -> list[tuple[str, str]]:
    """`merges` in either tokenizer.json format: [["a", "b"], ...] or ["a b", ...]."""
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]


def _check_plain_bpe(model: dict, ranks: dict[bytes, int]) -> str | None:
    """None if the HF model is plain byte-level BPE over exactly tiktoken's ranks."""
    if model.get("type") != "BPE":
        return f"the model is {model.get('type')}, not BPE"
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"the BPE model has {key} {model[key]!r}"
    if model.get("byte_fallback"):
        return "the BPE model has byte_fallback"
    if model.get("dropout"):
        return f"the BPE model has dropout {model['dropout']} (random merges)"
    vocab = byte_level_vocab(model["vocab"])
    if vocab != ranks:
        diff = sorted(
            (vocab.keys() ^ ranks.keys()) | {t for t in vocab if ranks.get(t) != vocab[t]}
        )
        t = diff[0]
        return (
            f"{len(diff)} tokens differ, e.g. {t!r}: id {vocab.get(t)} in tokenizer.json, "
            f"rank {ranks.get(t)} in the fast encoder"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    return f"byte {missing[0]:#04x} is not a token" if missing else None


def _check_merge_order(model: dict, pairs: list[tuple[str, str]]) -> str | None:
    """None if the id of a merge's result never decreases along `merges`.

    One dictionary lookup per merge, then one numpy pass: 0.09 s for cl100k's 233k merges.
    """
    vocab = model["vocab"]
    result = np.fromiter((vocab[a + b] for a, b in pairs), dtype=np.int64, count=len(pairs))
    down = np.flatnonzero(np.diff(result) < 0)
    if len(down) == 0:
        return None
    i = int(down[0])
    return (
        f"{len(down)} merges come before a merge of a lower-ranked token, e.g. merge #{i} "
        f"{pairs[i]} -> id {result[i]} before merge #{i + 1} {pairs[i + 1]} -> id {result[i + 1]}"
    )


def _check_merges(model: dict, pairs: list[tuple[str, str]], roundtrip: str | None) -> str | None:
    """None if merge order is rank order and every token's own merge is listed (see
    `prove_fast`): the latter follows from vocab_roundtrip or, without it, from every split
    of every token being listed. `roundtrip`: why vocab_roundtrip failed, or None."""
    order = _check_merge_order(model, pairs)
    if order is not None or roundtrip is None:
        return order
    unlisted = _check_all_splits_listed(model, pairs)
    return f"vocab_roundtrip failed and {unlisted}" if unlisted else None


def _check_roundtrip(model: dict, pairs: list[tuple[str, str]]) -> str | None:
    """None if the HF BPE, without its whole-token lookup, encodes every token to itself.

    A second copy of the model, `ignore_merges` off, encodes all byte-level tokens as the words
    of one text (no byte-level character is whitespace): on cl100k 0.25 s to build and 0.4 s
    to encode, twice as fast as a batch of 100k one-token texts.
    """
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import BPE

    vocab = model["vocab"]
    bare = Tokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=False, cache_capacity=0))
    bare.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    alphabet = set(bytes_decoder())
    tokens = [t for t in vocab if t and alphabet.issuperset(t)]
    out = bare.encode(" ".join(tokens), add_special_tokens=False)
    ids, words = np.asarray(out.ids), np.asarray(out.word_ids)
    want = np.fromiter((vocab[t] for t in tokens), dtype=np.int64, count=len(tokens))
    per_word = np.bincount(words, minlength=len(tokens))
    first = ids[np.minimum(np.searchsorted(words, np.arange(len(tokens))), len(ids) - 1)]
    wrong = np.flatnonzero((per_word != 1) | (first != want))
    if len(wrong) == 0:
        return None
    t = tokens[int(wrong[0])]
    got = ids[words == wrong[0]].tolist()
    return f"{len(wrong)} tokens are not reachable by merges, e.g. {t!r} -> ids {got}"


def _check_all_splits_listed(model: dict, pairs: list[tuple[str, str]]) -> str | None:
    """None if `merges` lists every split (a, b) of every token with a and b tokens too.

    True of files from transformers' TikTokenConverter (cl100k: 233k merges); the fallback
    ground for merges_ordered when vocab_roundtrip fails (0.5 s in Python, so not run first).
    """
    vocab = model["vocab"]
    listed = set(pairs)
    for token in vocab:
        for k in range(1, len(token)):
            a, b = token[:k], token[k:]
            if a in vocab and b in vocab and (a, b) not in listed:
                return f"the split {(a, b)} of token {token!r} is not a merge"
    return None


def _check_added_tokens(doc: dict) -> str | None:
    """None if every added token is special: encoded as text, never matched inside it."""
    plain = [t["content"] for t in doc.get("added_tokens") or [] if not t.get("special")]
    return f"{len(plain)} non-special added tokens, e.g. {plain[0]!r}" if plain else None


def prove_fast(doc: dict, ranks: dict[bytes, int]) -> FastGuarantees:
    """Prove, over the whole vocabulary, that tiktoken's BPE gives the HF model's ids.

    `doc`: the parsed tokenizer.json; `ranks`: the fast encoder's byte string -> rank table.

    The algorithms. Both start a pre-token as its bytes and repeatedly merge one adjacent pair,
    the leftmost of best priority, until no pair qualifies:
      tiktoken: any pair (x, y) with x+y a token; priority rank(x+y).
      HF BPE:   only pairs listed in `merges`; priority the merge's index.
    First, each looks the whole pre-token up: tiktoken always, HF if `ignore_merges`.

    The condition, each part checked over all tokens and merges:
      V same_vocab: rank(t) == HF id(t) for every token; all 256 bytes are tokens; plain BPE
        (no dropout, subword prefix or suffix, byte fallback).
      R vocab_roundtrip: HF's merges alone turn the bytes of every token into that token.
      M merges_ordered: rank(x+y) never decreases along `merges` (0.1 s for cl100k's 233k
        merges), and each token's own split (below) is listed: by R, or failing R, because
        `merges` lists every split of every token (true of converted tiktoken files).
      W whole_piece_lookup: `ignore_merges` is on, or R holds (then the lookup is moot).
    V, M and W make tiktoken and HF agree on every pre-token:
    1. Parts only grow, so the merges inside the bytes of a part happen in the order they
       would for those bytes alone (a pair's rank depends on nothing outside it). Hence when
       tiktoken has x, y adjacent with x+y a token, (x, y) is how tiktoken's BPE of x+y's
       bytes alone ends, its *own split*; no other split of x+y is ever adjacent. Ties in rank
       are copies of one pair, broken leftmost by both; the order of a token's other splits
       in `merges` (cl100k's file lists 233k splits of 100k tokens) never matters.
    2. By induction on length, in any state both reached, tiktoken merges the leftmost pair
       (x, y) of least rank. If x+y is shorter than the pre-token, HF on x+y alone ends with
       the same merge (induction), so (x, y) is listed; if x+y is all of it, R or the full
       split list says it is. Every other listed pair yields a higher rank, hence (M) has a
       later index, or is a copy of (x, y) further right. So HF merges the same pair; with
       nothing left to merge for tiktoken, nothing listed is left either: both stop together.
    So a pair (a, b) with a+b a token but no merge listed is harmless exactly when it is not
    a+b's own split: dropping a merge that never fires keeps every guarantee, dropping one
    that fires breaks R and M, and reordering merges breaks M. A differential fuzz (5,000
    random vocabularies and merge lists over three letters, every string up to 7 bytes) found
    no mismatch in the 1,670 meeting V, M and W, and mismatches in 96% of the others;
    tests/test_tokenization.py keeps a smaller one running against the real libraries.
    (Sources: tiktoken 0.14 src/lib.rs `_byte_pair_merge`, `_byte_pair_merge_large`,
    `encode_ordinary`; tokenizers 0.22 models/bpe/word.rs `merge_all`, model.rs
    `tokenize_with_cache`.)
    """
    model = doc.get("model") or {}
    why: dict[str, str | None] = {"same_vocab": _check_plain_bpe(model, ranks)}
    if why["same_vocab"] is None:
        pairs = _merge_pairs(model)
        roundtrip = _check_roundtrip(model, pairs)
        why["merges_ordered"] = _check_merges(model, pairs, roundtrip)
        if model.get("ignore_merges") or roundtrip is None:
            why["whole_piece_lookup"] = None
        else:
            why["whole_piece_lookup"] = "ignore_merges is off and " + roundtrip
        why["vocab_roundtrip"] = roundtrip
    else:  # the other proofs are about this one vocabulary
        why |= dict.fromkeys(("merges_ordered", "whole_piece_lookup", "vocab_roundtrip"), "")
    why["added_tokens"] = _check_added_tokens(doc)
    proven: dict[str, Any] = {k: v is None for k, v in why.items()}
    return FastGuarantees(
        **proven,
        normalizer="none" if doc.get("normalizer") is None else "sampled",
        failed="; ".join(f"{k}: {v}" for k, v in why.items() if v) or None,
    )


def prove_cached(
    content: bytes, ranks_source: str, prove: Callable[[], FastGuarantees]
) -> FastGuarantees:
    """`prove()`, cached on disk by the sha256 of the tokenizer.json content.

    Cold, proving cl100k adds ~1.3 s to a load on a shared 2-core machine (JSON parse 0.3 s,
    vocab_roundtrip 0.7 s, the rest 0.3 s); a cached verdict costs reading and hashing the
    14 MB file (~0.02 s). `ranks_source` names what the fast encoder's ranks come from besides
    the file (the pinned cl100k ranks file, for the default tokenizer).
    """
    digest = hashlib.sha256(content).hexdigest()
    path = cache_dir() / "fast_proofs" / f"{digest}-{ranks_source}-v{PROOF_VERSION}.json"
    try:
        return FastGuarantees(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass  # absent or unreadable: prove again
    guarantees = prove()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(guarantees.as_dict(), f)
    os.replace(tmp, path)  # atomic: workers may race to prove the same file
    return guarantees


# --- The split: where the regex engines' character classes differ, over every code point ---

# Bump when the split proof changes: results cached by older code are then not read.
SPLIT_PROOF_VERSION = 1
# A pattern's parts: a bracket class, a property or class escape, any other escape, one char.
_PARTS = re.compile(
    r"\[\^?\]?(?:\\[pP]\{[^}]*\}|\\.|[^\]\\])*\]|\\[pP]\{[^}]*\}|\\[pP][A-Za-z]|\\.|.", re.S
)
_CLASS_ESCAPE = re.compile(r"\\[pPsSdDwWhHvV]")
_CASELESS = re.compile(r"\(\?i:((?:\\.|[^)])*)\)")
# Every code point but the surrogates (no UTF-8 text holds one), U+0000 aside (see below).
_CODE_POINTS = np.concatenate([np.arange(1, 0xD800), np.arange(0xE000, 0x110000)])


def class_atoms(*patterns: str) -> list[str] | None:
    """The character-class atoms of `patterns`, each a regex matching one character: the
    bracket classes and escapes that name a Unicode class (`[^\\s\\p{L}\\p{N}]`, `\\p{L}`,
    `\\s`, `\\S`, ...), `.`, and one `(?i:[...])` of the letters of each case-insensitive
    group. Literal characters and classes of literals are left out: every engine reads them
    alike. None where a pattern has a flag this cannot follow (an inline `(?i)`, `(?x)`...).
    """
    atoms: set[str] = set()
    for pattern in patterns:
        if re.search(r"\(\?[a-zA-Z]*\)", pattern):
            return None
        for group in _CASELESS.findall(pattern):
            letters = sorted({c for c in re.sub(r"\\.", "", group) if c.isalpha()})
            if letters:
                atoms.add(f"(?i:[{''.join(letters)}])")
        for part in _PARTS.findall(pattern):
            if _CLASS_ESCAPE.search(part) or part == ".":
                atoms.add(part)
    return sorted(atoms)


def _hf_matches(atom: str, text: str) -> np.ndarray:
    """Which code points (a mask over all of them) of `text` (`_CODE_POINTS`, then U+0000)
    HF's regex engine matches with `atom`: a Replace normalizer deletes the matches (the
    same Oniguruma `SysRegex` as the Split pre-tokenizer), and what is left was not matched.
    In 64k-character chunks: 3-10x faster than one call (alignments), and a one-character
    atom cannot match across a cut."""
    from tokenizers import Regex, normalizers

    delete = normalizers.Replace(Regex(atom), "")
    step = 1 << 16
    left = "".join(delete.normalize_str(text[k : k + step]) for k in range(0, len(text), step))
    matched = np.zeros(0x110000, dtype=bool)
    matched[_CODE_POINTS] = True
    matched[0] = True
    matched[np.frombuffer(left.encode("utf-32-le"), dtype="<u4")] = False
    return matched


def _fast_matches(atom: str, engine: str, ranks_path: str) -> np.ndarray:
    """The same for a fast engine, which only encodes: every code point c is written as
    "\\0\\0c", split by `\\0\\0(?:atom)|[\\s\\S]` and encoded with the 256 bytes plus the
    token "\\0\\0" (256). A match is one piece "\\0\\0c", whose BPE merges the two NULs into
    256; otherwise each character is its own piece and the NULs stay 0, 0. So each code
    point's ids start with 256 or with 0, 0, and no byte of any c > 0 is 0."""
    pattern = rf"\x00\x00(?:{atom})|[\s\S]"
    texts = [_separated_code_points(), "\x00\x00\x00"]
    if engine == "fastokens":
        import fastokens

        tok = fastokens.Tokenizer.from_tiktoken(ranks_path, pattern=pattern, special_tokens={})
        flat, offsets = tok.encode_batch_flat(texts, split_special_tokens=True)
        all_ids = np.frombuffer(flat, dtype="<i4")
        cut = int(np.frombuffer(offsets, dtype="<i8")[1])
        ids, nul = all_ids[:cut], all_ids[cut:]
    else:
        import tiktoken

        ranks = {bytes([b]): b for b in range(256)} | {b"\x00\x00": 256}
        enc = tiktoken.Encoding("split-proof", pat_str=pattern, mergeable_ranks=ranks,
                                special_tokens={})  # fmt: skip
        ids, nul = (np.asarray(enc.encode_ordinary(t)) for t in texts)
    starts = np.sort(np.concatenate([np.flatnonzero(ids == 256), np.flatnonzero(ids == 0)[::2]]))
    if len(starts) != len(_CODE_POINTS):
        raise ValueError(f"{engine}: the split proof's encoding is not the expected one")
    matched = np.zeros(0x110000, dtype=bool)
    matched[_CODE_POINTS] = ids[starts] == 256
    matched[0] = nul[0] == 256  # "\0\0\0" matched: [256, 0]; else [0, 0, 0]
    return matched


@functools.cache
def _separated_code_points() -> str:
    """ "\0\0c" for every code point c of `_CODE_POINTS` (0.6 s to build: built once)."""
    return "".join("\x00\x00" + chr(c) for c in _CODE_POINTS.tolist())


def _versions(engine: str) -> dict[str, str]:
    from importlib.metadata import version

    return {"tokenizers": version("tokenizers"), engine: version(engine)}


def split_exceptions(patterns: tuple[str, ...], engine: str) -> tuple[int, ...] | None:
    """The code points on which `engine` (fastokens: PCRE2; tiktoken: fancy-regex) and HF's
    tokenizer (Oniguruma) disagree about any character class of `patterns` (the fast split
    and HF's own), over every code point; None where the pattern cannot be taken apart
    (`class_atoms`). Cached on disk by the patterns, the engine and both libraries' versions.

    Why this proves the split: the two engines run the same pattern (or, for cl100k, two
    spellings proven to agree: `CL100K_HF_PATTERN`), and what a pattern matches is decided
    by its literals, its structure and its classes. Literals match alike everywhere; the
    structure (alternation order, greedy and possessive runs, lookahead, `$`) is the same
    algorithm, which the probe and the per-batch samples keep checking; the classes are
    Unicode tables, which each engine carries in its own version. Here every class of the
    pattern is run through both engines on every code point: on a text with none of the
    code points where they differ, both engines see the same classes, so they split alike.
    A text with one of them goes to HF (`LoadedTokenizer.encode_verified`).
    The HF side removes the class's matches with a Split pre-tokenizer and reads what is
    left; the fast side encodes (`_fast_matches`). Found for cl100k with fastokens 0.3.5:
    U+180E (MONGOLIAN VOWEL SEPARATOR), a space to PCRE2 and not to Oniguruma; none with
    tiktoken. Cost, cl100k's 7 atoms on a shared 2-core machine (load average ~4): 5.0-5.5 s
    cold per engine (the fast side, ~0.5-1.5 s an atom, on two threads with the GIL
    released; HF's side ~0.1-0.4 s an atom meanwhile), 0.6 ms cached; under heavier load
    it took up to 16 s. A node's processes prove once between them (a file lock).
    """
    atoms = class_atoms(*patterns)
    if atoms is None:
        return None
    key = json.dumps([SPLIT_PROOF_VERSION, sorted(set(patterns)), engine, _versions(engine)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    path = cache_dir() / "split_proofs" / f"{engine}-{digest}.json"
    cached = _read_split_proof(path)
    if cached is not None:
        return cached
    path.parent.mkdir(parents=True, exist_ok=True)
    # One process proves, the others (a node's Ray workers, all cold at once) wait for it
    # rather than each spend the same CPU-seconds on the same cores.
    with open(path.with_suffix(".lock"), "w") as lock:
        _lock(lock)
        cached = _read_split_proof(path)
        if cached is not None:
            return cached
        differ = _split_differences(tuple(atoms), engine)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"patterns": sorted(set(patterns)), "atoms": atoms, "engine": engine,
                       "versions": _versions(engine), "differ": list(differ)}, f)  # fmt: skip
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    return differ


def _read_split_proof(path: Path) -> tuple[int, ...] | None:
    try:
        return tuple(json.loads(path.read_text())["differ"])
    except (OSError, ValueError, TypeError, KeyError):
        return None  # absent or unreadable: prove again


def _lock(f) -> None:
    """An exclusive lock on open file `f`, released when it closes (POSIX; else none)."""
    try:
        import fcntl
    except ImportError:
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)


@functools.lru_cache(maxsize=16)
def _split_differences(atoms: tuple[str, ...], engine: str) -> tuple[int, ...]:
    """Code points where `engine` and HF differ on any of `atoms` (memoized per process:
    tests load many tokenizers of one pattern under fresh caches)."""
    from concurrent.futures import ThreadPoolExecutor

    text = "".join(chr(c) for c in _CODE_POINTS.tolist()) + "\x00"
    with tempfile.TemporaryDirectory() as tmp:
        ranks_path = os.path.join(tmp, "bytes.tiktoken")
        with open(ranks_path, "w") as f:
            for b, token in enumerate([bytes([b]) for b in range(256)] + [b"\x00\x00"]):
                f.write(f"{base64.b64encode(token).decode()} {b}\n")
        _separated_code_points()  # once, before the threads need it
        with ThreadPoolExecutor(2, thread_name_prefix="tokenmill-split-proof") as pool:
            fast = [pool.submit(_fast_matches, atom, engine, ranks_path) for atom in atoms]
            differ = np.zeros(0x110000, dtype=bool)
            for atom, result in zip(atoms, fast, strict=True):
                differ |= _hf_matches(atom, text) != result.result()
    return tuple(np.flatnonzero(differ).tolist())
