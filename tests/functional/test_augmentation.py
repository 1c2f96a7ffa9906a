"""The batch augmentations: each sample mixed with its own weight and box, targets in the same proportion, boxes
and masks where and how often they should be."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_bigtrain.functional.augmentation import (
    _affine,
    _apply,
    _equalize,
    mix_batch,
    mixed_targets,
    rand_augment,
    random_erasing,
    token_mask,
)


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


def _unit_images(batch: int = 8, channels: int = 3) -> torch.Tensor:
    return torch.rand(batch, channels, 12, 16, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize(
    ("op", "reference"),
    [
        ("brightness", lambda F, x, f: F.adjust_brightness(x, f)),
        ("contrast", lambda F, x, f: F.adjust_contrast(x, f)),
        ("color", lambda F, x, f: F.adjust_saturation(x, f)),
        ("sharpness", lambda F, x, f: F.adjust_sharpness(x, f)),
        ("autocontrast", lambda F, x, f: F.autocontrast(x)),
    ],
)
def test_colour_operations_match_torchvisions(op, reference, channels):
    """Each sample's own factor (1 +- 0.9 level) gives what torchvision v2's functional op gives that sample."""
    from torchvision.transforms.v2 import functional as F

    if op == "color" and channels == 1:
        pytest.skip("saturation is for 3-channel images")
    x = _unit_images(channels=channels)
    signs = torch.tensor([1.0, -1.0] * 4)
    out = _apply(op, x, signs, level=0.5)
    for i in range(len(x)):
        factor = float(1 + 0.9 * 0.5 * signs[i])
        torch.testing.assert_close(out[i], reference(F, x[i], factor), atol=2e-6, rtol=0)


def test_solarize_posterize_and_geometry_match_torchvisions():
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    x = _unit_images()
    ones = torch.ones(len(x))
    torch.testing.assert_close(_apply("solarize", x, ones, level=0.4), F.solarize(x, 0.6))
    q = (x * 255).round().to(torch.uint8)
    expected = F.posterize(q, 8 - 2).float() / 255  # level 0.5: 2 bits dropped
    torch.testing.assert_close(_apply("posterize", x, ones, level=0.5), expected)
    # Rotation and translation as torchvision's affine (nearest pixel, black outside); pixels on the rounding edge
    # of nearest sampling may differ, so compare most of them.
    ops = np.array(["rotate", "translate_x", "translate_y", "shear_x"] * 2)
    signs = np.array([1.0, -1.0] * 4)
    out = _affine(x, ops, signs, level=0.5)
    for i, op in enumerate(ops):
        s = float(signs[i])
        kwargs = {"angle": 0.0, "translate": [0, 0], "scale": 1.0, "shear": [0.0, 0.0],
                  "interpolation": InterpolationMode.NEAREST, "fill": 0.0}  # fmt: skip
        if op == "rotate":
            kwargs["angle"] = -15.0 * s  # torchvision's angle is counter-clockwise
        elif op == "translate_x":
            kwargs["translate"] = [round(-150 / 331 * 0.5 * s * 16), 0]
        elif op == "translate_y":
            kwargs["translate"] = [0, round(-150 / 331 * 0.5 * s * 12)]
        else:
            continue  # shear's sign and centre conventions differ; its range is checked below
        ref = F.affine(x[i], **kwargs)
        assert (out[i] - ref).abs().lt(1e-6).float().mean() > 0.85, op
    assert not torch.equal(out[3], x[3])


def test_equalize_is_torchvisions_at_8_bits_for_every_sample_and_channel():
    from torchvision.transforms.v2 import functional as F

    x = torch.rand(6, 3, 20, 24, generator=torch.Generator().manual_seed(0)) ** 3  # dark, skewed
    x[0, 1] = 0.4  # one level only: left as it is
    x[1, 2, :10] = 1.0  # the highest level holds many pixels
    expected = F.equalize((x * 255).round().to(torch.uint8)).float() / 255
    torch.testing.assert_close(_equalize(x), expected, atol=0, rtol=0)


def test_rand_augment_draws_per_sample_stays_in_range_and_is_reproducible():
    low, high = -0.81, 2.02  # standardised Fashion-MNIST's black and white
    x = _unit_images(batch=64, channels=1) * (high - low) + low
    x[1] = x[0]
    out = rand_augment(x, np.random.default_rng(3), num_ops=2, magnitude=9, value_range=(low, high))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert float(out.min()) >= low - 1e-5 and float(out.max()) <= high + 1e-5
    again = rand_augment(x, np.random.default_rng(3), num_ops=2, magnitude=9, value_range=(low, high))
    assert torch.equal(out, again)
    changed = (out != x).flatten(1).any(1)
    assert changed.float().mean() > 0.7  # identity twice is rare
    same_input_differs = [
        not torch.equal(o[0], o[1])
        for o in (rand_augment(x[:2], np.random.default_rng(s), num_ops=2, value_range=(low, high)) for s in range(8))
    ]
    assert sum(same_input_differs) >= 5  # two copies of one image mostly get different operations
    flat = rand_augment(x[:, 0], np.random.default_rng(3), num_ops=2, value_range=(low, high))
    assert flat.shape == x[:, 0].shape
