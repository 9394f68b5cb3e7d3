"""ms-swift on tokenmill: every rank pulls its own packed rows, resumes at the same batch.

    export TOKENMILL_SERVICE=tokenmill            # the service's name (`tokenmill serve --name`)
    NPROC_PER_NODE=4 swift sft --external_plugins <checkout>/trainer/swift.py \\
        --dataset tokenmill --streaming true --max_steps 1000 --gradient_accumulation_steps 4 \\
        --model Qwen/Qwen2.5-7B --tuner_type full --save_steps 200 ...
    # resume: the same command plus --resume_from_checkpoint OUT/checkpoint-200

`swift pt` takes the same arguments. The service is found as `Feed.connect` finds it: its
record on this machine, else TOKENMILL_RAY_ADDRESS / RAY_ADDRESS. `TOKENMILL_TIMEOUT_S`
(default 60) bounds a wait for a step that nothing holds back.

**How it plugs in.** Swift imports the file named by `--external_plugins` on every rank
before it builds its trainer. The plugin (`register()`) does two things:

- it registers a dataset named `tokenmill` (`register_dataset(DatasetMeta(...))`): swift
  refuses to start without one. It is a one-row placeholder that swift encodes and prints
  once; training never reads it.
- it points `TrainerFactory.TRAINER_MAPPING['causal_lm']` (what `sft` and `pt` build) at
  `SwiftFeedTrainer`: swift's own `Seq2SeqTrainer` under `trainer.adapters.feed_trainer`, fed
  by a `FeedDataset` of this rank (`process_index`, `world_size`).

The plugin file is this module's file (`python -c 'import trainer.swift as m; print(m.__file__)'`).
ms-swift 4.6 imports it under a name of its own (`_swift_external_<hash>`, not `swift`), and that
copy only registers: the trainer swift builds is `trainer.swift.SwiftFeedTrainer`, imported as
usual. Swift also puts the file's folder (trainer/) first on `sys.path`.

**Every rank pulls its own rows.** For an IterableDataset swift's `get_train_dataloader` wraps
the loader in its `DataLoaderDispatcher`: rank 0 reads for every rank and scatters. A feed
read that way would advance on rank 0 only and leave the service holding every step for the
other ranks. `FeedTrainer.get_train_dataloader` returns `DataLoader(feed, batch_size=None)`
in-process instead, so there is no dispatcher, no collator and no worker process.

**Masks and documents are the service's.** A batch is `input_ids`, `labels` (-100 where no
loss: prompts, padding, each document's first token) and `position_ids` (restarting at every
document), with no `attention_mask`: HF's Qwen2/Llama find the documents from `position_ids`
(trainer/adapters.py says when). `prepare_packed` turns the KV cache off, and for
`--attn_impl flash_attn` flattens each batch to [1, B*L]. So these swift options do nothing
here, and the plugin says so in the log or refuses:

| option | here |
|---|---|
| `--packing`, `--padding_free`, `--packing_length` | ignored: the service packs (its `seq_len`, `packing.mode`) |
| `--max_length`, `--truncation_strategy` | ignored: rows are the service's `seq_len`; a warning if that exceeds `--max_length` |
| `--loss_scale` other than `default` (sft) or `all` (pt) | refused: the service's labels decide which tokens carry loss |
| `--per_device_train_batch_size` | ignored (warning if > 1): a micro-batch is `global_batch_size / world_size` rows |
| `--dataloader_num_workers`, `--streaming`, `--data_seed`, `--train_dataloader_shuffle` | ignored: the service reads, shuffles (its `seed`) and prefetches |
| `--num_train_epochs` | ignored: `--max_steps N > 0` is required (a feed has no length) |
| `--sequence_parallel_size > 1` | refused: its ranks expect identical rows, each feed rank gets its own |

**Exact resume.** Every `checkpoint-N/` gets `tokenmill_feed.json` (rank 0; the state is the
same on every rank). `--resume_from_checkpoint DIR` re-joins the service at that state before
the first batch, so the next batch is the one the uninterrupted run had next (HF's batch
skipping is off: `ignore_data_skip`). With `--resume_only_model` swift loads the weights
itself and, when `--ignore_data_skip true`, clears the resume path before training: the
plugin keeps the path and resumes the feed from it all the same (logged), so the data never
restarts at step 0 silently. (Swift then counts `global_step` from 0; `--max_steps` counts the
steps of this run.)

**Data wait.** Every log record swift prints and writes to `logging.jsonl` carries
`data_wait_s` (seconds blocked in the feed since the previous record) and
`data_wait_fraction` (of the wall time since then); the ranks report their waits to the
service too (its `/v1/metrics`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from trainer.adapters import FeedDataset, feed_trainer, load_feed_state
from wire.protocol import SERVICE_NAME

DATASET_NAME = "tokenmill"
TRAINER_PATH = "trainer.swift.SwiftFeedTrainer"
SERVICE_ENV, TIMEOUT_ENV = "TOKENMILL_SERVICE", "TOKENMILL_TIMEOUT_S"
# What swift encodes once (and prints) at startup, for `sft` (chat template) and `pt` alike.
PLACEHOLDER = {"messages": [{"role": "user", "content": "tokenmill"},
                            {"role": "assistant", "content": "tokenmill"}]}  # fmt: skip


def _log() -> logging.Logger:
    """Swift's own logger, so our lines read like its `[WARNING:swift]` ones."""
    try:
        from swift.utils import get_logger

        return get_logger()
    except ImportError:
        return logging.getLogger(__name__)


def _placeholder_file() -> str:
    """A one-row JSONL swift can load (same bytes from every rank; written atomically)."""
    path = Path(tempfile.gettempdir()) / "tokenmill-swift-placeholder.jsonl"
    if not path.is_file():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(PLACEHOLDER) + "\n")
        os.replace(tmp, path)
    return str(path)


def register() -> None:
    """Register the `tokenmill` dataset and make `sft`/`pt` build `SwiftFeedTrainer`.
    Idempotent; runs when swift imports this file as a plugin (see the end of this module)."""
    from swift.dataset import DatasetMeta, register_dataset
    from swift.trainers import TrainerFactory

    register_dataset(
        DatasetMeta(dataset_name=DATASET_NAME, dataset_path=_placeholder_file(),
                    help="tokenmill's feed: packed rows pulled from a running service"),
        exist_ok=True,
    )  # fmt: skip
    TrainerFactory.TRAINER_MAPPING["causal_lm"] = TRAINER_PATH


def check_template(template, per_device_batch: int) -> None:
    """Refuse the swift options that would be silently wrong on the feed; warn on the ignored."""
    sp = getattr(template, "sequence_parallel_size", 1) or 1
    if sp > 1:
        raise ValueError(
            f"tokenmill: --sequence_parallel_size {sp} is not supported: its ranks must see the "
            "same rows, while each rank's feed serves that rank's own; use 1 (data parallel)"
        )
    # 'default' (sft) and 'all' (pt's default) both mean "train where labels are set", which
    # here the service's labels decide; swift appends '+ignore_empty_think' by itself for
    # hybrid thinking models, which needs its own encoding and so does nothing here.
    loss_scale = str(getattr(template, "_loss_scale", None) or "default")
    if loss_scale.split("+")[0] not in ("default", "all"):
        raise ValueError(
            f"tokenmill: --loss_scale {loss_scale!r} cannot apply: the service's labels decide "
            "which tokens carry loss (its chat masking); drop --loss_scale"
        )
    if "+" in loss_scale:
        _log().warning("tokenmill: --loss_scale %r: only the service's labels apply", loss_scale)
    if getattr(template, "padding_free", False):
        _log().warning(
            "tokenmill: --packing/--padding_free are ignored: the service packs the rows"
        )
    if per_device_batch > 1:
        _log().warning(
            "tokenmill: --per_device_train_batch_size %d is ignored: a micro-batch is the "
            "service's global_batch_size / world_size rows", per_device_batch,
        )  # fmt: skip


def __getattr__(name: str):
    # Built on first use: importing this module must not import swift (or its trainer).
    if name == "SwiftFeedTrainer":
        return swift_feed_trainer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_CLASS: list = []


def swift_feed_trainer():
    """`SwiftFeedTrainer`: `feed_trainer(swift.trainers.Seq2SeqTrainer)` fed by this rank's
    feed, with swift's options checked and `--resume_only_model` resuming the feed."""
    if _CLASS:
        return _CLASS[0]
    from swift.trainers import Seq2SeqTrainer

    base = feed_trainer(Seq2SeqTrainer)

    class SwiftFeedTrainer(base):
        def __init__(self, *args, train_dataset=None, eval_dataset=None, **kwargs):
            targs, template = kwargs["args"], kwargs["template"]
            check_template(template, targs.per_device_train_batch_size)
            # Swift clears args.resume_from_checkpoint in __init__ under --resume_only_model
            # with --ignore_data_skip (it loaded the weights itself): keep it for the feed.
            only_model = bool(targs.resume_from_checkpoint and targs.resume_only_model)
            self._feed_checkpoint = targs.resume_from_checkpoint if only_model else None
            if eval_dataset is not None:
                _log().warning("tokenmill: no evaluation on the placeholder dataset (eval off)")
            feed = FeedDataset(service=os.environ.get(SERVICE_ENV, SERVICE_NAME),
                               timeout_s=float(os.environ.get(TIMEOUT_ENV, 60)))  # fmt: skip
            super().__init__(*args, train_dataset=feed, eval_dataset=None, **kwargs)
            self._max_length = getattr(template, "max_length", None)
            self._checked_length = False

        def train(self, resume_from_checkpoint=None, *args, **kwargs):
            if not resume_from_checkpoint and self._feed_checkpoint:
                _log().warning(
                    "tokenmill: --resume_only_model: the feed resumes from %s (the batch after "
                    "that checkpoint's); global_step restarts at 0", self._feed_checkpoint,
                )  # fmt: skip
                self.train_dataset.load_state_dict(load_feed_state(self._feed_checkpoint))
            return super().train(resume_from_checkpoint, *args, **kwargs)

        def training_step(self, model, inputs, *args, **kwargs):
            if not self._checked_length:
                self._checked_length = True
                width = inputs["input_ids"].shape[-1]  # [1, B*L] when flattened: not a row
                if self._max_length and not self.train_dataset.flatten and width > self._max_length:
                    _log().warning(
                        "tokenmill: rows of %d tokens exceed --max_length %d, which is ignored: "
                        "the service's seq_len sets the rows", width, self._max_length,
                    )  # fmt: skip
            return super().training_step(model, inputs, *args, **kwargs)

    SwiftFeedTrainer.__module__ = __name__
    _CLASS.append(SwiftFeedTrainer)
    return SwiftFeedTrainer


if __name__.startswith("_swift_external_"):  # imported by swift as --external_plugins
    register()
