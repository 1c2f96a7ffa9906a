"""Unit tests of the pruning functions and of MagnitudePruning's argument checks (no processes)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from lightning_bigtrain.callbacks import MagnitudePruning, PruningSchedule
from lightning_bigtrain.functional.pruning import (
    check_nm_shape,
    cubic_sparsity,
    magnitude_scores,
    movement_update_,
    nm_mask,
    parse_nm,
    sparsity_masks,
    sparsity_rows,
    to_dense_state_dict,
    to_sparse_state_dict,
)
from lightning_bigtrain.models import CharGPT, FashionCNN
from lightning_bigtrain.warnings import BigtrainWarning


def test_cubic_schedule_matches_zhu_and_gupta():
    kw = dict(final=0.9, start=10, end=110, initial=0.1)
    assert cubic_sparsity(0, **kw) == 0.0  # nothing before t0
    assert cubic_sparsity(10, **kw) == pytest.approx(0.1)
    assert cubic_sparsity(60, **kw) == pytest.approx(0.9 + (0.1 - 0.9) * 0.5**3)
    assert cubic_sparsity(110, **kw) == cubic_sparsity(500, **kw) == 0.9
    ramp = [cubic_sparsity(t, **kw) for t in range(10, 111)]
    assert all(b >= a for a, b in itertools.pairwise(ramp))  # monotone
    assert ramp[10] - ramp[0] > ramp[100] - ramp[90]  # fast early, slow late


def test_global_masks_prune_exactly_the_lowest_magnitudes():
    torch.manual_seed(0)
    weights = [torch.randn(30, 20), torch.randn(7, 3, 3, 3) * 0.1]
    masks = sparsity_masks([magnitude_scores(w) for w in weights], 0.8)
    total = sum(w.numel() for w in weights)
    pruned = sum(int((~m).sum()) for m in masks)
    assert pruned == round(0.8 * total)
    kept = torch.cat([w[m].abs() for w, m in zip(weights, masks, strict=True)])
    dropped = torch.cat([w[~m].abs() for w, m in zip(weights, masks, strict=True)])
    assert dropped.max() <= kept.min()
    # Global scope: the small-valued conv loses more than its share.
    assert (~masks[1]).float().mean() > (~masks[0]).float().mean()


def test_layer_scope_prunes_each_tensor_to_the_target():
    torch.manual_seed(0)
    weights = [torch.randn(30, 20), torch.randn(16, 8) * 0.01]
    masks = sparsity_masks([magnitude_scores(w) for w in weights], 0.5, scope="layer")
    for w, m in zip(weights, masks, strict=True):
        assert int((~m).sum()) == round(0.5 * w.numel())


def test_pruned_entries_never_revive_as_sparsity_grows():
    torch.manual_seed(0)
    w = torch.randn(40, 40)
    first = sparsity_masks([magnitude_scores(w)], 0.3)[0]
    w = w * first + torch.randn(40, 40) * 5 * ~first  # training would not move them: masks re-zero them; stress it
    second = sparsity_masks([magnitude_scores(w, first)], 0.6)[0]
    assert not (second & ~first).any()
    assert int((~second).sum()) == round(0.6 * w.numel())


def test_nm_mask_keeps_n_largest_of_every_m():
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    mask = nm_mask(magnitude_scores(w), 2, 4)
    groups = mask.reshape(8, 4, 4)
    assert (groups.sum(-1) == 2).all()
    kept = (w.abs() * mask).reshape(8, 4, 4)
    top2 = w.abs().reshape(8, 4, 4).topk(2, dim=-1).values.sum(-1)
    torch.testing.assert_close(kept.sum(-1), top2)
    conv = nm_mask(torch.randn(4, 8, 3, 3).abs(), 2, 4)  # groups along in_channels * kernel = 72
    assert conv.shape == (4, 8, 3, 3) and int(conv.sum()) == 4 * 36


def test_nm_shape_and_pattern_checks():
    assert check_nm_shape((8, 16), 4) is None
    assert "not a multiple of 4" in check_nm_shape((8, 1, 3, 3), 4)
    assert "no input dimension" in check_nm_shape((8,), 4)
    assert parse_nm("2:4") == (2, 4)
    for bad in ("4:2", "2-4", "0:4"):
        with pytest.raises(ValueError, match="pattern="):
            parse_nm(bad)


def test_movement_scores_reward_weights_moving_away_from_zero():
    w = torch.tensor([1.0, 1.0, -1.0])
    g = torch.tensor([-1.0, 1.0, 1.0])  # SGD moves w by -g: away from zero, toward zero, away from zero
    scores = torch.zeros(3)
    movement_update_(scores, w, g)
    assert scores.tolist() == [1.0, -1.0, 1.0]
    mask = sparsity_masks([scores], 1 / 3)[0]
    assert mask.tolist() == [True, False, True]


def test_sparse_state_dict_round_trip_and_report():
    w = torch.randn(50, 50)
    w[torch.rand(50, 50) < 0.9] = 0
    state = {"w": w, "b": torch.randn(50), "step": torch.tensor(3)}
    sparse = to_sparse_state_dict(state)
    assert sparse["w"].is_sparse and not sparse["b"].is_sparse
    dense = to_dense_state_dict(sparse)
    assert all(torch.equal(dense[k], state[k]) for k in state)
    (row,) = sparsity_rows([("w", w)])
    assert row.zeros == int((w == 0).sum()) and row.sparsity == pytest.approx(row.zeros / 2500)


def test_bad_sparsity_and_scope():
    with pytest.raises(ValueError, match=r"sparsity=1.0: must be in \[0, 1\)"):
        sparsity_masks([torch.ones(3)], 1.0)
    with pytest.raises(ValueError, match="scope="):
        sparsity_masks([torch.ones(3)], 0.5, scope="row")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sparsity": 1.0}, r"MagnitudePruning\(sparsity=1.0\): must be a fraction in \[0, 1\)"),
        ({"sparsity": -0.1}, r"sparsity=-0.1"),
        ({}, r"give `sparsity`"),
        ({"sparsity": 0.9, "pattern": "2:4"}, r"the pattern fixes the sparsity at 0.5"),
        ({"pattern": "4:2"}, r"need 0 < N < M"),
        ({"sparsity": 0.5, "scope": "row"}, r"scope='row'"),
        ({"sparsity": 0.5, "criterion": "random"}, r"criterion='random'"),
        ({"sparsity": 0.5, "rewind": 1.5}, r"rewind=1.5"),
        ({"sparsity": 0.5, "schedule": PruningSchedule(initial_sparsity=0.6)}, r"above the final sparsity"),
    ],
)
def test_magnitude_pruning_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MagnitudePruning(**kwargs)


def test_schedule_validation_and_resolution():
    with pytest.raises(ValueError, match=r"PruningSchedule\(end=1.5\).*fraction"):
        PruningSchedule(end=1.5)
    with pytest.raises(ValueError, match=r"frequency=0"):
        PruningSchedule(frequency=0)
    assert PruningSchedule().resolve(400) == (0, 300, 30)
    assert PruningSchedule(start=10, end=0.5, frequency=5).resolve(100) == (10, 50, 5)
    with pytest.raises(ValueError, match=r"end .* comes before start"):
        PruningSchedule(start=50, end=10).resolve(100)
    with pytest.raises(ValueError, match="needs a run of known length"):
        PruningSchedule(end=0.5).resolve(math.inf)


def test_parameter_choice_names_the_problem():
    cnn = FashionCNN(channels=(8, 16))
    chosen = MagnitudePruning(0.5)._choose(cnn)
    assert chosen == ["features.0.weight", "features.4.weight", "classifier.weight"]
    with pytest.raises(ValueError, match=r"no parameter of FashionCNN matches 'head\.\*'.*features\.0\.weight"):
        MagnitudePruning(0.5, parameters=["head.*"])._choose(cnn)
    # 2:4 needs the input size to divide by 4: the first conv has 1 * 3 * 3 inputs per output.
    with pytest.raises(ValueError, match=r"cannot apply to: features\.0\.weight \(8, 1, 3, 3\) \(its input size 9"):
        MagnitudePruning(pattern="2:4", parameters=["features.0.weight"])._choose(cnn)
    # By default such a layer stays dense, named in a warning (sparse kernels skip it too).
    with pytest.warns(BigtrainWarning, match=r"leaves 1 weight\(s\) dense.*features\.0\.weight \(8, 1, 3, 3\)"):
        assert MagnitudePruning(pattern="2:4")._choose(cnn) == ["features.4.weight", "classifier.weight"]
    cnn.features[0].weight.requires_grad_(False)
    with pytest.warns(BigtrainWarning, match=r"frozen parameter\(s\) left unpruned.*features\.0\.weight"):
        assert MagnitudePruning(0.5)._choose(cnn) == ["features.4.weight", "classifier.weight"]
    with pytest.raises(ValueError, match="no trainable Linear/Conv weight"):
        MagnitudePruning(0.5)._choose(nn.Sequential(nn.ReLU()))


def test_shared_weights_are_pruned_once_with_a_warning():
    gpt = CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=16)
    gpt.lm_head.weight = gpt.tok_emb.weight  # tied input and output embeddings
    with pytest.warns(BigtrainWarning, match=r"`lm_head\.weight` is shared with `tok_emb\.weight`"):
        chosen = MagnitudePruning(0.5)._choose(gpt)
    assert chosen.count("lm_head.weight") == 1


class _NoForward(FashionCNN):
    """Calls its layers directly in training_step: a forward hook never fires."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.classifier(self.features(x).mean(dim=(2, 3))), y)


def test_settings_that_cannot_act_warn(tmp_path):
    import lightning as L

    from lightning_bigtrain.callbacks import StructuredPruning
    from lightning_bigtrain.data import FashionMNISTDataModule
    from lightning_bigtrain.warnings import NoEffectWarning

    with pytest.warns(NoEffectWarning, match=r"MagnitudePruning\(sparsity=0.0\) prunes nothing"):
        MagnitudePruning(0.0).setup(None, FashionCNN(channels=(8, 16)), "fit")  # type: ignore[arg-type]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=[StructuredPruning(0.5)])  # fmt: skip
    with pytest.warns(NoEffectWarning, match=r"StructuredPruning removed nothing.*_NoForward.example_input_array"):
        trainer.fit(_NoForward(channels=(8, 16)), datamodule=FashionMNISTDataModule(batch_size=16, subset=64))


def test_zero_initialized_weights_are_left_dense_by_default():
    """torchvision's ViT zero-initializes its head: magnitude ranking would mask all of it at the first event and it
    would stay zero for good (the loss never moves). The default choice leaves it out, with a warning."""
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    nn.init.zeros_(net[2].weight)
    with pytest.warns(BigtrainWarning, match=r"`2\.weight` all zeros at setup \(zero-initialized\): left dense"):
        assert MagnitudePruning(0.5)._choose(net) == ["0.weight"]
    assert MagnitudePruning(0.5, parameters=["*.weight"])._choose(net) == ["0.weight", "2.weight"]


def test_structured_pruning_names_an_unknown_ignore_entry_at_setup():
    """A typo in ``ignore`` used to be skipped silently (the layer was pruned anyway): setup now refuses it, naming
    the argument, the bad name and the closest module names."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightning_bigtrain.callbacks import StructuredPruning

    trainer = SimpleNamespace(strategy=SingleDeviceStrategy(torch.device("cpu")))
    cnn = FashionCNN(channels=(8, 16))
    pruning = StructuredPruning(0.5, ignore=["features.4", "clasifier"])
    with pytest.raises(ValueError, match=r"StructuredPruning\(ignore=\[.*\]\): FashionCNN has no module 'clasifier' "
                                         r"\(did you mean 'classifier'\?\)"):  # fmt: skip
        pruning.setup(trainer, cnn, "fit")  # type: ignore[arg-type]
    pruning.teardown(trainer, cnn, "fit")  # type: ignore[arg-type]
    accepted = StructuredPruning(0.5, ignore=["features.4", "classifier"])
    accepted.setup(trainer, cnn, "fit")  # type: ignore[arg-type]
    accepted.teardown(trainer, cnn, "fit")  # type: ignore[arg-type]
    assert "on_load_checkpoint" not in vars(cnn)
