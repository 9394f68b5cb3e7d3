"""Reading: from a config's paths to Arrow blocks of token ids, in parallel.

- `resolve.py`: `load_config`, a config file validated and its paths resolved to files;
- `access.py`: how a file is reached (`Access`, storage options, `Piece`, `PieceError`);
- `formats/`: one plug-in per source format (JSONL, Parquet, text, MDS, Arrow, export);
- `sources.py`: a stream's files, their pieces, a piece's records, through the formats;
- `reading.py`: units of pieces read and tokenized into blocks, by Ray tasks or in-process;
- `headstart.py`, `pool.py`: the same work started before Ray's workers are up, and kept
  warm across runs in named tokenizer actors.
"""
