"""``nn.MultiheadAttention`` rewritten with one projection per query/key/value, so that whole heads can be removed.

``nn.MultiheadAttention`` keeps its projections in one packed ``in_proj_weight`` and computes its head width from
the model width (``head_dim = embed_dim // num_heads``), so it cannot run with fewer heads than the model width
implies. :class:`HeadedAttention` computes the same function (``softmax(q k^T / sqrt(d) + mask) v`` per head, then
the output projection; Vaswani et al., 2017) from separate ``q_proj``/``k_proj``/``v_proj`` layers, declares its
heads (``n_head``, ``head_slots()``) for :mod:`lightning_bigtrain.functional.structured`, and accepts
``nn.MultiheadAttention``'s call signature, so ``nn.TransformerEncoderLayer`` and friends keep calling it unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_bigtrain.functional.materialize import record_init

__all__ = ["HeadedAttention", "swap_multihead_attention_"]


class HeadedAttention(nn.Module):
    """Multi-head attention with separate query/key/value projections; a drop-in for ``nn.MultiheadAttention``.

    Args:
        embed_dim: Model width (query input and output).
        n_head: Number of heads.
        head_dim: Width of each head.
        kdim: Key input width.
        vdim: Value input width.
        bias: Projections with biases.
        dropout: Dropout on the attention weights (training only).
        batch_first: Inputs are ``(batch, seq, feature)`` (else ``(seq, batch, feature)``).
    """

    # nn.Transformer*Layer's inference fast path checks these; with them it takes the regular path.
    _qkv_same_embed_dim = False
    in_proj_weight = None
    in_proj_bias = None

    def __init__(self, embed_dim: int, n_head: int, head_dim: int, kdim: int | None = None, vdim: int | None = None,
                 bias: bool = True, dropout: float = 0.0, batch_first: bool = False) -> None:  # fmt: skip
        super().__init__()
        inner = n_head * head_dim
        self.embed_dim, self.n_head, self.head_dim = embed_dim, n_head, head_dim
        self.dropout, self.batch_first = dropout, batch_first
        self.q_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.k_proj = nn.Linear(kdim or embed_dim, inner, bias=bias)
        self.v_proj = nn.Linear(vdim or embed_dim, inner, bias=bias)
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias)

    @property
    def num_heads(self) -> int:
        return self.n_head

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> HeadedAttention:
        """The same attention, with ``mha``'s weights (copied) and its output projection (kept). On the meta device
        (a model built there, not yet materialized), built there with the copies recorded
        (:func:`~lightning_bigtrain.functional.materialize.record_init`): materialized, the projections hold
        ``mha``'s values."""
        bias = mha.in_proj_bias is not None
        with contextlib.ExitStack() as building:
            if mha.out_proj.weight.is_meta:
                building.enter_context(torch.device("meta"))
                building.enter_context(record_init())
            new = cls(mha.embed_dim, mha.num_heads, mha.head_dim, mha.kdim, mha.vdim, bias, mha.dropout,
                      mha.batch_first)  # fmt: skip
            new._copy_from(mha)
        new.out_proj = mha.out_proj
        new.train(mha.training)
        return new.to(device=mha.out_proj.weight.device, dtype=mha.out_proj.weight.dtype)

    def _copy_from(self, mha: nn.MultiheadAttention) -> None:
        new, e, bias = self, mha.embed_dim, mha.in_proj_bias is not None
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                weights = mha.in_proj_weight.split(e)
            else:
                weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
            for proj, weight in zip((new.q_proj, new.k_proj, new.v_proj), weights, strict=True):
                proj.weight.copy_(weight)
            if bias:
                for proj, b in zip((new.q_proj, new.k_proj, new.v_proj), mha.in_proj_bias.split(e), strict=True):
                    proj.bias.copy_(b)

    def head_slots(self) -> list[tuple[str, str, int, int]]:
        """Where each head's weights sit: rows of the three input projections, columns of the output projection."""
        d = self.head_dim
        return [("q_proj", "out", 0, d), ("k_proj", "out", 0, d), ("v_proj", "out", 0, d), ("out_proj", "in", 0, d)]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        if batched and not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        b, t, s, h, d = query.shape[0], query.shape[1], key.shape[1], self.n_head, self.head_dim
        q = self.q_proj(query).view(b, t, h, d).transpose(1, 2)
        k = self.k_proj(key).view(b, s, h, d).transpose(1, 2)
        v = self.v_proj(value).view(b, s, h, d).transpose(1, 2)
        mask = _float_mask(attn_mask, key_padding_mask, b, h, t, s, q.dtype)
        causal = is_causal and mask is None
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = q @ k.transpose(-2, -1) / math.sqrt(d)
            if causal:
                scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1), -math.inf)
            elif mask is not None:
                scores = scores + mask
            weights = scores.softmax(-1)
            y = F.dropout(weights, p, self.training) @ v
            weights = weights.mean(1) if average_attn_weights else weights
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        out = self.out_proj(y.transpose(1, 2).reshape(b, t, h * d))
        if batched and not self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(1)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights


def _float_mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, b: int, h: int, t: int,
                s: int, dtype: torch.dtype) -> torch.Tensor | None:  # fmt: skip
    """``nn.MultiheadAttention``'s masks (boolean: True is masked out; float: added) as one additive mask."""

    def additive(mask: torch.Tensor) -> torch.Tensor:
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)
        return mask.to(dtype)

    out = None
    if attn_mask is not None:
        out = additive(attn_mask)
        if out.dim() == 3:
            if out.shape[0] != b * h:
                raise ValueError(
                    f"HeadedAttention: a per-head attn_mask of shape {tuple(attn_mask.shape)} does not match "
                    f"{b} x {h} heads (were heads pruned? pass a (L, S) mask)."
                )
            out = out.view(b, h, t, s)
        else:
            out = out.view(1, 1, t, s)
    if key_padding_mask is not None:
        pad = additive(key_padding_mask).view(b, 1, 1, s)
        out = pad if out is None else out + pad
    return out


def swap_multihead_attention_(model: nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """Replace every ``nn.MultiheadAttention`` of ``model`` (without ``add_bias_kv``/``add_zero_attn``; only those
    in ``names`` if given, e.g. the list a checkpoint recorded) by the equivalent :class:`HeadedAttention`, in place;
    returns the names replaced. Call it before the optimizer is built (its parameters are new).
    ``nn.TransformerEncoder``'s nested-tensor inference path is switched off for encoders whose layers changed (it
    reads the packed projection)."""
    only = None if names is None else set(names)
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            qualified = f"{name}.{child_name}" if name else child_name
            if only is not None and qualified not in only:
                continue
            if type(child) is nn.MultiheadAttention and child.bias_k is None and not child.add_zero_attn:
                setattr(module, child_name, HeadedAttention.from_torch(child))
                swapped.append(qualified)
    if swapped:
        for module in model.modules():
            if isinstance(module, nn.TransformerEncoder):
                module.use_nested_tensor = False
    return swapped
