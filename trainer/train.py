"""The thin DDP trainer: pull packed rows from the feed, train a small Llama, log, checkpoint.

    torchrun --nproc-per-node N -m trainer.train --service tokenmill --steps S \
        [--address ADDR] [--grad-accum K] [--lr LR] [--checkpoint DIR] [--resume] \
        [--keep-checkpoints] [--resume-step N] [--log-json PATH]

The only data code here is the feed client (trainer/feed.py). One optimizer step consumes
`grad_accum` micro-batches per rank. The loss is token-weighted: every labelled token of the
global step (all micro-batches, all ranks) counts once, so K micro-batches of B rows give the
same update as one batch of K*B rows whatever the number of real tokens per micro-batch. That
costs one tiny all_reduce of the token count before the backward passes; the count is needed
for tokens/s anyway. Without torchrun (no WORLD_SIZE in the environment) it runs as one
process without DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.feed import stream_loss
from trainer.model import IGNORE_INDEX, forward_packed, small_llama, token_losses
from wire.protocol import TENSOR_COLUMNS

TENSOR_KEYS = TENSOR_COLUMNS
CHECKPOINT_FILE = "checkpoint.pt"  # the newest; with --keep-checkpoints, each also by step


def kept_checkpoint(directory: Path, step: int) -> Path:
    """Where `--keep-checkpoints` keeps the checkpoint of `step` (`--resume-step`)."""
    return directory / f"checkpoint-{step}.pt"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(values: list[float], device: torch.device) -> list[float]:
    """Sum small scalars over ranks (identity without a process group)."""
    if _world()[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def train(
    model: torch.nn.Module,
    batches: Iterator[dict],
    steps: int,
    grad_accum: int,
    optimizer: torch.optim.Optimizer,
    log: Callable[[dict], None],
    report_wait: Callable[[float], None] | None = None,
    on_step: Callable[[int], None] | None = None,
    start_step: int = 0,
    report_loss: Callable[[int, dict], None] | None = None,
) -> dict:
    """Run optimizer steps `start_step + 1 .. steps` (fewer if `batches` ends); summarize.

    `log` gets one dict per step (every rank calls it; `main` prints on rank 0 only);
    `report_wait` gets the seconds this rank was blocked in `next(batches)`; `on_step` gets
    the step number after the optimizer step (checkpointing); `report_loss` gets each
    micro-batch's global step and its loss per stream (`trainer.feed.stream_loss`).
    """
    rank, world = _world()
    device = next(model.parameters()).device
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    model.train()
    losses, total_wait, total_time, total_tokens = [], 0.0, 0.0, 0.0
    first_wait = first_time = 0.0  # step 1 waits for the service to start: reported apart
    for step in range(start_step + 1, steps + 1):
        t0 = time.perf_counter()
        micro, wait = _micro_batches(batches, grad_accum)
        if len(micro) < grad_accum:  # every rank runs out at the same global step
            if rank == 0:
                print(f"the feed ended after step {step - 1}; dropped {len(micro)} micro-batches")
            break
        if step == start_step + 1 and rank == 0:
            rows = micro[0]["input_ids"].shape[0]
            print(
                f"global batch = {rows} x {world} x {grad_accum} = {rows * world * grad_accum} rows"
            )
        local = [int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro]
        (tokens,) = _all_reduce([float(sum(local))], device)
        # DDP averages gradients over ranks, so scale by world to get sum / global tokens.
        loss_sum = _backward(model, micro, device, amp, world / max(tokens, 1.0), report_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        (loss_sum,) = _all_reduce([loss_sum], device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - t0
        if report_wait is not None:
            report_wait(wait)
        loss = loss_sum / max(tokens, 1.0)
        losses.append(loss)
        if len(losses) == 1:
            first_wait, first_time = wait, step_time
        total_wait += wait
        total_time += step_time
        total_tokens += tokens
        log(
            {
                "step": step,
                "step_time_s": round(step_time, 6),
                "data_wait_s": round(wait, 6),
                "tokens_per_s": round(tokens / step_time, 1),
                "loss": round(loss, 6),
            }
        )
        if on_step is not None:
            on_step(step)
    return {
        "steps": len(losses),
        "last_step": start_step + len(losses),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        # Steady state: every step after the first (whose wait includes the service start-up).
        "data_wait_fraction": (total_wait - first_wait) / (total_time - first_time)
        if total_time > first_time
        else 0.0,
        "data_wait_fraction_all_steps": total_wait / total_time if total_time else 0.0,
        "first_step_wait_s": first_wait,
        "tokens_per_s": total_tokens / total_time if total_time else 0.0,
    }


def _micro_batches(batches: Iterator[dict], grad_accum: int) -> tuple[list[dict], float]:
    """A step's `grad_accum` micro-batches (fewer where `batches` ends), and the seconds this
    rank waited for them."""
    micro, wait = [], 0.0
    for _ in range(grad_accum):
        t = time.perf_counter()
        batch = next(batches, None)
        wait += time.perf_counter() - t
        if batch is None:
            break
        micro.append(batch)
    return micro, wait


def _backward(model: torch.nn.Module, micro: list[dict], device: torch.device, amp,
              scale: float, report_loss: Callable[[int, dict], None] | None) -> float:  # fmt: skip
    """Forward and backward over a step's micro-batches, each loss summed over its tokens and
    times `scale` (the world over the step's global tokens), gradients synced over ranks on
    the last only; reports each micro-batch's loss per stream. Returns the summed loss."""
    loss_sum = 0.0
    for i, batch in enumerate(micro):
        b = {k: batch[k].to(device, non_blocking=True) for k in TENSOR_KEYS}
        last = i == len(micro) - 1
        sync = nullcontext() if last or not isinstance(model, DDP) else model.no_sync()
        with sync:
            with amp:
                logits = forward_packed(model, b["input_ids"], b["position_ids"],
                                        b["segment_ids"], batch.get("seq_lens"))  # fmt: skip
                per_token = token_losses(logits, b["labels"])
                count = int((b["labels"][:, 1:] != IGNORE_INDEX).sum())
                mean = per_token.sum() / max(count, 1)
            (mean * count * scale).backward()
        if report_loss is not None and "stream" in batch:
            report_loss(batch["global_step"], stream_loss({**batch, **b}, per_token))
        loss_sum += float(mean.detach()) * count
    return loss_sum


def save_checkpoint(path: Path, model, optimizer, feed_state: dict, step: int) -> None:
    """Model, optimizer and feed state in one file, written atomically (tmp + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": getattr(model, "module", model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "feed": json.dumps(feed_state),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, optimizer) -> tuple[int, dict]:
    """Restore model and optimizer in place; return (step, feed_state)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    getattr(model, "module", model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    feed = json.loads(state["feed"])
    if not isinstance(feed, dict):  # `null` would silently restart the data at step 0
        raise ValueError(f"{path}: its feed state is {type(feed).__name__}, not a state object")
    return state["step"], feed


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trainer.train", description=__doc__.splitlines()[0])
    p.add_argument("--service", default="tokenmill", help="name of the tokenmill service")
    p.add_argument("--address", default=None, help="Ray address (default: auto)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps in total")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--vocab-size", type=int, default=100_277, help="tokenizer vocab size")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint directory")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between saves")
    p.add_argument("--resume", action="store_true", help="resume from --checkpoint")
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep every save as DIR/checkpoint-STEP.pt too (a hard link)",
    )
    p.add_argument(
        "--resume-step",
        type=int,
        default=None,
        help="resume from the kept DIR/checkpoint-STEP.pt, not the newest",
    )
    p.add_argument("--log-json", type=Path, default=None, help="append one JSON line per step")
    args = p.parse_args(argv)
    if args.resume_step is not None:
        args.resume = True
    if args.resume and args.checkpoint is None:
        p.error("--resume and --resume-step need --checkpoint DIR")
    if args.steps < 1 or args.grad_accum < 1:
        p.error(f"--steps and --grad-accum must be >= 1, got {args.steps}, {args.grad_accum}")
    return args


def _join_world() -> tuple[bool, int, torch.device]:
    """Under torchrun (WORLD_SIZE set): the process group joined (NCCL on CUDA, else gloo).
    Whether distributed, the local rank, and the device this process trains on."""
    distributed = "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    return distributed, local_rank, device


def main(argv: list[str] | None = None) -> dict:
    args = _arguments(argv)
    from trainer.feed import Feed

    distributed, local_rank, device = _join_world()
    cuda = device.type == "cuda"
    rank, world = _world()

    torch.manual_seed(args.seed)
    model = small_llama(vocab_size=args.vocab_size, hidden=args.hidden, layers=args.layers)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt = args.checkpoint / CHECKPOINT_FILE if args.checkpoint else None
    start_step, feed_state = 0, None
    if args.resume:
        assert args.checkpoint is not None and ckpt is not None
        source = (
            ckpt if args.resume_step is None else kept_checkpoint(args.checkpoint, args.resume_step)
        )
        start_step, feed_state = load_checkpoint(source, model, optimizer)
        if rank == 0:
            print(f"resumed from {source} at step {start_step}")
    ddp = DDP(model, device_ids=[local_rank] if cuda else None) if distributed else model
    feed = Feed.connect(
        service=args.service, rank=rank, world_size=world, address=args.address, state=feed_state
    )

    def log(record: dict) -> None:
        if rank != 0:
            return
        print(" ".join(f"{k}={v}" for k, v in record.items()), flush=True)
        if args.log_json:
            with open(args.log_json, "a") as f:
                f.write(json.dumps(record) + "\n")

    saved = [start_step]

    def save(step: int) -> None:
        assert ckpt is not None
        save_checkpoint(ckpt, model, optimizer, feed.state_dict(), step)
        saved[0] = step
        if args.keep_checkpoints:
            kept = kept_checkpoint(ckpt.parent, step)
            kept.unlink(missing_ok=True)  # a run resumed before it saves that step again
            os.link(ckpt, kept)

    def on_step(step: int) -> None:
        # Every rank has consumed the same global steps, so rank 0's feed state is the run's.
        if ckpt and rank == 0 and step % args.checkpoint_every == 0:
            save(step)

    try:
        summary = train(
            ddp,
            iter(feed),
            args.steps,
            args.grad_accum,
            optimizer,
            log,
            report_wait=feed.report_wait,
            on_step=on_step,
            start_step=start_step,
            report_loss=feed.report_loss,
        )
        if ckpt and rank == 0 and summary["last_step"] > saved[0]:  # the final state
            save(summary["last_step"])
    finally:
        feed.close()
        if distributed:
            dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"summary": summary}))
    return summary


if __name__ == "__main__":
    main()
