"""The tokenizer backends: the HF reference, and the fast backend used only where it is exact."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pipeline.config import TokenizerConfig
from pipeline.read.reading import Unit, tokenize_unit
from pipeline.read.resolve import parse_config
from pipeline.read.sources import plan_pieces
from pipeline.tokenize.encoders import (
    BACKEND_FAST,
    BACKEND_FASTOKENS,
    CL100K_TIKTOKEN_PATTERN,
    FAST_PROBE,
    VERIFY_MIN_CHARS,
    FastokensEncoder,
    bpe_form,
    probe_fast,
    tiktoken_engine,
)
from pipeline.tokenize.engines import (
    BACKEND_HF,
    BACKEND_HF_FALLBACK,
    FastBackendError,
    FastEncoder,
    LoadedTokenizer,
    load_tokenizer,
    verify_sample,
)
from pipeline.tokenize.files import cl100k_ranks_file, default_tokenizer_file
from pipeline.tokenize.proofs import REQUIRED, bytes_decoder, prove_fast
from tests.conftest import stdlib_texts


def _tiktoken(pattern: str = CL100K_TIKTOKEN_PATTERN):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(cl100k_ranks_file()))
    return tiktoken.Encoding("t", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


def test_default_hf_tokenizer_is_cl100k_exactly(tokenizer):
    """The converted HF tokenizer gives tiktoken's ids, digits included ("0010" -> 001|0)."""
    enc = _tiktoken()
    hf = tokenizer.tokenizer
    assert [hf.id_to_token(i) for i in tokenizer.encode(["0010"])[0]] == ["001", "0"]
    texts = list(FAST_PROBE) + stdlib_texts(60)
    for text in texts:
        assert hf.encode(text, add_special_tokens=False).ids == enc.encode_ordinary(text), text


def test_fast_backend_is_used_and_exact(tokenizer):
    assert tokenizer.fast is not None, "the default tokenizer should get the fast backend"
    assert tokenizer.fast.name == "fastokens", "auto should pick the fastest engine installed"
    texts = stdlib_texts(20) + ["<|endoftext|> literal", "12345678"]
    flat, offsets, backend = tokenizer.encode_verified(texts)
    want_flat, want_offsets = tokenizer.encode(texts)
    assert backend == BACKEND_FASTOKENS
    assert flat.tolist() == want_flat.tolist() and offsets.tolist() == want_offsets.tolist()


def test_verify_sample_is_proportional_and_deterministic():
    texts = [("x" * (10 + i % 7 * 300)) for i in range(1000)]
    total = sum(map(len, texts))
    picked = verify_sample(texts, 0.01)
    assert picked == verify_sample(texts, 0.01)
    assert all(a == 0 and b == len(texts[i]) for i, a, b in picked)  # whole texts
    index = [i for i, _, _ in picked]
    assert index[0] == 0 and all(b - a >= 100 for a, b in zip(index, index[1:], strict=False))
    assert 0 < sum(len(texts[i]) for i in index) <= 0.01 * total
    # One huge document among small ones: the budget is never blown, the check never skipped.
    texts = ["y" * 1_000_000] + ["z" * 50] * 10
    assert verify_sample(texts, 0.01) == [(1, 0, 50)]
    assert verify_sample(["only one"], 0.01) == [(0, 0, 8)]


def test_verify_sample_checks_a_window_of_a_long_document():
    """A batch whose every text outgrows the budget checks a window of the shortest, the
    budget long (VERIFY_MIN_CHARS at least), from its middle: never the whole of a long text
    (a one-document batch of 1.2M characters was checked whole, at HF's speed)."""
    assert verify_sample(["x" * 1_000_000], 0.01) == [(0, 495_000, 505_000)]
    texts = ["a" * 400_000, "b" * 300_000, "c" * 500_000]
    assert verify_sample(texts, 0.01) == [(1, 144_000, 156_000)]
    # A small batch still checks VERIFY_MIN_CHARS, or its shortest text whole if shorter.
    assert verify_sample(["d" * 2_000], 0.01) == [(0, 872, 872 + VERIFY_MIN_CHARS)]
    assert verify_sample(["e" * 100, "f" * 200], 0.01) == [(0, 0, 100)]


@pytest.mark.parametrize("engine", ["tiktoken", "fastokens"])
def test_a_wrong_engine_is_caught_in_a_long_documents_window(tokenizer, engine):
    """The window is checked as a text of its own: a fast engine that splits digit runs
    differently is caught inside one long document, and the batch goes to HF."""
    long = " ".join(f"release {20261122 + i} notes" for i in range(20_000))  # ~460k characters
    auto = _with_fast(tokenizer, _wrong_engine(engine), "auto")
    flat, _, backend = auto.encode_verified([long])
    assert backend == BACKEND_HF_FALLBACK
    assert flat.tolist() == tokenizer.encode([long])[0].tolist()
    # The right engine passes the same window: the batch keeps the fast ids.
    assert tokenizer.encode_verified([long])[2] == tokenizer.fast.code


def _with_fast(tok: LoadedTokenizer, fast, backend: str) -> LoadedTokenizer:
    from dataclasses import replace

    return replace(tok, fast=fast, backend=backend)


WRONG_DIGITS = CL100K_TIKTOKEN_PATTERN.replace(r"\p{N}{1,3}+", r"\p{N}+")


def _wrong_engine(engine: str) -> FastEncoder:
    """A fast encoder of `engine` that splits digit runs differently from cl100k."""
    if engine == "tiktoken":
        return FastEncoder(_tiktoken(WRONG_DIGITS))
    import fastokens

    path = str(cl100k_ranks_file())
    tok = fastokens.Tokenizer.from_tiktoken(path, pattern=WRONG_DIGITS, special_tokens={})
    return FastokensEncoder(tok, lambda: {})


@pytest.mark.parametrize("engine", ["tiktoken", "fastokens"])
def test_inexact_fast_backend_falls_back_or_fails(tokenizer, engine):
    """A fast encoder that splits digits differently is caught by the sample, not trusted."""
    wrong = _wrong_engine(engine)
    texts = [f"version {20261122 + i} of the file" for i in range(300)]
    auto = _with_fast(tokenizer, wrong, "auto")
    flat, offsets, backend = auto.encode_verified(texts)
    assert backend == BACKEND_HF_FALLBACK
    assert flat.tolist() == tokenizer.encode(texts)[0].tolist()
    # Without digits the wrong encoder happens to agree: then it may be used.
    assert auto.encode_verified(["plain words only"])[2] == wrong.code
    strict = _with_fast(tokenizer, wrong, engine)
    with pytest.raises(FastBackendError, match=f"backend {engine}: .*version 2026"):
        strict.encode_verified(texts)


@pytest.mark.parametrize("engine", ["tiktoken", "fastokens"])
def test_each_fast_engine_can_be_named_and_is_exact(engine):
    """`backend: tiktoken` / `fastokens` load that engine; every text checked gives HF's ids."""
    from dataclasses import replace

    tok = load_tokenizer(TokenizerConfig(backend=engine))
    assert tok.fast is not None and tok.fast.name == engine
    texts = [*FAST_PROBE, *stdlib_texts(30), "0" * 5000, " \n" * 3000]
    # A text with a code point the engine's classes are not proven on goes to HF (U+180E).
    texts = [t for t in texts if not (tok.split_guard and tok.split_guard.hits([t]))]
    flat, offsets, backend = replace(tok, verify_fraction=1.0).encode_verified(texts)
    assert backend == tok.fast.code
    want_flat, want_offsets = tok.encode(texts)
    assert flat.tolist() == want_flat.tolist() and offsets.tolist() == want_offsets.tolist()


def test_auto_takes_the_next_engine_when_one_fails_its_probe(monkeypatch):
    """Under auto, a fastokens engine whose split differs gives way to tiktoken; under
    `backend: fastokens` the same engine is an error, naming the text."""
    import pipeline.tokenize.encoders as encoders
    import pipeline.tokenize.engines as engines

    monkeypatch.setattr(encoders, "fastokens_engine", lambda form: _wrong_engine("fastokens"))
    monkeypatch.setattr(engines, "preload_fastokens", lambda cfg: None)
    monkeypatch.setitem(
        encoders.ENGINES, "auto", (encoders.fastokens_engine, encoders.tiktoken_engine)
    )
    monkeypatch.setitem(encoders.ENGINES, "fastokens", (encoders.fastokens_engine,))
    monkeypatch.setattr(engines, "_CACHE", {})
    tok = load_tokenizer(TokenizerConfig())
    assert tok.fast is not None and tok.fast.name == "tiktoken"
    with pytest.raises(FastBackendError, match="backend fastokens: not exact .* differs on '0010"):
        load_tokenizer(TokenizerConfig(backend="fastokens"))


def test_backend_hf_never_uses_the_fast_encoder():
    tok = load_tokenizer(TokenizerConfig(backend="hf"))
    assert tok.fast is None
    assert tok.encode_verified(["some text 123"])[2] == BACKEND_HF


def test_tokenizer_json_gets_a_fast_form_and_a_bad_one_is_refused(tmp_path):
    """A byte-level BPE tokenizer.json is ported generically; the probe rejects a bad port."""
    good = tmp_path / "good.json"
    good.write_text(default_tokenizer_file().read_text())
    tok = load_tokenizer(TokenizerConfig(name=str(good), eos_id=100257))
    assert tok.fast is not None
    assert tok.encode_verified(["x = 1234\n"])[2] == BACKEND_FASTOKENS
    # The possessive pattern means something else to Oniguruma than to tiktoken's engine.
    d = json.loads(default_tokenizer_file().read_text())
    d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = CL100K_TIKTOKEN_PATTERN
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    assert load_tokenizer(TokenizerConfig(name=str(bad), eos_id=100257)).fast is None
    with pytest.raises(FastBackendError, match="not exact"):
        load_tokenizer(TokenizerConfig(name=str(bad), eos_id=100257, backend="tiktoken"))


def test_blocks_report_the_backend_and_match_hf(tmp_path):
    texts = stdlib_texts(6)
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = parse_config({"seq_len": 64, "streams": {"s": {"paths": [str(path)]}}})
    unit = Unit(0, tuple(plan_pieces([str(path)], "jsonl", 1 << 20)[0]))
    fast = tokenize_unit(unit, cfg.streams["s"], load_tokenizer(cfg.tokenizer))
    hf_cfg = cfg.tokenizer.model_copy(update={"backend": "hf"})
    slow = tokenize_unit(unit, cfg.streams["s"], load_tokenizer(hf_cfg))
    assert fast.column("backend").to_pylist() == [BACKEND_FASTOKENS] * len(texts)
    assert slow.column("backend").to_pylist() == [BACKEND_HF] * len(texts)
    assert fast.column("tokens").equals(slow.column("tokens"))
    # The backend is not part of the run's identity: resume states stay valid across it.
    assert (
        cfg.config_hash()
        == parse_config(
            {
                "seq_len": 64,
                "tokenizer": {"backend": "hf"},
                "streams": {"s": {"paths": [str(path)]}},
            }
        ).config_hash()
    )


def test_fast_backend_on_hostile_texts(tokenizer):
    """Long unbroken runs, mixed scripts, lone surrogate-free oddities: same ids as HF."""
    from dataclasses import replace

    every = replace(tokenizer, verify_fraction=1.0)  # check every text, not a sample
    texts = [
        "a" * 200_000,
        "ab1" * 50_000,
        "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(50_000)),
        " " * 10_000 + "x",
        "\n" * 5_000,
        "\ufeffBOM then text\u2028line sep\u0085nel",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 " * 1000,
    ]
    flat, offsets, backend = every.encode_verified(texts)
    assert backend == BACKEND_FASTOKENS
    assert flat.tolist() == tokenizer.encode(texts)[0].tolist()


@pytest.mark.parametrize("variant", ["gpt2_bytelevel", "nfc"])
def test_other_byte_level_forms_get_an_exact_fast_backend(tmp_path, variant):
    """GPT-2-style (ByteLevel's own split) and NFC-normalized (Qwen2-style) tokenizer.json
    files are ported too, and give the HF ids, decomposed accents and digit runs included."""
    d = json.loads(default_tokenizer_file().read_text())
    if variant == "gpt2_bytelevel":
        d["pre_tokenizer"] = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        }
    else:
        d["normalizer"] = {"type": "NFC"}
    path = tmp_path / f"{variant}.json"
    path.write_text(json.dumps(d))
    tok = load_tokenizer(TokenizerConfig(name=str(path), eos_id=100257))
    assert tok.fast is not None, variant
    texts = ["cafe\u0301 nai\u0308ve 12345 x  \n\n y", *stdlib_texts(5)]
    every = _with_fast(tok, tok.fast, "auto")
    from dataclasses import replace

    every = replace(every, verify_fraction=1.0)
    flat, _, backend = every.encode_verified(texts)
    assert backend == BACKEND_FASTOKENS
    assert flat.tolist() == tok.encode(texts)[0].tolist()


@pytest.mark.parametrize("key", ["bos_id", "eos_id", "pad_id"])
def test_special_ids_outside_the_vocabulary_are_refused(key):
    from pipeline.config import TokenizerConfig

    with pytest.raises(ValueError, match=rf"tokenizer.{key}: 2000000000 is not an id of 'default'"):
        load_tokenizer(TokenizerConfig(**{key: 2_000_000_000}))


# --- Load-time proofs (pipeline.tokenize.proofs.prove_fast): exactness of the fast backend's BPE, by construction ---


def test_fast_backend_is_proven_exact_for_the_default_tokenizer(tokenizer):
    """Everything but the regex split is proven for cl100k, and proven afresh here (the
    session's tokenizer may have read its verdict from the disk cache)."""
    g = tokenizer.guarantees
    assert g.as_dict() == {
        "same_vocab": True,
        "merges_ordered": True,
        "whole_piece_lookup": True,
        "vocab_roundtrip": True,
        "added_tokens": True,
        "pretokenizer": "sampled",
        "normalizer": "none",
        "failed": None,
        "split_classes": "proven; to hf: U+180E",
    }
    assert g.proven and tokenizer.fast is not None
    # prove_fast proves the BPE part; the split's classes are proven apart (split_exceptions).
    fresh = prove_fast(json.loads(default_tokenizer_file().read_text()), tokenizer.fast.ranks)
    assert fresh == replace(g, split_classes="not checked")


@functools.cache
def _mini_cl100k_text(n: int = 3000) -> str:
    """cl100k cut to its first `n` ranks, every merge among them kept: a real byte-level BPE
    tokenizer.json whose proofs take milliseconds instead of a second."""
    d = json.loads(default_tokenizer_file().read_text())
    vocab = {t: i for t, i in d["model"]["vocab"].items() if i < n}
    merges = [m for m in d["model"]["merges"] if {m[0], m[1], m[0] + m[1]} <= vocab.keys()]
    d["model"] |= {"vocab": vocab, "merges": merges}
    d["added_tokens"] = []
    return json.dumps(d)


@pytest.fixture
def mini(tmp_path, monkeypatch):
    """`mini(edit, backend, name)`: write the mini cl100k, edited, and load it. Proof verdicts
    are cached under tmp_path, so every test proves afresh."""
    text = _mini_cl100k_text()  # reads the real default tokenizer, before the cache moves
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))

    def load(edit=None, backend: str = "auto", name: str = "mini") -> LoadedTokenizer:
        d = json.loads(text)
        if edit is not None:
            edit(d)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(d))
        return load_tokenizer(TokenizerConfig(name=str(path), eos_id=0, backend=backend))

    return load


def _fast_for(tok: LoadedTokenizer) -> FastEncoder:
    """tiktoken over the ranks of `tok`'s own tokenizer.json: what the fast backend would say."""
    form = bpe_form(json.loads(Path(tok.name).read_text()), default=False)
    assert form is not None, f"{tok.name}: no byte-level BPE form"
    return tiktoken_engine(form)


def _swap_with_last(pair):
    def edit(d):
        merges = d["model"]["merges"]
        i = merges.index(list(pair))
        merges[i], merges[-1] = merges[-1], merges[i]

    return edit


def _drop(pair):
    return lambda d: d["model"]["merges"].remove(list(pair))


def _add_unreachable_token(ignore_merges: bool):
    """Token 'pino' (= 'pi' + 'no', its only split) that BPE never reaches: 'in' outranks both
    halves, leaving p|in|o. Both libraries agree on that; only a whole-piece lookup differs."""

    def edit(d):
        d["model"]["vocab"]["pino"] = len(d["model"]["vocab"])
        d["model"]["merges"].append(["pi", "no"])
        d["model"]["ignore_merges"] = ignore_merges

    return edit


def _add_plain_token(d):
    the = d["model"]["vocab"]["the"]
    flags = dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized", "special"), False)
    d["added_tokens"] = [{"id": the, "content": "the", **flags}]


# Broken tokenizer.json files: (edit, the guarantees that fail, a text where HF then really
# differs from tiktoken on the same ranks, or None where HF is random).
BROKEN = {
    "merge_order_swapped": (_swap_with_last(("o", "n")), {"merges_ordered"}, "collections"),
    "used_merge_dropped": (
        _drop(("i", "n")),
        {"merges_ordered", "vocab_roundtrip"},
        "within",
    ),
    "unreachable_token_without_lookup": (
        _add_unreachable_token(ignore_merges=False),
        {"whole_piece_lookup", "vocab_roundtrip"},
        "pino",
    ),
    "dropout": (
        lambda d: d["model"].update(dropout=0.5),
        {"same_vocab", "merges_ordered", "whole_piece_lookup", "vocab_roundtrip"},
        None,
    ),
    "plain_added_token": (_add_plain_token, {"added_tokens"}, "other"),
}
GUARANTEES = (*REQUIRED, "vocab_roundtrip")


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_failed_proof_turns_the_fast_backend_off(mini, case):
    """Each breakage fails its guarantee at load: `auto` encodes with HF, `tiktoken` refuses
    and names the guarantee; and the breakage is real (HF differs from tiktoken)."""
    edit, failing, text = BROKEN[case]
    tok = mini(edit, name=case)
    g = tok.guarantees
    assert {name for name in GUARANTEES if not getattr(g, name)} == failing, g.failed
    assert not g.proven and tok.fast is None
    assert tok.encode_verified(["x = 1234 in the within"])[2] == BACKEND_HF
    if text is not None:
        assert tok.encode([text])[0].tolist() != _fast_for(tok).encode([text])[0]
    first = next(name for name in REQUIRED if name in failing)
    with pytest.raises(FastBackendError, match=f"a guarantee failed: {first}: "):
        mini(edit, backend="tiktoken", name=f"{case}_strict")


def test_the_load_probe_alone_would_have_missed_a_swapped_merge(mini):
    """Why prove: with two merges swapped, HF differs on 'collections', yet the probe texts
    pass; before the proofs, only a per-batch sample that happened to hold it could tell."""
    tok = mini(BROKEN["merge_order_swapped"][0], backend="hf")
    assert probe_fast(tok.tokenizer, _fast_for(tok)) is None


# Edits that look like breakage but provably change nothing.
ACCEPTED = {
    # (' ', 'th') is a split of ' th' that BPE never uses: ' t' + 'h' forms it.
    "unused_merge_dropped": _drop(("Ġ", "th")),
    # Every token is reachable by merges, so the whole-piece lookup changes nothing.
    "lookup_off": lambda d: d["model"].update(ignore_merges=False),
    # vocab_roundtrip fails, but every split is listed and the lookup is on.
    "unreachable_token_with_lookup": _add_unreachable_token(ignore_merges=True),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_what_the_proofs_accept_is_exact(mini, case):
    """Harmless edits keep the fast backend, and it gives HF's ids on every text (all
    checked, not sampled)."""
    from dataclasses import replace

    tok = mini(ACCEPTED[case], name=case)
    assert tok.guarantees.proven and tok.fast is not None, tok.guarantees.failed
    texts = ["pino pinot spinoza within the collections", " th this", *stdlib_texts(5)]
    flat, _, backend = replace(tok, verify_fraction=1.0).encode_verified(texts)
    # fastokens refuses to load a token its merges cannot build ('pino'): tiktoken serves it.
    want = BACKEND_FAST if case == "unreachable_token_with_lookup" else BACKEND_FASTOKENS
    assert backend == want
    assert flat.tolist() == tok.encode(texts)[0].tolist()


def test_proof_verdicts_are_cached_by_content(mini, tmp_path):
    tok = mini()
    assert tok.guarantees.proven and tok.fast is not None
    [cached] = (tmp_path / "cache" / "fast_proofs").iterdir()
    digest = hashlib.sha256((tmp_path / "mini.json").read_bytes()).hexdigest()
    assert cached.name.startswith(digest)
    # The same content under another name reads the verdict instead of proving: a doctored
    # verdict is believed.
    cached.write_text(json.dumps({**tok.guarantees.as_dict(), "merges_ordered": False}))
    again = mini(name="same_content")
    assert again.guarantees.merges_ordered is False and again.fast is None


def _bytes_to_chars() -> dict[int, str]:
    return {b: ch for ch, b in bytes_decoder().items()}


@st.composite
def _small_bpe(draw):
    """A random byte-level BPE: 256 bytes plus a few tokens over 'abc' ranked at random, a
    random subset of their splits as merges, in random or rank order, lookup on or off."""
    extra = draw(
        st.lists(st.text("abc", min_size=2, max_size=5), min_size=1, max_size=10, unique=True)
    )
    rng = draw(st.randoms(use_true_random=False))
    rng.shuffle(extra)
    ranks = {bytes([b]): b for b in range(256)} | {t.encode(): 256 + i for i, t in enumerate(extra)}
    splits = [(t[:k], t[k:]) for t in extra for k in range(1, len(t))]
    merges = [(a, b) for a, b in splits if a.encode() in ranks and b.encode() in ranks]
    keep = draw(st.sampled_from([0.7, 1.0]))  # 1.0: every split listed, as in cl100k's file
    merges = [m for m in merges if rng.random() < keep]
    rng.shuffle(merges)
    if draw(st.booleans()):
        merges.sort(key=lambda m: ranks[(m[0] + m[1]).encode()])
    chars = _bytes_to_chars()
    vocab = {"".join(chars[b] for b in t): r for t, r in ranks.items()}
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": draw(st.booleans()),
        "vocab": vocab,
        "merges": [list(m) for m in merges],
    }
    pre = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": pre,
        "post_processor": None,
        "decoder": None,
        "truncation": None,
        "padding": None,
        "model": model,
    }, ranks


SHORT_STRINGS = ["".join(p) for n in range(1, 7) for p in itertools.product("abc", repeat=n)]


@settings(max_examples=100, deadline=None)
@given(_small_bpe())
def test_proven_means_equal_on_every_short_string(case):
    """The theorem, against the real libraries: wherever `prove_fast` proves, tiktoken and the
    HF tokenizer agree on all 1,092 strings of up to 6 letters (each one pre-token)."""
    import tiktoken
    from tokenizers import Tokenizer

    doc, ranks = case
    g = prove_fast(doc, ranks)
    event(f"proven={g.proven}")
    if not g.proven:
        return
    hf = Tokenizer.from_str(json.dumps(doc))
    enc = tiktoken.Encoding("small", pat_str=r"[abc]+", mergeable_ranks=ranks, special_tokens={})
    got = [e.ids for e in hf.encode_batch(SHORT_STRINGS, add_special_tokens=False)]
    assert got == [enc.encode_ordinary(s) for s in SHORT_STRINGS], g
