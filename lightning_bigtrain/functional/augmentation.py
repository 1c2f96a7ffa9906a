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

- RandAugment (Cubuk et al., 2020, "RandAugment: Practical automated data augmentation with a reduced search
  space"): ``num_ops`` operations per sample drawn uniformly from a fixed list, all at one magnitude ``m`` of 30
  levels, each with a random sign; the magnitude scales are RandAugment's (rotation up to 30 degrees, shear up to
  0.3, translation up to 150/331 of the side, colour factors 1 +- 0.9, posterize down to 4 bits, solarize
  threshold down to 0). Here each *sample* draws its own operations and signs (torchvision v2 and kornia draw the
  operations once per batch); images are taken to 8 bits for posterize and equalize, as PIL does.

The partner ``j`` of sample ``i`` is the next sample in the batch (``roll`` by one), as torchvision's and timm's
batch mixing do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["RAND_AUGMENT_OPS", "Mixed", "mix_batch", "mixed_targets", "rand_augment", "random_erasing", "token_mask"]


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


#: RandAugment's operations (``color`` only for 3-channel images).
RAND_AUGMENT_OPS = ("identity", "autocontrast", "equalize", "rotate", "solarize", "color", "posterize", "contrast",
                    "brightness", "sharpness", "shear_x", "shear_y", "translate_x", "translate_y")  # fmt: skip
_GEOMETRIC = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
_MAX_LEVEL = 30.0


def _grey(u: torch.Tensor) -> torch.Tensor:
    """[N, 1, H, W] luminance (ITU-R 601-2 weights as torchvision rounds them for 3 channels, else the mean)."""
    if u.shape[1] == 3:
        w = torch.tensor([0.2989, 0.587, 0.114], dtype=u.dtype, device=u.device).view(1, 3, 1, 1)
        return (u * w).sum(1, keepdim=True)
    return u.mean(1, keepdim=True)


def _blend(u: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``other + factor (u - other)``, clamped to [0, 1] (factor 0: ``other``, 1: ``u``)."""
    return torch.lerp(other, u, factor.view(-1, 1, 1, 1)).clamp_(0.0, 1.0)


def _sharpen(u: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's sharpness: blend with the image smoothed by [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13 (border kept)."""
    c = u.shape[1]
    kernel = torch.ones(3, 3, dtype=u.dtype, device=u.device)
    kernel[1, 1] = 5.0
    kernel = (kernel / 13.0).expand(c, 1, 3, 3)
    smooth = u.clone()
    if u.shape[-1] > 2 and u.shape[-2] > 2:
        smooth[..., 1:-1, 1:-1] = torch.nn.functional.conv2d(u, kernel, groups=c)
    return _blend(u, smooth, factor)


def _equalize(u: torch.Tensor) -> torch.Tensor:
    """PIL's histogram equalization of each channel at 8 bits (what torchvision's ``equalize`` computes), for all
    samples and channels with one ``bincount``: the lookup table maps a level to its cumulative count, spread over
    the levels above the darkest one; a channel with a single level stays as it is."""
    n, c = u.shape[:2]
    q = (u * 255.0).round_().to(torch.long).flatten(2)  # [N, C, HW]
    offsets = torch.arange(n * c, device=u.device).view(n, c, 1) * 256
    hist = torch.bincount((q + offsets).flatten(), minlength=n * c * 256).view(n, c, 256)
    # PIL: step = (pixels - count of the highest level present) // 255; lut = (cumsum before + step // 2) // step
    last = (hist > 0).to(torch.long).flip(-1).argmax(-1, keepdim=True)  # levels above the highest one present
    top = hist.gather(-1, 255 - last)
    step = torch.div(hist.sum(-1, keepdim=True) - top, 255, rounding_mode="floor")
    before = hist.cumsum(-1) - hist
    lut = torch.div(before + torch.div(step, 2, rounding_mode="floor"), step.clamp_min(1), rounding_mode="floor")
    lut = lut.clamp_(0, 255)
    out = lut.gather(-1, q).to(u.dtype) / 255.0
    return torch.where(step.view(n, c, 1) > 0, out, q.to(u.dtype) / 255.0).view_as(u)


def _autocontrast(u: torch.Tensor) -> torch.Tensor:
    low = u.amin(dim=(-2, -1), keepdim=True)
    high = u.amax(dim=(-2, -1), keepdim=True)
    spread = high - low
    return torch.where(spread > 0, (u - low) / spread.clamp_min(1e-12), u)


def _affine(u: torch.Tensor, ops: np.ndarray, signed: np.ndarray, level: float) -> torch.Tensor:
    """One ``grid_sample`` for the samples of a geometric operation each (nearest pixel, black outside).
    ``affine_grid`` works in normalised coordinates, so pixel offsets are scaled by the side they run along."""
    n, _, height, width = u.shape
    theta = np.zeros((n, 2, 3))
    theta[:, 0, 0] = theta[:, 1, 1] = 1.0
    angle = np.radians(30.0 * level * signed)
    rot = ops == "rotate"
    theta[rot, 0, 0], theta[rot, 0, 1] = np.cos(angle[rot]), -np.sin(angle[rot]) * height / width
    theta[rot, 1, 0], theta[rot, 1, 1] = np.sin(angle[rot]) * width / height, np.cos(angle[rot])
    theta[ops == "shear_x", 0, 1] = (0.3 * level * signed * height / width)[ops == "shear_x"]
    theta[ops == "shear_y", 1, 0] = (0.3 * level * signed * width / height)[ops == "shear_y"]
    shift = 2.0 * (150.0 / 331.0) * level * signed
    theta[ops == "translate_x", 0, 2] = shift[ops == "translate_x"]
    theta[ops == "translate_y", 1, 2] = shift[ops == "translate_y"]
    grid = torch.nn.functional.affine_grid(torch.as_tensor(theta, dtype=u.dtype, device=u.device), list(u.shape),
                                           align_corners=False)  # fmt: skip
    return torch.nn.functional.grid_sample(u, grid, mode="nearest", padding_mode="zeros", align_corners=False)


def _apply(op: str, u: torch.Tensor, signed: torch.Tensor, level: float) -> torch.Tensor:
    """``op`` at ``level`` (0..1 of RandAugment's range) on images in [0, 1], ``signed`` +-1 per sample."""
    factor = (1.0 + 0.9 * level * signed).to(u.dtype)
    if op == "brightness":
        return _blend(u, torch.zeros_like(u), factor)
    if op == "contrast":
        return _blend(u, _grey(u).mean(dim=(-3, -2, -1), keepdim=True).expand_as(u), factor)
    if op == "color":
        return _blend(u, _grey(u).expand_as(u), factor)
    if op == "sharpness":
        return _sharpen(u, factor)
    if op == "posterize":
        shift = round(4 * level)
        q = (u * 255.0).round_().to(torch.uint8)
        return ((q >> shift) << shift).to(u.dtype) / 255.0
    if op == "solarize":
        threshold = 1.0 - level
        return torch.where(u >= threshold, 1.0 - u, u)
    if op == "autocontrast":
        return _autocontrast(u)
    if op == "equalize":
        return _equalize(u)
    return u  # identity


def rand_augment(
    inputs: torch.Tensor,
    rng: np.random.Generator,
    *,
    num_ops: int = 2,
    magnitude: int = 9,
    value_range: tuple[float, float] = (0.0, 1.0),
) -> torch.Tensor:
    """RandAugment with each sample's own operations (a new tensor).

    Args:
        inputs: Floating-point images ``[B, C, H, W]`` or ``[B, H, W]`` whose pixels span ``value_range``.
        rng: The step's generator (operations and signs).
        num_ops: Operations per sample (drawn with replacement, as RandAugment does).
        magnitude: 0..30, RandAugment's ``m``.
        value_range: What black and white are in ``inputs`` (standardised images: ``((0 - mean) / std,
            (1 - mean) / std)``); the operations work on [0, 1] and the result is mapped back.
    """
    squeeze = inputs.dim() == 3
    x = inputs.unsqueeze(1) if squeeze else inputs
    low, high = value_range
    u = ((x - low) / (high - low)).clamp(0.0, 1.0)
    ops = [op for op in RAND_AUGMENT_OPS if op != "color" or x.shape[1] == 3]
    batch = x.shape[0]
    level = magnitude / _MAX_LEVEL
    names = np.array(ops)
    for _ in range(num_ops):
        chosen = names[rng.integers(0, len(ops), size=batch)]
        signs = np.where(rng.random(batch) < 0.5, -1.0, 1.0)
        # Each sample takes one operation per round, so the samples of different operations are disjoint and the
        # results can be written back into ``u`` (a tensor of ours) in place.
        geometric = np.flatnonzero(np.isin(chosen, _GEOMETRIC))
        if len(geometric):
            idx = torch.as_tensor(geometric, device=u.device)
            u[idx] = _affine(u[idx], chosen[geometric], signs[geometric], level)
        for op in ops:
            if op in _GEOMETRIC or op == "identity":
                continue
            members = np.flatnonzero(chosen == op)
            if len(members) == 0:
                continue
            idx = torch.as_tensor(members, device=u.device)
            u[idx] = _apply(op, u[idx], torch.as_tensor(signs[members], device=u.device), level)
    y = u * (high - low) + low
    return y.squeeze(1) if squeeze else y
