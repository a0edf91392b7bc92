"""docs/integrations.md's Hugging Face Trainer recipe, on the CPU with a tiny BERT built from its config."""

from __future__ import annotations

import math

import pytest
import torch
from _recipes import load, rows

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

N, SEQ = 32, 8


class _Pairs(torch.utils.data.Dataset):
    """Token rows, each unique, with a label; dicts as HF datasets give them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 64, (N, SEQ), generator=g)
        self.ids[:, 0] = torch.arange(N)  # every row unique, so a delivered row names its sample
        self.labels = torch.arange(N) % 2

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.int64),
                "labels": self.labels[i]}


@pytest.mark.parametrize("workers", [0, 2])
def test_gpufeed_trainer_delivers_every_sample_and_trains(tmp_path, workers):
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

    from gpufeed import CudaPrefetcher

    ns = load("hf-trainer")
    seen: list[dict[str, torch.Tensor]] = []

    class Recording(ns["GpufeedTrainer"]):
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append({k: v.detach().clone() for k, v in inputs.items()})
            return super().compute_loss(model, inputs, *args, **kwargs)

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, num_labels=2)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, num_train_epochs=2,
                             use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                             dataloader_num_workers=workers, disable_tqdm=True, seed=0)
    data = _Pairs()
    trainer = Recording(model=BertForSequenceClassification(config), args=args, train_dataset=data)
    loader = trainer.get_train_dataloader()
    assert isinstance(loader, CudaPrefetcher) and type(loader.source).__name__ == "DataLoaderShard"
    assert loader.source.device is None  # accelerate does not place the batches: gpufeed does
    loader.close()
    trainer.train()

    assert len(seen) == 2 * N // 4
    index = {r: i for i, r in enumerate(rows(data.ids))}
    for epoch in range(2):
        delivered = []
        for batch in seen[epoch * N // 4:(epoch + 1) * N // 4]:
            assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (4, SEQ)
            for r, label in zip(rows(batch["input_ids"]), batch["labels"].tolist(), strict=True):
                i = index[r]  # the row's bytes are exactly a sample's
                assert label == data.labels[i].item()
                delivered.append(i)
            assert torch.equal(batch["attention_mask"], torch.ones(4, SEQ, dtype=torch.int64))
        assert sorted(delivered) == list(range(N))  # each sample once an epoch
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(v) for v in losses)
