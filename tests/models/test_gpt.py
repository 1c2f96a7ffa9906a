"""CharGPT: causality, attention equivalence, optimizer groups, and learning on real text."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.models.gpt import CausalSelfAttention


def test_logits_shape_and_causality():
    torch.manual_seed(0)
    model = CharGPT(block_size=16, n_layer=2, n_head=2, n_embd=32).eval()
    idx = torch.randint(0, 96, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 96)
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 96
    # Positions before the change must not see it.
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_attention_matches_the_written_out_formula():
    torch.manual_seed(0)
    attn = CausalSelfAttention(n_embd=32, n_head=4)
    x = torch.randn(2, 8, 32)
    q, k, v = attn.qkv(x).split(32, dim=2)
    q, k, v = (z.view(2, 8, 4, 8).transpose(1, 2) for z in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    scores = scores.masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), float("-inf"))
    expected = attn.proj((F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(2, 8, 32))
    # float32 softmax/matmul reassociation: differences of a few ulp.
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)


def test_too_long_input_is_rejected():
    with pytest.raises(ValueError, match="exceeds CharGPT\\(block_size=8\\)"):
        CharGPT(block_size=8, n_layer=1, n_embd=16, n_head=2)(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_layer": 0}, "n_layer=0"),
        ({"n_embd": 30, "n_head": 4}, "n_head must divide"),
        ({"dropout": -0.1}, "dropout"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CharGPT(**kwargs)


def test_learns_real_text_and_optimizer_groups_cover_every_parameter(shakespeare_subset):
    L.seed_everything(0, verbose=False)
    model = CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=64, lr=3e-3, warmup_steps=5)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=60, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=4,
                        num_sanity_val_steps=0)  # fmt: skip
    trainer.validate(model, datamodule=shakespeare_subset, verbose=False)
    before = float(trainer.callback_metrics["val_loss"])
    trainer.fit(model, datamodule=shakespeare_subset)
    after = float(trainer.callback_metrics["val_loss"])
    assert before > math.log(96) - 0.2  # untrained: about uniform over 96 symbols
    assert after < before - 1.0
    groups = trainer.optimizers[0].param_groups
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert groups[1]["weight_decay"] == 0.0 and id(model.tok_emb.weight) in {id(p) for p in groups[1]["params"]}


def test_written_attention_is_the_same_model_computed_step_by_step():
    """``attention="written"``: same initialization and state_dict keys as SDPA attention, same outputs to
    float rounding (1e-5)."""
    torch.manual_seed(0)
    sdpa = CharGPT(block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    written = CharGPT(block_size=16, n_layer=2, n_head=2, n_embd=32, attention="written")
    assert sdpa.state_dict().keys() == written.state_dict().keys()
    assert all(
        torch.equal(a, b) for a, b in zip(sdpa.state_dict().values(), written.state_dict().values(), strict=True)
    )
    idx = torch.randint(0, 96, (2, 16))
    torch.testing.assert_close(written(idx), sdpa(idx), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="attention='flash'"):
        CharGPT(attention="flash")  # type: ignore[arg-type]
