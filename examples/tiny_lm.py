"""The tiny language model the DeepSpeed and Ray Train examples train: a causal
transformer built in code (no download) on a synthetic language (each token follows from
the one before with a fixed table, plus noise). Its forward returns the loss."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, LENGTH = 64, 32


def synthetic(size: int, seed: int, length: int = LENGTH) -> torch.Tensor:
    """Sequences where token t+1 = (5 * token t + 3) mod VOCAB, with 10 % noise."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, VOCAB, (size, 1), generator=g)]
    for _ in range(length - 1):
        nxt = (rows[-1] * 5 + 3) % VOCAB
        noise = torch.rand(size, 1, generator=g) < 0.1
        rows.append(torch.where(noise, torch.randint(0, VOCAB, (size, 1), generator=g), nxt))
    return torch.cat(rows, dim=1)


class TinyLM(nn.Module):
    """A causal transformer of two pre-norm layers; its forward returns the loss."""

    def __init__(self, width: int = 64, layers: int = 2, work_ms: float = 0.0) -> None:
        super().__init__()
        self.work_ms = work_ms
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.zeros(LENGTH, width))
        block = nn.TransformerEncoderLayer(
            width,
            nhead=4,
            dim_feedforward=4 * width,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.work_ms:  # a bigger model's time
            time.sleep(self.work_ms / 1000)
        x, y = ids[:, :-1], ids[:, 1:]
        n = x.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        logits = self.head(self.blocks(self.embed(x) + self.pos[:n], mask=causal, is_causal=True))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
