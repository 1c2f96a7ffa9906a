"""Activation checkpointing of a model's blocks (functional/activation_checkpoint.py) on one process, and the
planner's config for a plan that counted it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bigtrain.functional.activation_checkpoint import check_activation_checkpointing, checkpoint_blocks_
from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.planning import plan
from lightning_bigtrain.planning.planner import strategy_config


def _gpt() -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.2)


def _grads(model: CharGPT, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(1)  # the dropout masks
    logits = model(x)
    nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1)).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_checkpointed_blocks_give_the_same_gradients_and_keep_the_names():
    plain, checkpointed = _gpt(), _gpt()
    keys = list(plain.state_dict())
    assert checkpoint_blocks_(checkpointed, True, "ZeroStrategy") == ["blocks.0", "blocks.1", "blocks.2"]
    assert list(checkpointed.state_dict()) == keys
    x = torch.randint(0, 32, (4, 16))
    for a, b in zip(_grads(plain, x), _grads(checkpointed, x), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # dropout replayed in the recomputation
    assert checkpoint_blocks_(checkpointed, True, "ZeroStrategy") == ["blocks.0", "blocks.1", "blocks.2"]  # again: kept
    with torch.no_grad(), torch.inference_mode():
        checkpointed.eval()(x)  # evaluation runs through the hooks


def test_block_classes_take_the_outermost_modules_and_bad_choices_are_refused():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    assert checkpoint_blocks_(model, (nn.Sequential,), "ZeroStrategy") == ["0"]
    assert checkpoint_blocks_(nn.Sequential(nn.Linear(4, 4)), False, "ZeroStrategy") == []
    with pytest.raises(ValueError, match=r"activation_checkpointing=\{GRU\}.*no submodule of that class"):
        checkpoint_blocks_(_gpt(), (nn.GRU,), "ZeroStrategy")
    with pytest.raises(ValueError, match=r"activation_checkpointing=True\)` found no repeated blocks in Sequential"):
        checkpoint_blocks_(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), True, "ZeroStrategy")
    assert check_activation_checkpointing(nn.Linear, "ZeroStrategy") == (nn.Linear,)
    assert check_activation_checkpointing({nn.Linear}, "ZeroStrategy") == (nn.Linear,)
    for bad in ("yes", [int], set(), 1):
        with pytest.raises(TypeError, match=r"ZeroStrategy\(activation_checkpointing="):
            check_activation_checkpointing(bad, "ZeroStrategy")
    from lightning_bigtrain.strategies import DeepSpeedZeroStrategy, ZeroStrategy, zero_strategy

    for make in (ZeroStrategy, DeepSpeedZeroStrategy, zero_strategy):  # at construction
        with pytest.raises(TypeError, match=r"Strategy\(activation_checkpointing='yes'\)"):
            make(3, activation_checkpointing="yes")
    from lightning_bigtrain.strategies import CompressedDDPStrategy

    with pytest.raises(TypeError, match=r"CompressedDDPStrategy\(activation_checkpointing='yes'\)"):
        CompressedDDPStrategy("powersgd", activation_checkpointing="yes")
    assert ZeroStrategy(3, activation_checkpointing=nn.Linear).activation_checkpointing == (nn.Linear,)


def test_a_plan_counting_activation_checkpointing_configures_the_strategy_to_do_it():
    """`bigtrain plan --activation-checkpointing` wrote `strategy: bigtrain_zero3`: the run kept every activation the
    plan counted as recomputed."""
    assert strategy_config("zero3") == "bigtrain_zero3"
    assert strategy_config("zero3", True)["init_args"] == {"stage": 3, "activation_checkpointing": True}
    assert strategy_config("zero3_offload", True)["init_args"] == {
        "stage": 3, "offload_optimizer": True, "offload_params": True, "activation_checkpointing": True}  # fmt: skip
    assert strategy_config("zero1_pp2", True)["init_args"]["activation_checkpointing"] is True
    with pytest.raises(ValueError, match="Lightning's DDP does not checkpoint activations"):
        strategy_config("ddp", True)
    model = _gpt()
    result = plan(model, devices=2, batch_shape=(4, 16), accelerator="cpu", activation_checkpointing=True)
    assert result.recommendation != "ddp"
    strategy = result.trainer_config()["strategy"]
    assert strategy["init_args"]["activation_checkpointing"] is True, strategy


def test_a_hugging_face_gpt2_built_from_a_config_checkpoints_its_layers_with_the_same_gradients():
    """A model we did not write: the repeated blocks found are GPT-2's layers; dropout replayed in the recomputation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def model() -> nn.Module:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.2,
                            embd_pdrop=0.2, attn_pdrop=0.2)  # fmt: skip
        return GPT2LMHeadModel(config)

    def grads(m: nn.Module) -> tuple[list[torch.Tensor], int]:
        """The gradients, and how many tensors the forward saved for backward outside checkpointed regions."""
        torch.manual_seed(1)
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
            loss = m(input_ids=x, labels=x).loss
        loss.backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None], len(saved)

    plain, checkpointed = model(), model()
    assert checkpoint_blocks_(checkpointed, True, "ZeroStrategy") == ["transformer.h.0", "transformer.h.1"]
    (expected, kept), (got, kept_checkpointed) = grads(plain), grads(checkpointed)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert kept_checkpointed < kept / 2, (kept_checkpointed, kept)  # the layers' activations are not kept


def test_hugging_face_t5_decoder_layers_recompute_without_the_cross_attention_cache():
    """T5 builds a key/value cache in training (``use_cache`` defaults to True): its decoder's cross-attention filled
    it in forward and read it back in the recomputation, a different graph (torch.utils.checkpoint refused it: "A
    different number of tensors was saved"). Its layers are checkpointed through their own switch, without the cache.
    A model whose user enabled Hugging Face's checkpointing already is left as it is (not checkpointed twice)."""
    from transformers import T5Config, T5ForConditionalGeneration

    def model() -> nn.Module:
        torch.manual_seed(0)
        config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.2,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
        return T5ForConditionalGeneration(config)

    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))

    def grads(m: nn.Module) -> tuple[list[torch.Tensor], int]:
        """The gradients, and how often the first decoder layer's first projection ran."""
        calls = [0]
        m.decoder.block[0].layer[0].SelfAttention.q.register_forward_pre_hook(
            lambda *_: calls.__setitem__(0, calls[0] + 1)
        )
        torch.manual_seed(1)
        m(input_ids=x, labels=y).loss.backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None], calls[0]

    plain, checkpointed = model(), model()
    names = checkpoint_blocks_(checkpointed, True, "ZeroStrategy")
    assert names == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    (expected, once), (got, twice) = grads(plain), grads(checkpointed)
    assert (once, twice) == (1, 2)  # recomputed in backward
    for a, b in zip(expected, got, strict=True):
        # Dropout replayed; equal to rounding (the position bias the layers share sums its gradient in another
        # order; as under Hugging Face's own gradient_checkpointing_enable()).
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    enabled = model()
    enabled.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpoint_blocks_(enabled, True, "ZeroStrategy") == names
    assert grads(enabled)[1] == 2  # once more in backward, not twice more
