"""Activation checkpointing of a model's blocks: each keeps only its input through forward and recomputes its
activations in backward (Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost").

Applied with torch's composable ``checkpoint`` (forward pre/post hooks, non-reentrant): the module tree, the
parameter names and the state-dict keys stay as they are, and the recomputation calls the block whole, hooks
included, so FSDP2 (ZeRO-3) and DeepSpeed's stage 3 gather its parameters again as in the first forward. The
random state is replayed, so dropout draws the same masks in the recomputation: gradients are those of the run
without checkpointing.

Hugging Face transformer layers (``transformers``' ``GradientCheckpointingLayer``: GPT-2's, Llama's, T5's blocks...)
are checkpointed through their own switch instead (the layer's ``gradient_checkpointing``, what the model's
``gradient_checkpointing_enable()`` sets, here per block, non-reentrant): the layer then runs without the key/value
cache, which a decoder would otherwise fill in forward and read back in the recomputation (T5's cross-attention
reused its cached keys and values there: a different graph, refused by torch's check). Only the layer's ``forward``
is recomputed; FSDP2 gathers the block's parameters before its backward and DeepSpeed's stage 3 hooks every
submodule, so both hold them during the recomputation.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from typing import Any

import torch.utils.checkpoint
from torch import nn

__all__ = ["ActivationCheckpointing", "check_activation_checkpointing", "checkpoint_blocks_"]

#: What ``activation_checkpointing=`` takes: True (the repeated blocks, as the planner counts them), False, or the
#: block classes to checkpoint (every outermost submodule of one of them).
ActivationCheckpointing = bool | type[nn.Module] | Iterable[type[nn.Module]]


def check_activation_checkpointing(value: Any, owner: str) -> bool | tuple[type[nn.Module], ...]:
    """``value`` validated at construction: a bool, or a tuple of ``nn.Module`` subclasses."""
    if isinstance(value, bool):
        return value
    classes = (value,) if isinstance(value, type) else tuple(value) if isinstance(value, Iterable) else None
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            f"`{owner}(activation_checkpointing={value!r})`: give True (checkpoint the model's repeated blocks: "
            "its transformer layers), False, or the block classes to checkpoint (e.g. `{MyBlock}`, "
            "`{GPT2Block}`)."
        )
    return classes


def checkpoint_blocks_(model: nn.Module, which: bool | tuple[type[nn.Module], ...], owner: str) -> list[str]:
    """Checkpoint ``model``'s blocks in place; returns their names. ``which=True``: the repeated blocks (children of
    a container whose class occurs at least twice there, the sharding units' rule; what ``plan(...,
    activation_checkpointing=True)`` counts); a tuple of classes: the outermost submodules of those classes. A block
    checkpointed already (a second ``fit``) is left as it is.

    Raises:
        ValueError: Nothing to checkpoint: no repeated blocks, or no submodule of the given classes.
    """
    from torch.distributed._composable import checkpoint
    from torch.distributed._composable.contract import _get_registry

    if which is False:
        return []
    if which is True:
        from lightning_bigtrain.functional.sharding import auto_wrap_targets

        blocks = [b for b in auto_wrap_targets(model, min_params=1) if _is_repeated(model, b)]
        if not blocks:
            raise ValueError(
                f"`{owner}(activation_checkpointing=True)` found no repeated blocks in {type(model).__name__} "
                "(children of a ModuleList/Sequential of one class, such as transformer layers). Give the classes to "
                "checkpoint: `activation_checkpointing={MyBlock}`."
            )
    else:
        inside: set[int] = set()
        blocks = []
        for module in model.modules():
            if id(module) in inside:
                continue
            if isinstance(module, which) and module is not model:
                blocks.append(module)
                inside.update(id(m) for m in module.modules())
        if not blocks:
            listed = ", ".join(c.__name__ for c in which)
            raise ValueError(
                f"`{owner}(activation_checkpointing={{{listed}}})`: {type(model).__name__} has no submodule of "
                f"{'that class' if len(which) == 1 else 'those classes'}. Give classes of its blocks, or True (its "
                "repeated blocks)."
            )
    names = {id(m): n for n, m in model.named_modules()}
    for block in blocks:
        if _hugging_face_layer(block):
            if not block.gradient_checkpointing:  # the user's gradient_checkpointing_enable() did it already
                # Plain attributes of Hugging Face's layer (set with setattr: nn.Module types them as submodules).
                setattr(block, "_gradient_checkpointing_func",  # noqa: B010
                        functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))  # fmt: skip
                setattr(block, "gradient_checkpointing", True)  # noqa: B010
        elif "checkpoint" not in (_get_registry(block) or {}):
            checkpoint(block)
    return [names[id(b)] for b in blocks]


def _hugging_face_layer(block: nn.Module) -> bool:
    """Whether ``block`` is a Hugging Face layer with its own checkpointing switch (``transformers`` is imported
    wherever such a layer exists)."""
    layers = sys.modules.get("transformers.modeling_layers")
    base = getattr(layers, "GradientCheckpointingLayer", None)
    return base is not None and isinstance(block, base) and hasattr(block, "gradient_checkpointing")


def _is_repeated(model: nn.Module, block: nn.Module) -> bool:
    """Whether ``block`` is one of several children of one class in a container (not a large lone submodule, which
    ``auto_wrap_targets`` also returns when no block repeats)."""
    for parent in model.modules():
        if isinstance(parent, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            children = list(parent.children())
            if any(c is block for c in children):
                return sum(type(c) is type(block) for c in children) >= 2
    return False
