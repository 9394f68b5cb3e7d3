"""The stages a document passes through, each an iterator with a resumable state
(`stage.py`: the protocol, and `Doc`, what flows between them):

`documents.py` (a stream's good documents, rejects counted) -> `shuffle.py` (pieces
interleaved, a window permuted) -> `mixing.py` (token-exact weights) -> `packing.py` (rows of
`seq_len`, no cross-document attention).
"""
