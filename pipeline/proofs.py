"""Load-time proofs: what makes the fast backend exact, checked over the whole vocabulary.

`prove_fast` shows, for one tokenizer.json and the ranks of the tiktoken encoder built from
it, that tiktoken's BPE gives the HF BPE model's ids on every pre-token; `FastGuarantees` is
its verdict, part by part, and `prove_cached` caches verdicts on disk by the file's sha256. The
split into pre-tokens is not provable (two regex engines): `pipeline.tokenization` samples it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pipeline.tokenizer_files import cache_dir


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
