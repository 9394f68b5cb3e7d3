"""The real things at once (STYLE 14): threads sharing one tokenizer, exports side by side.

Each run is compared with a lone run, byte for byte: sharing must change nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.tokenize.chat import ChatEncoder
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient

SPECIAL_TEXT = "see <|endoftext|> and <|im_end|> in text"


def _conversations(n: int) -> list[list[dict]]:
    texts = stdlib_texts(n, max_bytes=1500)
    return [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"{SPECIAL_TEXT} {i}: {texts[i][:300]}"},
            {"role": "assistant", "content": texts[i][300:900] + " <|endoftext|>"},
        ]
        for i in range(n)
    ]


def test_threads_encoding_chat_and_text_on_one_tokenizer_agree_with_a_lone_encode(tokenizer):
    """Chat (template glue: special tokens recognised) and plain text (HF and the verified
    fast path) encoded at once on the same LoadedTokenizer give the ids of a lone encode; a
    user's "<|endoftext|>" stays text. (Toggling `encode_special_tokens` on the shared HF
    tokenizer for the glue raised "RuntimeError: Already borrowed" here, or flipped it under
    the other thread's encode.)"""
    conversations = _conversations(16)
    texts = [SPECIAL_TEXT * 20, *stdlib_texts(24, max_bytes=4000)]
    want_chat = ChatEncoder(tokenizer).encode(conversations)
    want_hf = tokenizer.encode(texts)
    want_fast = tokenizer.encode_verified(texts)
    eot = tokenizer.tokenizer.token_to_id("<|endoftext|>")
    user_ids = tokenizer.encode([SPECIAL_TEXT])[0]
    assert eot not in user_ids.tolist()  # text is text
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def run(work) -> None:
        try:
            start.wait()
            for _ in range(25):
                work()
        except BaseException as e:  # reported below, with the others
            errors.append(e)

    def chat() -> None:
        got = ChatEncoder(tokenizer).encode(conversations)
        for (ids, loss), (w_ids, w_loss) in zip(got, want_chat, strict=True):
            assert ids.tolist() == w_ids.tolist() and loss.tolist() == w_loss.tolist()

    def hf() -> None:
        flat, offsets = tokenizer.encode(texts)
        assert flat.tolist() == want_hf[0].tolist() and offsets.tolist() == want_hf[1].tolist()

    def fast() -> None:
        flat, offsets, backend = tokenizer.encode_verified(texts)
        assert flat.tolist() == want_fast[0].tolist() and backend == want_fast[2]

    threads = [threading.Thread(target=run, args=(w,)) for w in (chat, chat, hf, fast)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    for ids, _ in want_chat:  # the user's special-token text never became a control token
        assert ids.tolist().count(eot) == 0


def _chat_config(tmp_path: Path) -> Path:
    """The issue's config (seed 5, seq_len 1024, G 8, bfd 256, skip, three streams), small."""
    src = tmp_path / "src"
    src.mkdir()
    texts = stdlib_texts(240, max_bytes=8000)
    write_jsonl(src / "a.jsonl", texts[:120])
    write_jsonl(src / "b.jsonl", texts[120:])
    chats = [{"messages": c} for c in _conversations(150)]
    write_jsonl(src / "chat.jsonl", chats)
    cfg = {
        "seed": 5,
        "seq_len": 1024,
        "global_batch_size": 8,
        "packing": {"mode": "bfd", "buffer": 256},
        "on_error": "skip",
        "mixing": {"on_exhausted": "renormalize"},
        "read": {"first_block_bytes": 16 << 10, "block_bytes": 64 << 10},
        "streams": {
            "web": {"paths": [str(src / "a.jsonl")], "weight": 2},
            "chat": {"kind": "chat", "paths": [str(src / "chat.jsonl")], "weight": 1},
            "code": {"paths": [str(src / "b.jsonl")], "weight": 1},
        },
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _export(cfg: Path, out: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "service", "export", "--config", str(cfg), "--out", str(out),
         "--steps", "30", "--state-every", "10", "--address", address, "--pool", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _files(out: Path) -> dict[str, bytes]:
    names = [p for p in sorted(out.iterdir()) if p.name.startswith(("step-", "state-"))]
    return {p.name: p.read_bytes() for p in names}


def test_two_chat_exports_at_once_equal_a_lone_one(ray_cluster, tmp_path):
    """Two exports of a chat-stream config at once (the CLI), then one alone: every run exits
    0 and writes the same bytes (each export's head start tokenizes its three streams on
    threads sharing one tokenizer; before, 6 of 10 such runs died of "Already borrowed")."""
    from pipeline.read.resolve import load_config
    from service.export import run_export

    cfg = _chat_config(tmp_path)
    address = ray_cluster.get_runtime_context().gcs_address
    runs = [_export(cfg, tmp_path / f"pair{i}", address) for i in range(2)]
    results = [(p, *p.communicate(timeout=patient(300))) for p in runs]
    for p, _, err in results:
        assert p.returncode == 0, err[-3000:]
    # The lone run: the same export (Ray Data with a head start), in this process.
    run_export(load_config(cfg), tmp_path / "lone", steps=30, state_every=10)
    want = _files(tmp_path / "lone")
    assert sum(n.startswith("step-") for n in want) == 30
    assert sum(n.startswith("state-") for n in want) == 3
    for i in range(2):
        assert _files(tmp_path / f"pair{i}") == want
    summary = json.loads((tmp_path / "lone" / "summary.json").read_text())
    assert summary["streams"]["chat"]["tokens"] > 0


@pytest.mark.parametrize("n_threads", [3])
def test_loading_one_tokenizer_from_threads_at_once_loads_it_once(n_threads):
    """The process-wide tokenizer cache is filled under its lock: every thread gets the same
    object."""
    from pipeline.config import TokenizerConfig
    from pipeline.tokenize.engines import load_tokenizer

    got: list = []
    threads = [
        threading.Thread(target=lambda: got.append(load_tokenizer(TokenizerConfig())))
        for _ in range(n_threads)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(t) for t in got}) == 1
    assert np.array_equal(got[0].encode(["x"])[0], got[-1].encode(["x"])[0])
