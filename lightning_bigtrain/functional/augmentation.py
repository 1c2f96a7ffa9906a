"""Batch augmentations with per-sample random parameters, on whatever device the batch is on.

The random draws that decide *what* happens to each sample (mixing weights, boxes, which samples are erased) are a
few numbers per sample and come from a NumPy generator seeded per step, so a run and its resumption draw the same;
the per-pixel noise of random erasing comes from a ``torch.Generator`` on the batch's device seeded the same way.

- MixUp (Zhang et al., 2018, "mixup: Beyond Empirical Risk Minimization"): ``x = lam x_i + (1 - lam) x_j``,
  ``lam ~ Beta(alpha, alpha)``, the targets mixed in the same proportion.
- CutMix (Yun et al., 2019, "CutMix: Regularization Strategy to Train Strong Classifiers with Localizable
  Features"): a box of area ``(1 - lam) H W`` of ``x_i`` replaced by ``x_j``'s; ``lam`` is then recomputed from the
  box as clipped to the image.
- Random erasing (Zhong et al., 2020, "Random Erasing Data Augmentation"): with probability ``p`` a box of area
  ``s H W``, ``s ~ U(0.02, 0.33)``, aspect ratio log-uniform in ``[0.3, 3.3]``, filled with N(0, 1) noise.
- Token masking (as BERT's masked inputs, Devlin et al., 2019, without the loss on masked positions): each input
  token replaced by ``mask_token`` with probability ``p``; the targets stay.

The partner ``j`` of sample ``i`` is the next sample in the batch (``roll`` by one), as torchvision's and timm's
batch mixing do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Mixed", "mix_batch", "mixed_targets", "random_erasing", "token_mask"]


@dataclass
class Mixed:
    """What :func:`mix_batch` did: the mixed inputs, each sample's weight ``lam`` on its own target (1.0 for a
    sample left as it was), and the partner each sample was mixed with."""

    inputs: torch.Tensor
    lam: torch.Tensor  # float32 [B], on the inputs' device
    partner: torch.Tensor  # int64 [B], on the inputs' device


def _boxes(rng: np.random.Generator, lam: np.ndarray, height: int, width: int) -> tuple[np.ndarray, ...]:
    """CutMix boxes: side ``sqrt(1 - lam)`` of the image's, centre uniform, clipped to the image."""
    cut = np.sqrt(1.0 - lam)
    h, w = (cut * height).astype(np.int64), (cut * width).astype(np.int64)
    cy, cx = rng.integers(0, height, size=lam.shape), rng.integers(0, width, size=lam.shape)
    y0, y1 = np.clip(cy - h // 2, 0, height), np.clip(cy + h // 2, 0, height)
    x0, x1 = np.clip(cx - w // 2, 0, width), np.clip(cx + w // 2, 0, width)
    return y0, y1, x0, x1


def _box_mask(boxes: tuple[np.ndarray, ...], height: int, width: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[B, H, W]``: True inside each sample's box (one full-size operation: rows x columns)."""
    y0, y1, x0, x1 = (torch.as_tensor(b, device=device) for b in boxes)
    rows = torch.arange(height, device=device).view(1, -1)
    cols = torch.arange(width, device=device).view(1, -1)
    in_rows = (rows >= y0.view(-1, 1)) & (rows < y1.view(-1, 1))
    in_cols = (cols >= x0.view(-1, 1)) & (cols < x1.view(-1, 1))
    return in_rows.unsqueeze(2) & in_cols.unsqueeze(1)


def mix_batch(
    inputs: torch.Tensor,
    rng: np.random.Generator,
    *,
    mixup: float = 0.0,
    cutmix: float = 0.0,
    switch_prob: float = 0.5,
    per_sample: bool = True,
) -> Mixed:
    """MixUp and/or CutMix over a batch, each sample with its own ``lam`` (and box, and choice between the two when
    both are on: CutMix with probability ``switch_prob``), or one draw for the whole batch (``per_sample=False``).

    Args:
        inputs: Floating-point ``[B, ...]``; CutMix needs ``[B, C, H, W]`` or ``[B, H, W]``.
        rng: The step's generator.
        mixup: MixUp's ``alpha`` (0: off).
        cutmix: CutMix's ``alpha`` (0: off).
        switch_prob: With both on, the probability of CutMix for a sample (or the batch).
        per_sample: One draw per sample (else one for the batch).
    """
    batch = inputs.shape[0]
    draws = batch if per_sample else 1
    use_cut = np.zeros(draws, dtype=bool)
    if cutmix > 0 and mixup > 0:
        use_cut = rng.random(draws) < switch_prob
    elif cutmix > 0:
        use_cut[:] = True
    lam = np.where(
        use_cut,
        rng.beta(cutmix, cutmix, size=draws) if cutmix > 0 else 1.0,
        rng.beta(mixup, mixup, size=draws) if mixup > 0 else 1.0,
    )
    if not per_sample:
        lam, use_cut = np.repeat(lam, batch), np.repeat(use_cut, batch)
    device = inputs.device
    partner = torch.roll(torch.arange(batch, device=device), 1)
    other = torch.roll(inputs, 1, 0)  # inputs[partner], without the gather
    # Each sample's weight on its own pixels: lam everywhere (MixUp), or 0 inside its box and 1 outside (CutMix);
    # then one lerp for the whole batch.
    shape = (batch, *([1] * (inputs.dim() - 1)))
    if use_cut.any():
        height, width = inputs.shape[-2], inputs.shape[-1]
        if per_sample:
            boxes = _boxes(rng, lam, height, width)
        else:
            boxes = tuple(np.repeat(b, batch) for b in _boxes(rng, lam[:1], height, width))
        area = (boxes[1] - boxes[0]) * (boxes[3] - boxes[2]) / float(height * width)
        lam = np.where(use_cut, 1.0 - area, lam)  # the box as clipped to the image decides
        y0, y1, x0, x1 = boxes
        mix_weight = torch.as_tensor(np.where(use_cut, 1.0, lam), dtype=inputs.dtype, device=device).view(-1, 1, 1)
        inside = _box_mask((y0, np.where(use_cut, y1, y0), x0, x1), height, width, device)  # MixUp's: empty
        weight = torch.where(inside, 0.0, mix_weight)  # [B, H, W]
        weight = weight.view(batch, *([1] * (inputs.dim() - 3)), height, width)
    else:
        weight = torch.as_tensor(lam, dtype=inputs.dtype, device=device).view(shape)
    out = torch.lerp(other, inputs, weight)
    lam_t = torch.as_tensor(lam, dtype=torch.float32, device=device)
    return Mixed(out, lam_t, partner)


def mixed_targets(targets: torch.Tensor, mixed: Mixed, num_classes: int) -> torch.Tensor:
    """Class-probability targets ``lam onehot(y_i) + (1 - lam) onehot(y_j)`` (``[B, num_classes]``, float32), from
    class indices ``[B]`` or from probabilities ``[B, num_classes]`` (mixed the same way)."""
    if targets.dim() == 1 and not targets.is_floating_point():
        probs = torch.nn.functional.one_hot(targets.long(), num_classes).float()
    elif targets.dim() == 2 and targets.is_floating_point() and targets.shape[1] == num_classes:
        probs = targets.float()
    else:
        raise ValueError(
            f"BatchAugmentation(num_classes={num_classes}): the targets must be class indices [batch] or class "
            f"probabilities [batch, {num_classes}]; got a {targets.dtype} tensor of shape {tuple(targets.shape)}."
        )
    lam = mixed.lam.view(-1, 1)
    return probs * lam + probs[mixed.partner] * (1 - lam)


def random_erasing(
    inputs: torch.Tensor,
    rng: np.random.Generator,
    generator: torch.Generator,
    p: float,
    scale: tuple[float, float] = (0.02, 0.33),
    ratio: tuple[float, float] = (0.3, 3.3),
) -> torch.Tensor:
    """Random erasing with probability ``p`` per sample, the box filled with N(0, 1) noise (a new tensor)."""
    batch, height, width = inputs.shape[0], inputs.shape[-2], inputs.shape[-1]
    chosen = rng.random(batch) < p
    if not chosen.any():
        return inputs
    area = rng.uniform(*scale, size=batch) * height * width
    aspect = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), size=batch))
    h = np.clip(np.rint(np.sqrt(area * aspect)).astype(np.int64), 1, height)
    w = np.clip(np.rint(np.sqrt(area / aspect)).astype(np.int64), 1, width)
    y0 = (rng.random(batch) * (height - h + 1)).astype(np.int64)
    x0 = (rng.random(batch) * (width - w + 1)).astype(np.int64)
    mask = _box_mask((y0, y0 + h, x0, x0 + w), height, width, inputs.device)
    mask &= torch.as_tensor(chosen, device=inputs.device).view(-1, 1, 1)  # [B, H, W]
    if inputs.dim() > 3:
        mask = mask.view(batch, *([1] * (inputs.dim() - 3)), height, width)
    noise = torch.randn(inputs.shape, generator=generator, device=inputs.device, dtype=inputs.dtype)
    return torch.where(mask, noise, inputs)


def token_mask(tokens: torch.Tensor, generator: torch.Generator, p: float, mask_token: int) -> torch.Tensor:
    """Each token replaced by ``mask_token`` with probability ``p`` (a new tensor)."""
    drop = torch.rand(tokens.shape, generator=generator, device=tokens.device) < p
    return torch.where(drop, torch.full_like(tokens, mask_token), tokens)
