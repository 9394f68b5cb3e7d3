"""torchtitan on tokenmill: a `BaseDataLoader` that pulls this data-parallel rank's packed rows.

    export TOKENMILL_SERVICE=tokenmill       # `tokenmill serve --name`; TOKENMILL_RAY_ADDRESS if not local
    PYTHONPATH=<checkout> torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module trainer.titan --config llama3_8b \\
        --training.local_batch_size 4 --training.seq_len 8192 --training.steps 1000 \\
        --hf_assets_path <dir with the tokenizer the service uses> --checkpoint.enable
    # resume exactly: the same command; torchtitan loads the latest step-N/ of --dump_folder

**How it plugs in.** torchtitan 0.3.0 builds its whole run from a config function:
`--module M --config FN` imports `M` (after trying `M.config_registry`) and calls `M.FN()`,
which returns a `Trainer.Config`. This module's functions (`llama3_debugmodel`, `llama3_8b`,
...) are torchtitan's own with `dataloader` replaced by `TokenmillDataLoader.Config`; wrap any
other with `tokenmill_config(cfg)` in a module of your own. CLI flags then override the
fields as usual: `--dataloader.service NAME --dataloader.address ADDR --dataloader.timeout-s S`.
The trainer builds the loader with `config.dataloader.build(dp_world_size=, dp_rank=,
tokenizer=, seq_len=, local_batch_size=, ...)`; the loader connects to the service as feed rank
`dp_rank` of `dp_world_size` when the first batch (or its state) is asked for.

**What a batch is.** `({"input": ids, "positions": pos}, labels)`, int64 `[B, L]` on CPU:
`input` is the row as served (all L tokens), `positions` restart at 0 at every document (and
are 0 on every pad token), and `labels` are shifted for torchtitan's loss, which compares
`logits[t]` with `labels[t]` (no shift of its own): `labels[t]` is the service's label of token
t+1, so -100 wherever the next token carries no loss (prompt, padding), at the end of every
document (the next document's first token never has a label) and at the last column. Only
`input` and `positions` reach the model: `Trainer.post_dataloading_process` builds the block
mask from `positions` (`positions == 0` starts a document: `get_attention_masks`) for a model
with flex or varlen attention, and passes `positions` on to RoPE.

**The document mask cannot be lost silently.** A feed batch without `position_ids` raises
(`titan_batch`); `tokenmill_config` refuses a model whose attention is not flex or varlen
(torchtitan builds no mask for those from `positions`, so documents would attend to each other).

**Exact resume.** The loader is a DCP `Stateful`: its state is one entry, `tokenmill_feed`,
the service's state after the last batch this rank took, as a JSON string (the same on every
rank; a string so that DCP's flattened keys never depend on the state's shape).
`load_state_dict` re-joins the service at that state, so the next batch is the one the
uninterrupted run had next. torchtitan checkpoints after whole optimizer steps, so with
gradient accumulation no micro-batch is half taken.

**One pull per data-parallel rank.** Each rank of the data-parallel mesh is one feed rank. With
tensor, context or pipeline parallelism its peers share a data-parallel rank and must see the
same rows; this loader does not share one pull among them and refuses (`ValueError` at build)
when the process group has more ranks than the data-parallel mesh. Use FSDP/HSDP (dp_shard,
dp_replicate) only.

**Sizes are the service's.** Each feed step is `global_batch_size / dp ranks` rows of `seq_len`
tokens; torchtitan's `training.local_batch_size` and `training.seq_len` must equal them (checked
on every batch). One feed step is one micro-batch: the service's `global_batch_size` is
torchtitan's `local_batch_size * dp ranks`, and torchtitan's `training.global_batch_size`
(default: the same) sets gradient accumulation over several feed steps.

Data wait: torchtitan logs `data_loading(s)` / `data_loading(%)` itself; the loader also reports
its seconds blocked in the feed to the service (its `/v1/metrics`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from trainer.adapters import FeedDataset
from wire.protocol import IGNORE_LABEL, SERVICE_NAME

SERVICE_ENV, ADDRESS_ENV, TIMEOUT_ENV = (
    "TOKENMILL_SERVICE",
    "TOKENMILL_RAY_ADDRESS",
    "TOKENMILL_TIMEOUT_S",
)
STATE_KEY = "tokenmill_feed"
REPORT_EVERY = 16  # batches between data-wait reports to the service (fire and forget)


def titan_batch(batch: dict, rows: int | None = None, seq_len: int | None = None):
    """A feed batch as torchtitan's `({"input", "positions"}, labels)`, labels shifted left by
    one (see the module's docstring). Refuses a batch without `position_ids`, and one whose
    shape is not `[rows, seq_len]` when those are given."""
    if "position_ids" not in batch:
        raise ValueError(
            "tokenmill: the batch has no position_ids: without them torchtitan builds no "
            "document mask and packed documents attend to each other; refusing it"
        )
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    if not ids.shape == labels.shape == pos.shape or ids.dim() != 2:
        raise ValueError(f"tokenmill: malformed batch: input_ids {tuple(ids.shape)}, labels "
                         f"{tuple(labels.shape)}, position_ids {tuple(pos.shape)}")  # fmt: skip
    want = (rows or ids.shape[0], seq_len or ids.shape[1])
    if tuple(ids.shape) != want:
        raise ValueError(
            f"tokenmill: the service's rows per rank and step are {tuple(ids.shape)} (rows, "
            f"seq_len), torchtitan asks for {want}: set training.local_batch_size to the "
            "service's global_batch_size / data-parallel ranks, and training.seq_len to its seq_len"
        )
    shifted = torch.full_like(labels, IGNORE_LABEL)
    shifted[:, :-1] = labels[:, 1:]
    return {"input": ids, "positions": pos}, shifted


class TokenmillDataLoader(BaseDataLoader):
    """This data-parallel rank's feed as torchtitan batches; a DCP `Stateful` (exact resume)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "tokenmill"
        service: str = field(default_factory=lambda: os.environ.get(SERVICE_ENV, SERVICE_NAME))
        """The service's name (`tokenmill serve --name`); env TOKENMILL_SERVICE."""
        address: str | None = field(default_factory=lambda: os.environ.get(ADDRESS_ENV) or None)
        """Its Ray cluster; default: the service's record on this machine, else RAY_ADDRESS."""
        timeout_s: float = field(default_factory=lambda: float(os.environ.get(TIMEOUT_ENV, 60)))
        """Bound on a wait for a step that nothing holds back."""

    def __init__(self, config: Config, *, dp_world_size: int = 1, dp_rank: int = 0,
                 tokenizer: Any = None, seq_len: int | None = None,
                 local_batch_size: int | None = None, **_: Any):  # fmt: skip
        _refuse_shared_dp_rank(dp_world_size)
        self.config, self.dp_rank, self.dp_world_size = config, dp_rank, dp_world_size
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dataset = FeedDataset(service=config.service, rank=dp_rank, world_size=dp_world_size,
                                   address=config.address, timeout_s=config.timeout_s)  # fmt: skip

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for n, batch in enumerate(self.dataset, 1):
            yield titan_batch(batch, self.local_batch_size, self.seq_len)
            if n % REPORT_EVERY == 0:
                self.dataset.take_wait()

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: json.dumps(self.dataset.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # torchtitan's convention: an empty state loads nothing
            return
        if STATE_KEY not in state_dict:
            raise KeyError(f"tokenmill: the checkpoint's dataloader state has no {STATE_KEY!r}: "
                           f"not written by TokenmillDataLoader ({sorted(state_dict)})")  # fmt: skip
        self.dataset.load_state_dict(json.loads(state_dict[STATE_KEY]))

    def close(self) -> None:
        self.dataset.close()


def _refuse_shared_dp_rank(dp_world_size: int) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return  # one process (tests, tools): no peers to share a rank with
    world = dist.get_world_size()
    if world != dp_world_size:
        raise ValueError(
            f"tokenmill: {world} ranks in the process group, {dp_world_size} in the "
            "data-parallel mesh: tensor, context "
            "or pipeline parallelism makes several ranks share a data-parallel rank, and the "
            "tokenmill loader does not share one pull among them (each would take that rank's "
            "steps from the service); use data parallelism (dp_shard/dp_replicate) only"
        )


def check_document_mask(config) -> None:
    """Refuse a `Trainer.Config` whose model would get no document mask from `positions`: only
    flex and varlen attention build one (`Decoder.get_attention_masks`)."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention
    from torchtitan.models.common.decoder import Decoder

    spec = config.model_spec
    model = getattr(spec, "model", None)
    attention = (
        getattr(model, "first_attention", None) if isinstance(model, Decoder.Config) else None
    )
    inner = getattr(attention, "inner_attention", None)
    if not isinstance(inner, FlexAttention.Config | VarlenAttention.Config):
        name = f"{spec.name}/{spec.flavor}" if spec is not None else "no model_spec"
        raise ValueError(
            f"tokenmill: {name} has {type(inner).__qualname__} attention, which builds no document "
            "mask from positions: packed documents would attend to each other. Use a model "
            "with flex or varlen attention (attn_backend='flex' or 'varlen')"
        )


def tokenmill_config(config, *, service: str | None = None, address: str | None = None,
                     timeout_s: float | None = None):  # fmt: skip
    """`config` (a torchtitan `Trainer.Config`) fed by tokenmill: its document mask checked, its
    `dataloader` a `TokenmillDataLoader.Config` (arguments left None: from the environment)."""
    check_document_mask(config)
    loader = TokenmillDataLoader.Config()
    loader.service = service or loader.service
    loader.address = address or loader.address
    loader.timeout_s = loader.timeout_s if timeout_s is None else timeout_s
    config.dataloader = loader
    return config


def _wrapped(name: str):
    def fn():
        from torchtitan.models.llama3 import config_registry

        return tokenmill_config(getattr(config_registry, name)())

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"torchtitan's `{name}` with tokenmill's loader (`--config {name}`)."
    return fn


# `--module trainer.titan --config <one of these>`: torchtitan's llama3 configs, our loader.
llama3_debugmodel = _wrapped("llama3_debugmodel")
llama3_debugmodel_varlen_attn = _wrapped("llama3_debugmodel_varlen_attn")
llama3_8b = _wrapped("llama3_8b")
llama3_70b = _wrapped("llama3_70b")
llama3_405b = _wrapped("llama3_405b")


def llama3_1b():
    """torchtitan's `llama3_8b` run with its Llama 3.2 1B model (flex attention), tokenmill's
    loader (`--config llama3_1b`; torchtitan 0.3.0 has the model flavor, no config function)."""
    from torchtitan.models.llama3 import config_registry, model_registry

    config = config_registry.llama3_8b()
    config.model_spec = model_registry("1B")
    config.hf_assets_path = "./assets/hf/Llama-3.2-1B"
    return tokenmill_config(config)
