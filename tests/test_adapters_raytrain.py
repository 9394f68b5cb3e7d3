"""Ray Train's TorchTrainer on a live tokenmill service: training, and exact resume from a
Ray Train checkpoint holding the feed state."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from tests.test_adapters import TOKENIZER_VOCAB, make_service  # noqa: F401, F811 (fixture)
from trainer.adapters import FeedDataset, cpus_per_worker, prepare_packed

STEPS = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread(torch_one_thread):
    """Tiny models: one intra-op thread (conftest's `torch_one_thread`)."""


def model_and_optimizer():
    from trainer.model import small_llama

    torch.manual_seed(0)
    model = small_llama(vocab_size=TOKENIZER_VOCAB, hidden=64, layers=2, seq_len=64,
                        attn_implementation="sdpa")  # fmt: skip
    prepare_packed(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def steps(model, optimizer, batches, first: int, last: int):
    """Train steps first..last; yield (step, batch, loss) after each."""
    # `range` first and not strict: zip stops before it pulls a batch past `last`.
    for step, batch in zip(range(first, last + 1), batches, strict=False):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield step, batch, float(loss.detach())


def train_loop_per_worker(config: dict) -> None:
    """The recipe of docs/trainers.md: this rank's feed, resumed from the run's checkpoint."""
    import ray.train

    from trainer.adapters import (
        load_torch_checkpoint,
        ray_train_dataset,
        ray_train_report,
        torch_saver,
    )

    torch.set_num_threads(1)
    model, optimizer = model_and_optimizer()
    start = load_torch_checkpoint(model, optimizer)  # 0 on a fresh run
    ds = ray_train_dataset(config["service"])
    seen = []
    for step, batch, loss in steps(model, optimizer, DataLoader(ds, batch_size=None),
                                   start + 1, config["steps"]):  # fmt: skip
        seen.append((step, batch["input_ids"], loss))
        every = step % config["checkpoint_every"] == 0
        ray_train_report({"step": step, "loss": loss}, ds, checkpoint=every,
                         save=torch_saver(model, optimizer, step) if every else None)  # fmt: skip
    if ray.train.get_context().get_world_rank() == 0:
        torch.save(seen, config["record"])


def fit(service, tmp_path, name, last):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # The session cluster has 2 CPUs; keep 1 for the service's read/tokenize tasks.
    cpus = cpus_per_worker(num_workers=1, cluster_cpus=2, data_cpus=1)
    record = tmp_path / f"{name}-{last}.pt"
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"service": service, "steps": last, "checkpoint_every": 2,
                           "record": str(record)},
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": cpus}),
        run_config=RunConfig(name=name, storage_path=str(tmp_path / "ray_results")),
    )  # fmt: skip
    result = trainer.fit()
    return result, torch.load(record, weights_only=True)


def test_cpus_per_worker_leaves_cpus_to_tokenizing():
    assert cpus_per_worker(4, cluster_cpus=16, data_cpus=12) == 1.0
    assert cpus_per_worker(2, cluster_cpus=2, data_cpus=1) == 0.5
    with pytest.raises(ValueError, match="leave nothing"):
        cpus_per_worker(2, cluster_cpus=4, data_cpus=4)


@pytest.mark.slow
def test_ray_train_resumes_with_the_same_batches(make_service, tmp_path):  # noqa: F811
    # The uninterrupted run, in this process, on a service of its own.
    model, optimizer = model_and_optimizer()
    ds = FeedDataset(service=make_service("rt-straight"))
    straight = list(steps(model, optimizer, DataLoader(ds, batch_size=None), 1, STEPS))

    service = make_service("rt-resumed")
    first, first_seen = fit(service, tmp_path, "run", last=3)  # checkpoints at step 2 only
    assert [s for s, _, _ in first_seen] == [1, 2, 3]
    # A result's metrics are those reported with its latest checkpoint.
    assert first.metrics["step"] == 2 and "data_wait_s" in first.metrics
    # Ray Train 2 resumes a run launched again under the same name and storage path from its
    # latest checkpoint (`ray.train.get_checkpoint()` in the workers).
    second, second_seen = fit(service, tmp_path, "run", last=STEPS)
    assert [s for s, _, _ in second_seen] == [3, 4] and second.metrics["step"] == STEPS

    for (step, ids, loss), (want_step, want, want_loss) in zip(
        first_seen[:2] + second_seen, straight, strict=True
    ):
        assert step == want_step and torch.equal(ids, want["input_ids"]), step
        assert loss == pytest.approx(want_loss, rel=1e-4), step
