"""Tokenizing exactly as the model's own tokenizer: `load_tokenizer(cfg.tokenizer)` is the one
face; everything else here serves it.

- `files.py`: where a tokenizer's files come from (the offline default, a path, the Hub cache);
- `proofs.py`: a fast engine proven to give the tokenizer's ids (vocabulary, split pattern);
- `engines.py`: `LoadedTokenizer`, which encodes with the fastest proven engine, else HF;
- `chat.py`: conversations rendered with the chat template, loss on assistant turns only.
"""

from pipeline.tokenize.engines import LoadedTokenizer, load_tokenizer

__all__ = ["LoadedTokenizer", "load_tokenizer"]
