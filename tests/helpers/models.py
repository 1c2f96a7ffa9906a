"""Test models: the char-GPT with its attention written out by hand (as many GPT reimplementations do)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.models.gpt import CausalSelfAttention


class WrittenAttention(CausalSelfAttention):
    """CharGPT's attention (same weights, same head declaration) computed as ``softmax(q k^T / sqrt(d)) v`` with a
    lower-triangular mask buffer and a dropout module on the weights."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0) -> None:
        super().__init__(n_embd, n_head, dropout)
        self.attn_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        inner = self.n_head * self.head_dim
        q, k, v = self.qkv(x).split(inner, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, inner))


def written_attention_gpt(**kwargs: Any) -> CharGPT:
    """A CharGPT (same initialization and ``state_dict``) whose blocks use :class:`WrittenAttention`."""
    model = CharGPT(**kwargs)
    hp = model.hparams
    for block in model.blocks:
        written = WrittenAttention(hp.n_embd, hp.n_head, hp.block_size, hp.dropout)
        written.load_state_dict(block.attn.state_dict())
        block.attn = written
    return model
