"""tokenmill's feed in other trainers: a torch IterableDataset, HF Trainer, Ray Train.

    ds = FeedDataset(service="tokenmill", rank=r, world_size=w)
    for batch in DataLoader(ds, batch_size=None):   # {input_ids, labels, position_ids}
        loss = model(**batch).loss                    # an HF causal LM, prepare_packed(model) first
    ckpt["feed"] = ds.state_dict(); ...; ds.load_state_dict(ckpt["feed"])   # exact resume

**What a batch holds, and why no `attention_mask`.** A served row packs several documents;
`position_ids` restart at 0 on each. In transformers 4.57 an HF Llama (and every model built on
`masking_utils.create_causal_mask`) finds the documents itself from `position_ids`
(`find_packed_sequence_indices`: a new sequence wherever a position does not follow its
predecessor by 1) and ands that with the causal mask, for `eager` and `sdpa` alike, but only
when **no 2D `attention_mask` is given and no KV cache exists** (`_preprocess_mask_arguments`).
So the dataset yields exactly `input_ids`, `labels` and `position_ids`: a 2D padding mask would
switch the detection off and let every document attend to the ones before it in its row. The
cache is the other trap: `LlamaConfig(use_cache=True)` is the default, and `LlamaModel.forward`
then builds a `DynamicCache` even in training, which also switches the detection off;
`prepare_packed(model)` sets `config.use_cache = False`. Measured on a tiny Llama (CPU, fp32,
tests/test_adapters.py, 112 labelled tokens in two rows): packed minus separate documents is
7e-5 nats summed (largest logit gap 1.8e-7) with `use_cache=False` and `position_ids` only,
and 0.60 nats (logit gap 0.60) with the default or with a 2D mask (docs/trainers.md).

`flash_attention_2` reads packing from `position_ids` only for a batch of one row
(`_is_packed_sequence`), so for it the dataset flattens [B, L] into [1, B*L] (`flatten=True`;
`prepare_packed` returns True when that is needed). Rows join cleanly: each starts at position
0 and its first label is -100. Padding has position 0 everywhere, so each pad token is a
sequence of one: it attends only to itself and carries no label.

**Exact resume.** The DataLoader must run in-process (`num_workers=0`, the default): the feed
counts the batches it handed out, and `state_dict()` is the service's state after the last of
them, the same on every rank. Store it with the model; `load_state_dict` before (or during)
iteration re-joins the service at that step (the service seeks), so the next batch is the one
the uninterrupted run would have had next.

`FeedTrainer` runs HF `transformers.Trainer` on it and `ray_train_dataset` / `ray_train_report`
do the same inside a Ray Train `TorchTrainer` worker; docs/trainers.md has the recipes.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

from trainer.feed import Feed
from wire.protocol import SERVICE_NAME

HF_KEYS = ("input_ids", "labels", "position_ids")
FEED_STATE_FILE = "tokenmill_feed.json"


def prepare_packed(model) -> bool:
    """Configure an HF causal LM for packed rows; True if rows must be flattened to [1, B*L].

    Sets `config.use_cache = False` (see the module docstring: with a cache HF ignores the
    document boundaries in `position_ids`). Raises for an attention implementation whose
    packed behaviour was not checked.
    """
    config = getattr(model, "module", model).config
    config.use_cache = False
    impl = config._attn_implementation
    if impl in ("eager", "sdpa"):
        return False
    if impl == "flash_attention_2":
        return True
    raise ValueError(
        f"prepare_packed: attn_implementation {impl!r} is not checked for packed rows; "
        "use 'sdpa', 'eager' or 'flash_attention_2'"
    )


# The key under which a FeedDataset's batch carries its segments' streams and global step to
# FeedTrainer.compute_loss (popped there, never passed to the model).
LOSS_META = "tokenmill_meta"


def hf_batch(batch: dict, flatten: bool = False) -> dict:
    """The keys an HF causal LM's forward takes, from a `Feed` batch ([1, B*L] if `flatten`)."""
    out = {k: batch[k] for k in HF_KEYS}
    if flatten:
        out = {k: v.reshape(1, -1) for k, v in out.items()}
    return out


class FeedDataset(IterableDataset):
    """One rank's feed as an IterableDataset of ready batches: `DataLoader(ds, batch_size=None)`.

    Give it a connected `feed`, or the arguments of `Feed.connect` (it connects on first use,
    so it can be built before the rank and world are known; `FeedTrainer` fills them in).
    `wait_s` accumulates the seconds blocked in `next(feed)`; `take_wait()` hands them over and
    reports them to the service (its data-wait telemetry).
    """

    def __init__(self, feed: Feed | None = None, *, service: str = SERVICE_NAME, rank: int = 0,
                 world_size: int = 1, address: str | None = None, state: dict | None = None,
                 timeout_s: float = 60.0, flatten: bool = False,
                 stream_loss: bool = False):  # fmt: skip
        super().__init__()
        self.stream_loss = stream_loss  # carry LOSS_META for FeedTrainer's per-stream loss
        self.feed, self.service, self.address = feed, service, address
        self.rank, self.world_size = (feed.rank, feed.world_size) if feed else (rank, world_size)
        self.timeout_s, self.flatten = timeout_s, flatten
        self._state = state  # applied when it connects
        self.wait_s = 0.0
        self.batches = 0  # micro-batches yielded by this process
        self.rows = 0  # and their rows (this rank's G/W rows of each global step)

    def _connect(self) -> Feed:
        if self.feed is None:
            self.feed = Feed.connect(service=self.service, rank=self.rank,
                                     world_size=self.world_size, address=self.address,
                                     state=self._state, timeout_s=self.timeout_s)  # fmt: skip
            self._state = None
        return self.feed

    def __iter__(self):
        feed = self._connect()
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(feed)
            except StopIteration:
                return
            self.wait_s += time.perf_counter() - t0
            self.batches += 1
            self.rows += len(batch["seq_lens"])
            out = hf_batch(batch, self.flatten)
            if self.stream_loss:
                out[LOSS_META] = {"stream": batch["stream"], "seq_lens": batch["seq_lens"],
                                  "global_step": batch["global_step"]}  # fmt: skip
            yield out

    def take_wait(self) -> float:
        """Seconds blocked in the feed since the last call (also reported to the service)."""
        wait, self.wait_s = self.wait_s, 0.0
        if self.feed is not None and wait:
            self.feed.report_wait(wait)
        return wait

    def state_dict(self) -> dict:
        """The service's state after the last batch this dataset yielded (JSON-serialisable)."""
        if self.feed is None and self._state is not None:
            return self._state
        return self._connect().state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`: the next batch is the one that followed it."""
        if self.feed is None:
            self._state = state
            return
        # Re-join as the same rank with the state: the service seeks, the client restarts there.
        self.feed.rejoin(state)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()


def save_feed_state(directory: str | os.PathLike, state: dict) -> Path:
    """Write `state` as DIR/tokenmill_feed.json, atomically."""
    path = Path(directory) / FEED_STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
    return path


def load_feed_state(directory: str | os.PathLike) -> dict:
    path = Path(directory) / FEED_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: the checkpoint has no tokenmill feed state, so the run cannot resume at the "
            "same batch; it was not written by FeedTrainer / ray_train_report"
        )
    return json.loads(path.read_text())


# -- Hugging Face transformers.Trainer -------------------------------------------------------


def _hf():
    from transformers import Trainer, TrainerCallback

    return Trainer, TrainerCallback


def feed_checkpoint_callback(dataset: FeedDataset):
    """A `TrainerCallback` that writes the feed state into every `checkpoint-N/` (rank 0),
    and asks for a last checkpoint when the feed ends (the data's end, or `tokenmill stop`,
    which drains): HF's epoch is the whole feed, so its end is the feed's, and a run that was
    stopped keeps its last step to resume from (with a save strategy; "no" stays no)."""
    _, TrainerCallback = _hf()

    class FeedCheckpointCallback(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            feed = dataset.feed
            saves = str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"
            if saves and feed is not None and feed.ended and state.global_step > 0:
                control.should_save = True

        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                save_feed_state(directory, dataset.state_dict())

    return FeedCheckpointCallback()


def __getattr__(name: str):
    # FeedTrainer subclasses transformers.Trainer; built on first use so that importing this
    # module (in a Ray Train worker, a plain loop) does not import the Trainer.
    if name == "FeedTrainer":
        return feed_trainer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_FEED_TRAINERS: dict = {}


def feed_trainer(base=None):
    """`FeedTrainer` over `base`, a `transformers.Trainer` subclass (TRL's `SFTTrainer`...);
    over `Trainer` itself when None. The class is built once per base."""
    if base is None:
        base, _ = _hf()
    if base not in _FEED_TRAINERS:
        _FEED_TRAINERS[base] = _make_feed_trainer(base)
    return _FEED_TRAINERS[base]


def _make_feed_trainer(Trainer):
    class FeedTrainer(Trainer):
        """`transformers.Trainer` fed by a `FeedDataset` (`train_dataset=`), resumable exactly.

        - The train DataLoader is `DataLoader(ds, batch_size=None)`, in-process, and is not
          passed through `accelerator.prepare`: for an IterableDataset accelerate would either
          read on rank 0 and dispatch slices (`dispatch_batches`) or have every rank read all
          batches and keep every n-th (`IterableDatasetShard`), while each rank's feed already
          serves that rank's rows. `per_device_train_batch_size` is ignored: the service's
          `global_batch_size / world_size` is the batch. Inputs still reach the device through
          `_prepare_inputs`.
        - The rank and world come from `TrainingArguments` (`process_index`, `world_size`).
        - `max_steps` must be set (the feed has no length). `ignore_data_skip` is forced on: on
          resume HF would otherwise pull and discard the batches already trained on, whereas the
          feed restarts at the checkpoint's batch by itself.
        - `prepare_packed(model)`: `use_cache=False`, and flattened rows for flash-attention-2.
        - Every checkpoint gets `tokenmill_feed.json`; `train(resume_from_checkpoint=...)`
          (a path, or True for the last one) reads it before the first batch is pulled.
        - Every log record gets `data_wait_s` (seconds blocked in the feed since the previous
          record) and `data_wait_fraction` (of the wall time since then).
        - With `FeedDataset(stream_loss=True)`, each micro-batch's loss per stream goes to the
          service (`/v1/metrics` `stream_loss`, the page, the mixing policy), computed from the
          logits HF already has (one extra cross entropy without grad).
        """

        def __init__(self, *args, train_dataset: FeedDataset, **kwargs):
            if not isinstance(train_dataset, FeedDataset):
                raise TypeError(
                    f"FeedTrainer: train_dataset must be a FeedDataset, got {type(train_dataset)}"
                )
            if self._wants_hf_dataset:
                # TRL's trainers accept only a `datasets` Dataset and read a sample of it at
                # construction (which would consume a feed step): give them one placeholder row.
                from datasets import Dataset

                placeholder = Dataset.from_dict({"input_ids": [[0, 0]], "labels": [[-100, -100]]})
                super().__init__(*args, train_dataset=placeholder, **kwargs)
                self.train_dataset = train_dataset
            else:
                super().__init__(*args, train_dataset=train_dataset, **kwargs)
            if self.args.max_steps <= 0:
                raise ValueError(
                    f"FeedTrainer: set TrainingArguments(max_steps=N > 0), got {self.args.max_steps}"
                    " (the feed has no length)"
                )
            self.args.ignore_data_skip = True
            if train_dataset.feed is None:
                train_dataset.rank = self.args.process_index
                train_dataset.world_size = self.args.world_size
            if prepare_packed(self.model):
                train_dataset.flatten = True
            self.add_callback(feed_checkpoint_callback(train_dataset))
            self._wait_clock = None

        def compute_loss(self, model, inputs, *args, **kwargs):
            meta = inputs.pop(LOSS_META, None)
            feed = self.train_dataset.feed
            if meta is None or feed is None:
                return super().compute_loss(model, inputs, *args, **kwargs)
            want = kwargs.pop("return_outputs", args[0] if args else False)
            if len(args) > 1:
                kwargs.setdefault("num_items_in_batch", args[1])
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
            logits = getattr(outputs, "logits", None)
            if logits is None and isinstance(outputs, dict):
                logits = outputs.get("logits")
            if logits is not None:
                feed.report_loss(meta["global_step"], _stream_loss(inputs["labels"], logits, meta))
            return (loss, outputs) if want else loss

        def get_train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_dataset, batch_size=None, num_workers=0)

        def train(self, resume_from_checkpoint=None, *args, **kwargs):
            if resume_from_checkpoint is True:
                from transformers.trainer_utils import get_last_checkpoint

                resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
                if resume_from_checkpoint is None:
                    raise ValueError(f"no checkpoint in {self.args.output_dir} to resume from")
            if resume_from_checkpoint:
                self.train_dataset.load_state_dict(load_feed_state(resume_from_checkpoint))
            self._wait_clock = time.perf_counter()
            self.train_dataset.take_wait()
            return super().train(resume_from_checkpoint, *args, **kwargs)

        def _load_optimizer_and_scheduler(self, checkpoint):
            if not _load_optimizer_on_cpu(self, checkpoint):
                super()._load_optimizer_and_scheduler(checkpoint)

        def log(self, logs: dict, *args, **kwargs) -> None:
            if logs.get("train_runtime"):
                logs.update(_trained_speeds(self, logs["train_runtime"]))
            now = time.perf_counter()
            wait = self.train_dataset.take_wait()
            span = now - (self._wait_clock or now)
            self._wait_clock = now
            logs = {**logs, "data_wait_s": round(wait, 6)}
            if span > 0:
                logs["data_wait_fraction"] = round(min(wait / span, 1.0), 6)
            super().log(logs, *args, **kwargs)

    FeedTrainer._wants_hf_dataset = Trainer.__module__.split(".")[0] == "trl"
    FeedTrainer.__module__ = __name__
    if Trainer.__name__ != "Trainer":
        FeedTrainer.__name__ = FeedTrainer.__qualname__ = f"Feed{Trainer.__name__}"
    return FeedTrainer


def _load_optimizer_on_cpu(trainer, checkpoint) -> bool:
    """On CPU with several ranks (gloo), HF loads `optimizer.pt` with `map_location=args.device`,
    `cpu:N`, which torch cannot restore ("don't know how to restore data location ... (tagged
    with cpu:0)", transformers 4.57): there the optimizer is loaded onto the CPU, as HF does for
    one rank, and this says True. Elsewhere (GPUs, DeepSpeed, FSDP, one rank) False: HF's own
    path runs unchanged."""
    import os

    import torch

    device = trainer.args.device
    plain = not (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled)
    if checkpoint is None or device.type != "cpu" or trainer.args.world_size <= 1 or not plain:
        return False
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

    optimizer = os.path.join(checkpoint, OPTIMIZER_NAME)
    scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
    if not (os.path.isfile(optimizer) and os.path.isfile(scheduler)):
        return False
    trainer.optimizer.load_state_dict(torch.load(optimizer, map_location="cpu", weights_only=True))
    trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
    return True


def _trained_speeds(trainer, runtime: float) -> dict:
    """HF's end-of-training speeds assume `max_steps` steps of `per_device_train_batch_size`
    rows: with a feed, a run may end before max_steps (the data's end, a stop) and a rank's rows
    are the service's G/W. What this process trained on instead (HF's `train()` returns the
    same dict as its metrics)."""
    ds = trainer.train_dataset
    steps = ds.batches // max(1, trainer.args.gradient_accumulation_steps)
    return {"train_steps_per_second": round(steps / runtime, 3),
            "train_samples_per_second": round(ds.rows * trainer.args.world_size / runtime, 3)}  # fmt: skip


def _stream_loss(labels, logits, meta: dict) -> dict:
    """Per stream [loss sum, tokens] of a micro-batch, from HF's logits (flattened [1, B*L]
    rows as flash-attention takes them are cut back into B rows of L)."""
    import torch

    from trainer.feed import stream_loss
    from trainer.model import token_losses

    with torch.no_grad():
        per_token = torch.nn.functional.pad(token_losses(logits, labels), (1, 0))
    rows = len(meta["seq_lens"])
    L = labels.numel() // rows
    view = {"labels": labels.reshape(rows, L), "stream": meta["stream"],
            "seq_lens": meta["seq_lens"]}  # fmt: skip
    return stream_loss(view, per_token.reshape(rows, L))


# -- Ray Train (TorchTrainer) -----------------------------------------------------------------


def cpus_per_worker(num_workers: int, cluster_cpus: float, data_cpus: float) -> float:
    """CPUs each Ray Train worker may request and still leave `data_cpus` to Ray Data.

    Train workers hold their CPUs for the whole run; the service's read/tokenize tasks run in
    what is left. With C cluster CPUs, W workers and D CPUs kept for tokenizing, each worker
    asks for (C - D) / W, at most 1 (a worker that only runs the model on a GPU needs one
    core for the Python loop and the host-to-device copies). Example: 16 CPUs, 4 GPU workers,
    12 kept for tokenizing: 1 each; on a 2-CPU box with 1 kept: 1 worker of 1 CPU, or 2 of 0.5.
    """
    spare = cluster_cpus - data_cpus
    if num_workers < 1 or spare <= 0:
        raise ValueError(
            f"cpus_per_worker: {cluster_cpus} CPUs leave nothing for {num_workers} workers after "
            f"keeping {data_cpus} for tokenizing; lower data_cpus or add CPUs"
        )
    return min(1.0, spare / num_workers)


def ray_train_dataset(service: str = SERVICE_NAME, **kwargs) -> FeedDataset:
    """Inside a Ray Train worker: this rank's FeedDataset, resumed from `ray.train.get_checkpoint()`.

    The rank and world come from `ray.train.get_context()`; `kwargs` go to `FeedDataset`.
    """
    import ray.train

    ctx = ray.train.get_context()
    ds = FeedDataset(service=service, rank=ctx.get_world_rank(),
                     world_size=ctx.get_world_size(), **kwargs)  # fmt: skip
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            ds.load_state_dict(load_feed_state(d))
    return ds


def ray_train_report(metrics: dict, dataset: FeedDataset, checkpoint: bool = True,
                     save=None) -> None:  # fmt: skip
    """`ray.train.report`, with a checkpoint holding the feed state and what `save(dir)` writes.

    Every worker must call it at the same step. With `checkpoint`, rank 0 writes the checkpoint
    (the feed state is the same on every rank; with DDP rank 0's model is the run's). Adds
    `data_wait_s`, the seconds this worker was blocked in the feed since the last report.
    """
    import ray.train

    metrics = {**metrics, "data_wait_s": dataset.take_wait()}
    if not checkpoint or ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as d:
        save_feed_state(d, dataset.state_dict())
        if save is not None:
            save(d)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def load_torch_checkpoint(model, optimizer=None, name: str = "model.pt") -> int:
    """In a Ray Train worker: restore `model` (and `optimizer`) from the run's checkpoint, if
    any, as written by `torch_saver`; return the step it was taken at (0 without one)."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as d:
        state = torch.load(Path(d) / name, map_location="cpu", weights_only=True)
    getattr(model, "module", model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def torch_saver(model, optimizer, step: int, name: str = "model.pt"):
    """A `save(dir)` for `ray_train_report`: model, optimizer and step in DIR/model.pt."""

    def save(directory: str) -> None:
        state = {"model": getattr(model, "module", model).state_dict(), "step": step,
                 "optimizer": optimizer.state_dict()}  # fmt: skip
        torch.save(state, Path(directory) / name)

    return save
