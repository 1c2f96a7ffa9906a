"""Which parameters require gradients, as at setup, and what changed since.

A data-parallel layout is built over the parameters that are trainable when it is built: DDP's reducer, the flat
partitions of ZeRO stages 1 and 2 and of DeepSpeed. Fine-tuning recipes change that set during the run (Lightning's
``BackboneFinetuning`` unfreezes a backbone at an epoch and adds it to the optimizer; a user's callback may flip
``requires_grad`` on parameters already in the optimizer). Left alone, a parameter unfrozen later is never
all-reduced under DDP (each rank trains it on its own data: the replicas drift apart; Lightning issue 20340), never
stepped under flat partitions (it stays where it was), and a parameter frozen later keeps moving there (momentum and
weight decay on a zero gradient). The strategies watch the set at each training batch and act before the step:
:class:`~lightning_bigtrain.strategies.CompressedDDPStrategy` rebuilds its DDP wrapper, the flat layouts refuse.
"""

from __future__ import annotations

from torch import nn

__all__ = ["TrainableWatch"]


class TrainableWatch:
    """The ``requires_grad`` of every parameter of a module, taken now; :meth:`changes` names those that differ."""

    def __init__(self, module: nn.Module | None) -> None:
        named = module.named_parameters() if module is not None else iter(())
        self._params = [(name, p, p.requires_grad) for name, p in named]

    def changes(self) -> tuple[list[str], list[str]]:
        """(names of parameters trainable now but not then, names frozen now but trainable then)."""
        unfrozen: list[str] = []
        frozen: list[str] = []
        for name, p, then in self._params:
            if p.requires_grad != then:
                (unfrozen if p.requires_grad else frozen).append(name)
        return unfrozen, frozen

    def describe(self) -> str:
        """The changes in words, a few names each."""
        unfrozen, frozen = self.changes()
        from lightning_bigtrain.strategies._common import _listed

        pairs = ((unfrozen, "became trainable"), (frozen, "were frozen"))
        return "; ".join(f"{_listed(names, most=4)} {what}" for names, what in pairs if names)
