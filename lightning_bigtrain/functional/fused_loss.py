"""Chunked linear + cross-entropy for language-model heads: the loss of ``hidden @ weight.T`` without the logits.

A plain LM head materializes ``tokens x vocab`` logits, then softmax and its gradient of the same size: at
vocabulary 32k and 8k tokens that is 1 GiB of fp32 per tensor. Here the tokens are processed in chunks: each
chunk's logits are formed, reduced to its log-sum-exp and target logit, and dropped; backward recomputes each
chunk's logits and turns them into ``softmax - onehot`` in place, accumulating the gradients of the hidden
states and of the weight. Peak extra memory is one chunk's logits (``chunk_size x vocab``) instead of several
full ones, at the price of computing the logits twice (one more ``tokens x hidden x vocab`` matmul).

The loss is the mean token cross-entropy over targets other than ``ignore_index``, equal to
``F.cross_entropy(hidden @ weight.T + bias, targets, ignore_index=...)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["chunked_linear_cross_entropy"]


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        ignore_index: int,
        chunk_size: int,
    ) -> Tensor:
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax arithmetic in fp32 at least
        valid = targets != ignore_index
        count = valid.sum()
        total = torch.zeros((), dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        for start, end in _chunks(n, chunk_size):
            logits = hidden[start:end] @ weight.t()
            if bias is not None:
                logits = logits + bias
            logits = logits.to(acc)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[start:end] = chunk_lse
            t = targets[start:end]
            v = valid[start:end]
            picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((chunk_lse - picked) * v).sum()
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse, count)
        ctx.ignore_index = ignore_index
        ctx.chunk_size = chunk_size
        return (total / count.clamp(min=1)).to(hidden.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse, count = ctx.saved_tensors
        acc = lse.dtype
        scale = grad_out.to(acc) / count.clamp(min=1)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if bias is not None and ctx.needs_input_grad[2] else None
        for start, end in _chunks(hidden.shape[0], ctx.chunk_size):
            h = hidden[start:end]
            logits = h @ weight.t()
            if bias is not None:
                logits = logits + bias
            # d loss / d logits = (softmax - onehot) * valid / count, built in place in the chunk's logits.
            probs = logits.to(acc).sub_(lse[start:end, None]).exp_()
            t = targets[start:end]
            v = t != ctx.ignore_index
            rows = torch.arange(end - start, device=probs.device)
            probs[rows[v], t[v]] -= 1.0
            probs.mul_((v.to(probs.dtype) * scale).unsqueeze(1))
            d = probs.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = d @ weight
            if grad_weight is not None:
                grad_weight.addmm_(probs.t(), h.to(acc))
            if grad_bias is not None:
                grad_bias += probs.sum(0)
            del logits, probs, d
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    chunk_size: int = 1024,
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, never holding all logits.

    Args:
        hidden: ``(..., hidden_size)`` final hidden states (flattened over the leading dimensions).
        weight: ``(vocab, hidden_size)`` LM-head weight.
        targets: integer class per token, shape ``hidden.shape[:-1]``; ``ignore_index`` entries are skipped.
        bias: optional ``(vocab,)``.
        chunk_size: tokens per chunk; peak extra memory is about ``3 * chunk_size * vocab`` floats.
    """
    if chunk_size < 1:
        raise ValueError(f"`chunked_linear_cross_entropy(chunk_size={chunk_size})`: must be >= 1.")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"`chunked_linear_cross_entropy`: hidden size {hidden.shape[-1]} does not match the weight's "
            f"{tuple(weight.shape)} (expected (vocab, {hidden.shape[-1]}))."
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"`chunked_linear_cross_entropy`: targets of shape {tuple(targets.shape)} do not match the tokens "
            f"{tuple(hidden.shape[:-1])}."
        )
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    return _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, flat_targets, ignore_index, chunk_size)
