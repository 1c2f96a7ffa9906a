"""A char-level GPT (decoder-only transformer): an ordinary LightningModule."""

from __future__ import annotations

import math
from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn
from typing_extensions import override

from lightning_bigtrain.functional.fused_loss import chunked_linear_cross_entropy

__all__ = ["Block", "CausalSelfAttention", "CharGPT", "WrittenAttention"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``.

    The heads' total width ``n_head * head_dim`` may be smaller than ``n_embd`` once heads are pruned
    (:meth:`head_slots` tells :class:`~lightning_bigtrain.callbacks.StructuredPruning` where each head lives)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        inner = self.n_head * self.head_dim
        q, k, v = self.qkv(x).split(inner, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, inner))

    def head_slots(self) -> list[tuple[str, str, int, int]]:
        """``(submodule, "out" | "in", offset, head_dim)`` for every place the heads' weights sit, in head order:
        the query, key and value rows of ``qkv`` and the input columns of ``proj``."""
        inner = self.n_head * self.head_dim
        return [("qkv", "out", i * inner, self.head_dim) for i in range(3)] + [("proj", "in", 0, self.head_dim)]


class WrittenAttention(CausalSelfAttention):
    """The same attention (weights, head declaration) written out as many GPT reimplementations write it:
    ``softmax(q k^T / sqrt(d))`` with a lower-triangular mask buffer and a dropout module on the weights, then
    ``@ v``. Stands for "a user's hand-written attention" (``CharGPT(attention="written")``)."""

    mask: torch.Tensor  # the registered buffer (nn.Module's attribute lookup is typed Tensor | Module)

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, block_size: int = 128) -> None:
        super().__init__(n_embd, n_head, dropout)
        self.attn_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("mask", mask, persistent=False)

    def reset_parameters(self) -> None:
        """The causal mask again (a model built on the meta device gets its storage empty; no checkpoint holds
        the buffer). The projections are ``nn.Linear`` children with their own."""
        with torch.no_grad():
            self.mask.copy_(torch.tril(torch.ones_like(self.mask[0, 0])).view_as(self.mask))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        inner = self.n_head * self.head_dim
        q, k, v = self.qkv(x).split(inner, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, inner))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(
        self, n_embd: int, n_head: int, dropout: float = 0.0, attention: str = "sdpa", block_size: int = 128
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = (
            CausalSelfAttention(n_embd, n_head, dropout)
            if attention == "sdpa"
            else WrittenAttention(n_embd, n_head, dropout, block_size)
        )
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharGPT(L.LightningModule):
    """GPT-style language model over characters (Radford et al., 2019 layout, pre-norm blocks).

    Knows nothing of lightning_bigtrain: it stands for "any LightningModule" in tests and demos.

    Args:
        vocab_size: Number of symbols (96 for :class:`~lightning_bigtrain.data.ShakespeareDataModule`).
        block_size: Longest context, in characters.
        n_layer: Transformer blocks.
        n_head: Attention heads per block; must divide ``n_embd``.
        n_embd: Model width.
        dropout: Dropout probability in blocks and embeddings.
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay on matrices (not on biases, norms or embeddings).
        warmup_steps: Linear learning-rate warm-up, then cosine decay to 10% over the run.
        attention: ``"sdpa"`` (``scaled_dot_product_attention``) or ``"written"`` (:class:`WrittenAttention`:
            the same weights and ``state_dict``, attention computed step by step).
    """

    def __init__(
        self,
        vocab_size: int = 96,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        attention: Literal["sdpa", "written"] = "sdpa",
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                            ("n_head", n_head), ("n_embd", n_embd)):  # fmt: skip
            if value < 1:
                raise ValueError(f"`CharGPT({name}={value})`: {name} must be >= 1.")
        if n_embd % n_head:
            raise ValueError(
                f"`CharGPT(n_embd={n_embd}, n_head={n_head})`: n_head must divide n_embd "
                f"(try n_head={math.gcd(n_embd, n_head)})."
            )
        if attention not in ("sdpa", "written"):
            raise ValueError(f"`CharGPT(attention={attention!r})`: choose 'sdpa' or 'written'.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`CharGPT(dropout={dropout})`: dropout must be in [0, 1).")
        self.save_hyperparameters()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, attention, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        # Declared for OperatorFusion: when True, training losses come from the chunked linear + cross-entropy
        # (the logits are never materialized); `forward(idx)` still returns logits.
        self.fused_lm_head_loss = False
        self.apply(self._init_weights)
        # GPT-2 (Radford et al., 2019): residual projections scaled by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @override
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch x time x vocab) of token ids (batch x time); with ``targets``, the mean cross-entropy
        (through the chunked LM-head loss when ``fused_lm_head_loss`` is set). The loss is computed inside
        ``forward`` so that sharding wrappers (FSDP2) have the head's weight gathered."""
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"Sequence length {t} exceeds CharGPT(block_size={self.block_size}).")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        hidden = self.ln_f(x)
        if targets is not None and self.fused_lm_head_loss:
            return chunked_linear_cross_entropy(hidden, self.lm_head.weight, targets)
        logits = self.lm_head(hidden)
        if targets is not None:
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        if self.fused_lm_head_loss and self.training:
            return self(idx, targets)
        logits = self(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx`` (batch x time); returns the extended ids."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1, :] / temperature
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        embeddings = {id(self.tok_emb.weight), id(self.pos_emb.weight)}
        decay = [p for p in self.parameters() if p.ndim >= 2 and id(p) not in embeddings]
        no_decay = [p for p in self.parameters() if p.ndim < 2 or id(p) in embeddings]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=(0.9, 0.95),
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = min(self.warmup_steps, max(total - 1, 0))

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
