"""FeedDataset and HF Trainer on tokenmill: packed attention in HF's own Llama, live-service
training, and exact resume from an HF checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.read.resolve import parse_config
from service.serve import start_server
from tests.conftest import stdlib_texts, write_jsonl
from trainer.adapters import FEED_STATE_FILE, HF_KEYS, FeedDataset, hf_batch, prepare_packed

VOCAB, LENGTH = 512, 64
TOKENIZER_VOCAB = 100_277  # the default (cl100k_base) tokenizer of the live service


@pytest.fixture(autouse=True, scope="module")
def _one_thread(torch_one_thread):
    """Tiny models: one intra-op thread (conftest's `torch_one_thread`)."""


def tiny_llama(vocab: int = VOCAB, impl: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    """HF's own LlamaForCausalLM from a config (hidden 64, 2 layers), with HF's defaults
    otherwise (`use_cache=True`), built locally."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=LENGTH, attn_implementation=impl)  # fmt: skip
    return LlamaForCausalLM(config)


def packed_rows():
    """Two rows of LENGTH packing documents of 20+30+10 and 40+17 tokens (padding after),
    in the served layout; and the documents."""
    g = torch.Generator().manual_seed(7)
    docs = [[torch.randint(1, VOCAB, (n,), generator=g) for n in lens] for lens in ([20, 30, 10], [40, 17])]  # fmt: skip
    batch = {"input_ids": torch.zeros(2, LENGTH, dtype=torch.long),
             "labels": torch.full((2, LENGTH), -100), "position_ids": torch.zeros(2, LENGTH, dtype=torch.long),
             "segment_ids": torch.zeros(2, LENGTH, dtype=torch.long), "seq_lens": [], "global_step": 0}  # fmt: skip
    for r, row in enumerate(docs):
        start = 0
        for k, d in enumerate(row, start=1):
            n = len(d)
            batch["input_ids"][r, start : start + n] = d
            batch["labels"][r, start + 1 : start + n] = d[1:]
            batch["position_ids"][r, start : start + n] = torch.arange(n)
            batch["segment_ids"][r, start : start + n] = k
            start += n
        batch["seq_lens"].append([len(d) for d in row])
    return batch, docs


def packed_vs_unpacked(model, batch, docs, flatten=False):
    """(packed loss - unpacked loss) summed over the labelled tokens, and the largest logit
    difference of any document between its packed and its separate forward."""
    inputs = hf_batch(batch, flatten)
    assert set(inputs) == set(HF_KEYS)
    with torch.no_grad():
        out = model(**inputs)
        count = int((batch["labels"][:, 1:] != -100).sum())
        logits = out.logits.reshape(2, LENGTH, -1)
        unpacked, worst = 0.0, 0.0
        for r, row in enumerate(docs):
            start = 0
            for d in row:
                alone = model(input_ids=d[None]).logits[0]
                unpacked += float(F.cross_entropy(alone[:-1], d[1:], reduction="sum"))
                part = logits[r, start : start + len(d)]
                worst = max(worst, float((part - alone).abs().max()))
                start += len(d)
    return float(out.loss) * count - unpacked, worst


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked_in_hf_llama(impl):
    batch, docs = packed_rows()
    model = tiny_llama(impl=impl).eval()
    # HF's default config (use_cache=True) attends across the documents of a row.
    loss_gap, logit_gap = packed_vs_unpacked(model, batch, docs)
    assert abs(loss_gap) > 0.1 and logit_gap > 0.1, (loss_gap, logit_gap)

    assert prepare_packed(model) is False and model.config.use_cache is False
    for flatten in (False, True):
        loss_gap, logit_gap = packed_vs_unpacked(model, batch, docs, flatten)
        assert abs(loss_gap) < 1e-3 and logit_gap < 1e-4, (flatten, loss_gap, logit_gap)

    # A 2D padding mask switches HF's boundary detection off again: why FeedDataset gives none.
    with torch.no_grad():
        inputs = hf_batch(batch)
        plain = model(**inputs).loss
        masked = model(**inputs, attention_mask=(batch["segment_ids"] != 0).long()).loss
    assert abs(float(masked - plain)) > 1e-3


def test_prepare_packed_flattens_for_flash_attention_only():
    model = tiny_llama()
    model.config._attn_implementation = "flash_attention_2"
    assert prepare_packed(model) is True
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="flex_attention"):
        prepare_packed(model)


def test_feed_trainer_refuses_what_would_break_exact_resume(tmp_path):
    from transformers import TrainingArguments

    from trainer.adapters import FeedTrainer, load_feed_state

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])  # no max_steps
    with pytest.raises(ValueError, match="max_steps"):
        FeedTrainer(model=tiny_llama(), args=args, train_dataset=FeedDataset(service="unused"))
    with pytest.raises(TypeError, match="FeedDataset"):
        FeedTrainer(model=tiny_llama(), args=args, train_dataset=[1, 2])
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenmill feed state"):
        load_feed_state(tmp_path / "checkpoint-3")


# -- against a live service ------------------------------------------------------------------


@pytest.fixture
def make_service(ray_cluster, tmp_path):
    """Start a named service over a small real corpus (seq_len 64, 2 rows per global step)."""
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(20, max_bytes=3000))
    cfg = parse_config({"seed": 5, "seq_len": LENGTH, "global_batch_size": 2, "shuffle": {"window": 4},
                        "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}}})  # fmt: skip
    actors = []

    def make(name: str) -> str:
        name = f"{name}{os.getpid()}"
        actors.append(start_server(cfg, name=name, prefetch=4))
        return name

    yield make
    for a in actors:
        ray_cluster.kill(a)


@pytest.mark.slow
def test_feed_dataset_yields_hf_keys_and_resumes(make_service):
    service = make_service("adapters-ds")
    ds = FeedDataset(service=service)
    loader = iter(DataLoader(ds, batch_size=None))
    first = [next(loader) for _ in range(2)]
    assert all(set(b) == set(HF_KEYS) for b in first)
    assert first[0]["input_ids"].shape == (2, LENGTH) and first[0]["input_ids"].dtype == torch.long
    state = ds.state_dict()
    rest = [next(loader) for _ in range(3)]
    assert ds.batches == 5 and ds.take_wait() > 0 and ds.wait_s == 0

    # A new dataset from the state continues with the same batches; so does this one, rewound.
    # (Both are rank 0 of a world of 1, so each is rewound just before it reads.)
    again = FeedDataset(service=service)
    again.load_state_dict(state)
    assert again.state_dict() == state
    for dataset, stream in ((again, iter(DataLoader(again, batch_size=None))), (ds, loader)):
        dataset.load_state_dict(state)
        for want in rest:
            got = next(stream)
            assert all(torch.equal(got[k], want[k]) for k in HF_KEYS)
    flat = hf_batch({k: first[0][k] for k in HF_KEYS}, flatten=True)
    assert flat["input_ids"].shape == (1, 2 * LENGTH)


def hf_run(service, out, max_steps, save_steps=0, resume=None):
    """Train HF's tiny Llama with FeedTrainer; return (input_ids per micro-batch, losses, trainer)."""
    from transformers import TrainingArguments

    from trainer.adapters import FeedTrainer

    class Recording(FeedTrainer):
        seen: list = []

        def training_step(self, model, inputs, *args, **kwargs):
            assert set(inputs) == set(HF_KEYS), set(inputs)
            self.seen.append(inputs["input_ids"].clone())
            return super().training_step(model, inputs, *args, **kwargs)

    args = TrainingArguments(
        output_dir=str(out), max_steps=max_steps, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=True, report_to=[], disable_tqdm=True, seed=0, dataloader_pin_memory=False,
    )  # fmt: skip
    trainer = Recording(model=tiny_llama(TOKENIZER_VOCAB), args=args,
                        train_dataset=FeedDataset(service=service))  # fmt: skip
    trainer.seen = []
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return trainer.seen, losses, trainer


@pytest.mark.slow
def test_hf_trainer_trains_and_resumes_with_the_same_batches(make_service, tmp_path):
    straight_seen, straight, trainer = hf_run(make_service("hf-straight"), tmp_path / "s", 4)
    assert sorted(straight) == [1, 2, 3, 4] and len(straight_seen) == 8
    assert trainer.model.config.use_cache is False
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all("data_wait_s" in h and 0 <= h["data_wait_fraction"] <= 1 for h in logs), logs

    service = make_service("hf-resumed")
    # The first run goes on past its checkpoint (as a run killed after a save does): the
    # service must rewind to the checkpoint's batch.
    first_seen, first, _ = hf_run(service, tmp_path / "r", 3, save_steps=2)
    ckpt = tmp_path / "r" / "checkpoint-2"
    assert (ckpt / FEED_STATE_FILE).is_file()
    second_seen, second, _ = hf_run(service, tmp_path / "r", 4, save_steps=2, resume=str(ckpt))
    # The resumed trainer's log history starts with the checkpoint's (steps 1 and 2).
    assert sorted(first) == [1, 2, 3] and sorted(second) == [1, 2, 3, 4] and len(first_seen) == 6
    resumed = first_seen[:4] + second_seen
    for i, (got, want) in enumerate(zip(resumed, straight_seen, strict=True)):
        assert torch.equal(got, want), f"micro-batch {i}"
    for step in range(1, 5):
        assert second[step] == pytest.approx(straight[step], rel=1e-5), step


@pytest.mark.slow
def test_trl_sft_trainer_trains_on_the_feed(make_service, tmp_path):
    import trl  # the dev extra installs it: a missing TRL fails here, it is not skipped
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from trainer.adapters import feed_trainer

    # TRL wants a tokenizer for its pad id; the feed is tokenized already, so a stub vocabulary.
    vocab = Tokenizer(WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="<pad>")
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2, save_steps=2,
                         logging_steps=1, learning_rate=3e-3, use_cpu=True, report_to=[],
                         disable_tqdm=True, dataloader_pin_memory=False,
                         dataset_kwargs={"skip_prepare_dataset": True})  # fmt: skip
    ds = FeedDataset(service=make_service("sft"))
    trainer = feed_trainer(trl.SFTTrainer)(
        model=tiny_llama(TOKENIZER_VOCAB), args=args, train_dataset=ds, processing_class=tokenizer
    )
    assert type(trainer).__name__ == "FeedSFTTrainer" and ds.batches == 0  # nothing pulled yet
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2] and all("data_wait_s" in h for h in logs)
    assert ds.batches == 2 and (tmp_path / "sft" / "checkpoint-2" / FEED_STATE_FILE).is_file()
