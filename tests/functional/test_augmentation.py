"""The batch augmentations: each sample mixed with its own weight and box, targets in the same proportion, boxes
and masks where and how often they should be."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_bigtrain.functional.augmentation import mix_batch, mixed_targets, random_erasing, token_mask


def _images(batch: int = 64) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 20, generator=torch.Generator().manual_seed(123))


def test_mixup_mixes_each_sample_with_its_own_weight():
    x = _images()
    mixed = mix_batch(x, np.random.default_rng(0), mixup=0.4)
    lam = mixed.lam.view(-1, 1, 1, 1)
    assert torch.equal(mixed.partner, torch.roll(torch.arange(64), 1))
    torch.testing.assert_close(mixed.inputs, x * lam + x[mixed.partner] * (1 - lam))
    assert mixed.lam.unique().numel() == 64  # per sample, not one draw per batch (torchvision's)
    assert bool(((mixed.lam >= 0) & (mixed.lam <= 1)).all())


def test_cutmix_weight_is_the_area_of_the_sample_left_in_its_image():
    x = _images()
    mixed = mix_batch(x, np.random.default_rng(1), cutmix=1.0)
    from_partner = (mixed.inputs == x[mixed.partner]).all(dim=1) & (mixed.inputs != x).any(dim=1)
    own_share = 1 - from_partner.float().mean(dim=(1, 2))
    torch.testing.assert_close(own_share, mixed.lam)
    assert mixed.lam.unique().numel() > 32


def test_both_on_pick_per_sample_and_one_draw_per_batch_when_asked():
    x = _images()
    mixed = mix_batch(x, np.random.default_rng(2), mixup=0.4, cutmix=1.0, switch_prob=0.5)
    untouched_pixels = (mixed.inputs == x).all(dim=1).float().mean(dim=(1, 2))
    cut = untouched_pixels > 0.0  # CutMix leaves the sample's own pixels outside the box; MixUp changes them all
    assert 10 < int(cut.sum()) < 54
    one = mix_batch(x, np.random.default_rng(3), mixup=0.4, per_sample=False)
    assert one.lam.unique().numel() == 1


def test_mixed_targets_are_probabilities_in_the_inputs_proportion():
    y = torch.arange(8) % 5
    mixed = mix_batch(torch.randn(8, 4), np.random.default_rng(0), mixup=1.0)
    soft = mixed_targets(y, mixed, 5)
    torch.testing.assert_close(soft.sum(dim=1), torch.ones(8))
    for i in range(8):
        j = int(mixed.partner[i])
        want = torch.zeros(5)
        want[y[i]] += mixed.lam[i]
        want[y[j]] += 1 - mixed.lam[i]
        torch.testing.assert_close(soft[i], want)
    again = mixed_targets(soft, mixed, 5)  # probabilities mix the same way
    torch.testing.assert_close(again.sum(dim=1), torch.ones(8))
    with pytest.raises(ValueError, match=r"class indices \[batch\] or class probabilities \[batch, 5\]"):
        mixed_targets(torch.zeros(8, 3), mixed, 5)


def test_random_erasing_fills_one_box_per_chosen_sample():
    x = _images(200)
    out = random_erasing(x, np.random.default_rng(0), torch.Generator().manual_seed(0), p=0.5)
    changed = (out != x).any(dim=1)  # [B, H, W]
    chosen = changed.flatten(1).any(dim=1)
    assert 70 < int(chosen.sum()) < 130
    for i in torch.nonzero(chosen).flatten().tolist():
        rows, cols = torch.nonzero(changed[i], as_tuple=True)
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        assert int(changed[i].sum()) == int(box)  # one filled rectangle
        assert int(box) <= 0.33 * 320 * 1.5  # the area range, sides rounded to whole pixels and clipped
    assert random_erasing(x, np.random.default_rng(0), torch.Generator(), p=0.0) is x


def test_token_mask_replaces_a_p_share_of_tokens():
    tokens = torch.randint(1, 50, (32, 128), generator=torch.Generator().manual_seed(123))
    out = token_mask(tokens, torch.Generator().manual_seed(1), 0.15, 0)
    masked = out == 0
    assert 0.12 < float(masked.float().mean()) < 0.18
    assert torch.equal(out[~masked], tokens[~masked])
