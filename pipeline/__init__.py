"""The data plane: text in, packed and mixed rows out. Folders from the bottom up:

- `config.py`: the run's configuration (imports nothing else of tokenmill);
- `tokenize/`: a config's tokenizer loaded and proven exact (`load_tokenizer`);
- `read/`: a config resolved against its files (`load_config`), records read from any format
  and store, and tokenized into Arrow blocks by Ray workers, a pool or the head start;
- `stages/`: documents, shuffle, mixing and packing, each a resumable stage;
- `state/`: a run's sealed resume state and its summary;
- `feed.py`: the stages chained into global steps (`StepFeed`), what export and serve run;
- `lanes/`: K feeds, each a Ray actor with its share of the data, joined into global steps;
- `inspect/`: questions asked of a config without a run: `stats`, `provenance` (trace).

A module imports only from its own floor or below (`dev-extras/layers.py`, run by `./dev lint`).
"""
