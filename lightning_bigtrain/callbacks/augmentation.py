"""BatchAugmentation: MixUp, CutMix, random erasing and token masking on whole batches on the device, with
per-sample random parameters, for any LightningModule."""

from __future__ import annotations

import functools
import numbers
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_bigtrain._logging import is_logging_step
from lightning_bigtrain.functional.augmentation import (
    Mixed,
    mix_batch,
    mixed_targets,
    rand_augment,
    random_erasing,
    token_mask,
)
from lightning_bigtrain.functional.rng import fold_seed

__all__ = ["BatchAugmentation"]

_HOOK = "on_after_batch_transfer"


def _fraction(name: str, value: Any, *, low_open: bool = False, high: float = 1.0, high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`BatchAugmentation({name}={value!r})`: pass a number.")
    value = float(value)
    below = value <= 0.0 if low_open else value < 0.0
    above = value >= high if high_open else value > high
    if below or above:
        bounds = f"{'(' if low_open else '['}0, {high}{')' if high_open else ']'}"
        raise ValueError(f"`BatchAugmentation({name}={value})` must lie in {bounds}.")
    return value


class BatchAugmentation(L.Callback):
    """Augment each training batch as a whole on its device, each sample with its own random parameters.

    RandAugment (``rand_augment=N`` operations per sample at ``magnitude``, on images whose black and white are
    ``value_range``), MixUp (``mixup=alpha``), CutMix (``cutmix=alpha``; with both, each sample picks CutMix with
    probability ``switch_prob``), random erasing (``erasing=p``) for image batches, in that order, and token masking
    (``token_mask=p``) for integer token batches. The formulas and papers are in
    :mod:`lightning_bigtrain.functional.augmentation`.
    Validation, test and predict batches are left alone.

    **Where it acts.** After the batch reaches the device: the callback wraps the ``on_after_batch_transfer`` hook
    that Lightning calls for the run (the datamodule's when the datamodule overrides it, else the module's), so a
    user's own transfer hook runs first and the augmentation sees its output; the wrapped hook still reads as the
    user's to Lightning (no "overridden in both" warning) and is restored in ``teardown``.

    **Mixed targets, without changing training_step.** Two ways, chosen by ``num_classes``:

    - ``num_classes=C``: the batch's targets (class indices ``[B]`` or probabilities ``[B, C]``) become class
      probabilities ``lam y_i + (1 - lam) y_j`` with a ``lam`` per sample. ``F.cross_entropy`` /
      ``nn.CrossEntropyLoss`` take them as they are; a loss that needs class indices (``nll_loss``) fails at the
      first step with a message naming ``num_classes=None``. A training-set metric computed from the targets in
      ``training_step`` sees probabilities (take ``y.argmax(-1)`` there).
    - ``num_classes=None``: the loss itself is mixed, ``lam L(y_i) + (1 - lam) L(y_j)``, for any loss of the
      targets: ``training_step`` runs twice on the mixed inputs, with the targets and with the partners'
      targets, and the second run reuses the first's model output (the module's ``forward`` is answered from it,
      so the model runs once). Values logged with ``self.log`` are mixed the same way (metric objects are logged
      from the first run). One ``lam`` (and box) per batch here, as a mean loss cannot be mixed per sample. A
      ``training_step`` that does not call the module's ``forward`` (``self(x)``) is refused at its first step.

    With :class:`~lightning_bigtrain.callbacks.KnowledgeDistillation` the live teacher sees the augmented inputs;
    its logit cache, addressed by the inputs, misses on mixed ones and runs the teacher (with its warning).

    **Randomness.** Each step's draws are seeded from ``seed`` (default: rank 0's ``torch.initial_seed()`` at setup,
    which ``seed_everything`` sets), the rank and the batch's index in the run, so a resumed run draws exactly what the
    uninterrupted one drew; ``seed`` is in the checkpoint.

    Logged on Lightning's logging steps: ``augment/lam`` (the batch's mean ``lam``; 1.0 when off).
    ``augmented_batches`` counts the training batches this process augmented.

    Args:
        mixup: MixUp's Beta ``alpha`` (0: off; 0.2 is usual).
        cutmix: CutMix's Beta ``alpha`` (0: off; 1.0 is usual).
        switch_prob: With both on, the probability that a sample gets CutMix rather than MixUp.
        erasing: Probability that a sample gets a random-erasing box.
        rand_augment: RandAugment operations per sample (0: off; 2 is usual).
        magnitude: RandAugment's magnitude, 0..30 (9 is usual).
        value_range: The input values of black and white, for RandAugment (``(0, 1)`` for images in [0, 1];
            standardised images: ``((0 - mean) / std, (1 - mean) / std)``). Inputs outside it are refused.
        token_mask: Probability that an input token is replaced by ``mask_token``.
        mask_token: The id that masked tokens take (needed with ``token_mask``).
        num_classes: Classes of the targets, to mix them as probabilities; ``None`` mixes the loss instead.
        until: Fraction of the run's optimizer steps during which batches are augmented (``0.9``: the last 10%
            train on clean batches).
        input_key: Where the inputs are in the batch (a tuple/list index or a dict key).
        target_key: Where the targets are.
        seed: Base seed of the draws (``None``: ``torch.initial_seed()`` at setup).
    """

    def __init__(
        self,
        mixup: float = 0.0,
        cutmix: float = 0.0,
        *,
        switch_prob: float = 0.5,
        erasing: float = 0.0,
        rand_augment: int = 0,
        magnitude: int = 9,
        value_range: tuple[float, float] = (0.0, 1.0),
        token_mask: float = 0.0,
        mask_token: int | None = None,
        num_classes: int | None = None,
        until: float = 1.0,
        input_key: int | str = 0,
        target_key: int | str = 1,
        seed: int | None = None,
    ) -> None:
        for name, value in (("mixup", mixup), ("cutmix", cutmix)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
                raise ValueError(f"`BatchAugmentation({name}={value!r})` is Beta's alpha: pass a number >= 0 (0: off).")
        self.mixup, self.cutmix = float(mixup), float(cutmix)
        self.switch_prob = _fraction("switch_prob", switch_prob)
        self.erasing = _fraction("erasing", erasing)
        if isinstance(rand_augment, bool) or not isinstance(rand_augment, int) or rand_augment < 0:
            raise ValueError(f"`BatchAugmentation(rand_augment={rand_augment!r})`: operations per sample, an int >= 0.")
        if isinstance(magnitude, bool) or not isinstance(magnitude, int) or not 0 <= magnitude <= 30:
            raise ValueError(
                f"`BatchAugmentation(magnitude={magnitude!r})`: RandAugment's magnitude, an int in [0, 30]."
            )
        try:
            low, high = (float(v) for v in value_range)
        except (TypeError, ValueError):
            low, high = 0.0, -1.0
        if not low < high:
            raise ValueError(
                f"`BatchAugmentation(value_range={value_range!r})`: pass (black, white) with black < white."
            )
        self.rand_augment, self.magnitude, self.value_range = rand_augment, magnitude, (low, high)
        self.token_mask = _fraction("token_mask", token_mask, high_open=True)
        self.until = _fraction("until", until, low_open=True)
        if self.token_mask and (isinstance(mask_token, bool) or not isinstance(mask_token, int) or mask_token < 0):
            raise ValueError(
                f"`BatchAugmentation(token_mask={token_mask}, mask_token={mask_token!r})`: pass the id that masked "
                "tokens take, an int >= 0."
            )
        if self.token_mask and (self.mixup or self.cutmix or self.erasing or self.rand_augment):
            raise ValueError(
                "`BatchAugmentation(token_mask=...)` is for token batches and rand_augment/mixup/cutmix/erasing for "
                "image batches: pass one kind."
            )
        if not (self.mixup or self.cutmix or self.erasing or self.token_mask or self.rand_augment):
            raise ValueError(
                "`BatchAugmentation()` with every augmentation off does nothing: pass rand_augment=, mixup=, cutmix=, "
                "erasing= or token_mask=."
            )
        if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                                        or num_classes < 2):  # fmt: skip
            raise ValueError(f"`BatchAugmentation(num_classes={num_classes!r})`: pass an int >= 2, or None.")
        if input_key == target_key:
            raise ValueError(f"`BatchAugmentation(input_key={input_key!r}, target_key={target_key!r})` must differ.")
        self.mask_token = mask_token
        self.num_classes = num_classes
        self.input_key, self.target_key = input_key, target_key
        self.seed = seed
        self._wrapped: list[tuple[Any, str, Any]] = []
        self._total_steps = float("inf")
        self._pending: tuple[torch.Tensor, Mixed] | None = None  # loss mixing: (targets, what mix_batch did)
        self._lam = 1.0
        self.augmented_batches = 0  # training batches this process augmented (a count for users and checks)
        self._checked = False
        self._stepped = False  # a training_step has run on soft targets (a later failure is not about their form)
        self._soft_now = False  # this step's targets were made class probabilities
        self._trainer_ref: L.Trainer | None = None

    @property
    def mixes(self) -> bool:
        return bool(self.mixup or self.cutmix)

    # ---------------------------------------------------------------- setup and teardown

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.seed is None:  # rank 0's, so that a checkpoint's (rank 0's) seed is every rank's
            self.seed = int(trainer.strategy.broadcast(int(torch.initial_seed())))
        self._trainer_ref = trainer
        datamodule = getattr(trainer, "datamodule", None)
        owner: Any = datamodule if datamodule is not None and is_overridden(_HOOK, datamodule) else pl_module
        self._wrap(owner, _HOOK, self._after_transfer)
        if self.mixes:
            self._wrap(pl_module, "training_step", self._training_step)

    def _wrap(self, owner: Any, name: str, replacement: Any) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)  # `__wrapped__`: Lightning's is_overridden still sees the user's hook
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return replacement(original, *args, **kwargs)

        self._wrapped.append((owner, name, vars(owner).get(name)))  # an instance-level hook is put back as it was
        setattr(owner, name, wrapped)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._total_steps = float(trainer.estimated_stepping_batches)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for owner, name, own in reversed(self._wrapped):
            if own is not None:
                setattr(owner, name, own)
            elif name in vars(owner):
                delattr(owner, name)
        self._wrapped.clear()
        self._pending = None
        self._trainer_ref = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seed = state_dict.get("seed", self.seed)

    # ---------------------------------------------------------------- the augmentation

    def _active(self, trainer: L.Trainer) -> bool:
        return trainer.training and trainer.global_step < self.until * self._total_steps

    def _generators(self, trainer: L.Trainer, device: torch.device) -> tuple[np.random.Generator, torch.Generator]:
        index = trainer.fit_loop.epoch_loop.batch_progress.total.ready  # restored exactly on resume
        seed = fold_seed(fold_seed(int(self.seed or 0) & (2**63 - 1), trainer.global_rank), index)
        return np.random.default_rng(seed), torch.Generator(device=device).manual_seed(seed)

    def _get(self, batch: Any, key: int | str, what: str) -> torch.Tensor:
        try:
            value = batch[key]
        except (KeyError, IndexError, TypeError):
            raise ValueError(
                f"BatchAugmentation({what}={key!r}): the training batch ({type(batch).__name__}) has no such entry; "
                f"pass {what}= naming where it is."
            ) from None
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"BatchAugmentation({what}={key!r}): that entry is a {type(value).__name__}, not a tensor."
            )
        return value

    @staticmethod
    def _put(batch: Any, key: int | str, value: torch.Tensor) -> Any:
        """The batch with ``batch[key]`` replaced (a new container of the same kind)."""
        if isinstance(batch, dict):
            return {**batch, key: value}
        items = list(batch)
        items[key] = value  # type: ignore[index]
        if isinstance(batch, tuple):
            return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
        return items

    def _check(self, inputs: torch.Tensor) -> None:
        if self._checked:
            return
        if self.token_mask:
            if inputs.is_floating_point():
                raise ValueError(
                    f"`BatchAugmentation(token_mask=...)` masks integer token ids; the inputs are {inputs.dtype}. Use "
                    "mixup=/cutmix=/erasing= for images."
                )
        else:
            if not inputs.is_floating_point():
                raise ValueError(
                    f"`BatchAugmentation(mixup/cutmix/erasing)` mixes floating-point inputs; these are {inputs.dtype} "
                    "(token ids?). Use token_mask= for token batches."
                )
            if (self.cutmix or self.erasing or self.rand_augment) and not 3 <= inputs.dim() <= 4:
                raise ValueError(
                    f"`BatchAugmentation(rand_augment/cutmix/erasing)` works on images [batch, (channels,) height, "
                    f"width]; the inputs have shape {tuple(inputs.shape)}. Use mixup= alone for flat inputs."
                )
            if self.rand_augment:
                self._check_range(inputs)
        self._checked = True

    def _check_range(self, inputs: torch.Tensor) -> None:
        """Inputs beyond ``value_range`` (standardised images with the default (0, 1)) would be clipped to black or
        white by every RandAugment operation: refused, with the range the inputs have. Checked on the first
        batch only, with the others of :meth:`_check` (on an accelerator the check waits for the device)."""
        low, high = self.value_range
        slack = 1e-3 * (high - low)
        lo, hi = float(inputs.amin()), float(inputs.amax())
        if lo < low - slack or hi > high + slack:
            raise ValueError(
                f"`BatchAugmentation(rand_augment={self.rand_augment}, value_range={self.value_range})`: this batch's "
                f"inputs span [{lo:.3g}, {hi:.3g}]. Pass the values your images give black and white, e.g. "
                "value_range=((0 - mean) / std, (1 - mean) / std) for images standardised with mean and std."
            )

    def _soft_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        soft, self._soft_now = self._soft_now, False
        if self._stepped or not soft:
            return original(*args, **kwargs)
        try:
            out = original(*args, **kwargs)
        except (RuntimeError, ValueError, TypeError) as err:
            raise type(err)(
                f"{err}\n\nBatchAugmentation(num_classes={self.num_classes}) gave training_step class-probability "
                f"targets [batch, {self.num_classes}]. If its loss needs class indices (nll_loss, a metric of the "
                "targets), pass num_classes=None to mix the loss instead of the targets."
            ) from err
        self._stepped = True
        return out

    def _after_transfer(self, original: Any, batch: Any, dataloader_idx: int) -> Any:
        batch = original(batch, dataloader_idx)
        trainer = getattr(self, "_trainer_ref", None)
        if trainer is None or not self._active(trainer):
            self._lam = 1.0
            return batch
        inputs = self._get(batch, self.input_key, "input_key")
        self._check(inputs)
        rng, generator = self._generators(trainer, inputs.device)
        if self.token_mask:
            assert self.mask_token is not None
            self._lam = 1.0
            self.augmented_batches += 1
            return self._put(batch, self.input_key, token_mask(inputs, generator, self.token_mask, self.mask_token))
        lam = 1.0
        if self.rand_augment:
            inputs = rand_augment(inputs, rng, num_ops=self.rand_augment, magnitude=self.magnitude,
                                  value_range=self.value_range)  # fmt: skip
        if self.mixes:
            targets = self._get(batch, self.target_key, "target_key")
            mixed = mix_batch(inputs, rng, mixup=self.mixup, cutmix=self.cutmix, switch_prob=self.switch_prob,
                              per_sample=self.num_classes is not None)  # fmt: skip
            inputs = mixed.inputs
            lam = float(mixed.lam.mean())
            if self.num_classes is not None:
                batch = self._put(batch, self.target_key, mixed_targets(targets, mixed, self.num_classes))
                self._soft_now = True
            else:
                self._pending = (targets, mixed)
        if self.erasing:
            inputs = random_erasing(inputs, rng, generator, self.erasing)
        self._lam = lam
        self.augmented_batches += 1
        return self._put(batch, self.input_key, inputs)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._pending = None
        if is_logging_step(trainer) and trainer.loggers:
            pl_module.log("augment/lam", self._lam, on_step=True, on_epoch=False)

    # ---------------------------------------------------------------- loss mixing (num_classes=None)

    def _training_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        pending, self._pending = self._pending, None
        if self.num_classes is not None:
            return self._soft_step(original, *args, **kwargs)
        if pending is None:
            return original(*args, **kwargs)
        pl_module = getattr(original, "__self__", None)
        assert isinstance(pl_module, L.LightningModule)
        targets, mixed = pending
        lam = float(mixed.lam[0])
        batch, rest = args[0], args[1:]
        outputs: list[Any] = []
        logged: list[list[tuple[str, Any, dict[str, Any]]]] = [[], []]
        forward = pl_module.forward

        def record(*f_args: Any, **f_kwargs: Any) -> Any:
            out = forward(*f_args, **f_kwargs)
            outputs.append(out)
            return out

        replay = iter(outputs)

        def answer(*f_args: Any, **f_kwargs: Any) -> Any:
            try:
                return next(replay)
            except StopIteration:
                raise RuntimeError(
                    "BatchAugmentation(num_classes=None): training_step called the module's forward more often with "
                    "the partners' targets than with its own; it must not depend on the targets before the loss."
                ) from None

        def run(which: int, step_batch: Any, fwd: Any) -> Any:
            pl_module.forward = fwd  # type: ignore[method-assign]
            pl_module.log = lambda name, value, **kw: logged[which].append((name, value, kw))  # type: ignore[method-assign]
            try:
                return original(step_batch, *rest, **kwargs)
            finally:
                del pl_module.forward
                del pl_module.log

        out_a = run(0, batch, record)
        if out_a is None:
            return None
        if not outputs:
            raise RuntimeError(
                "BatchAugmentation(mixup/cutmix) with num_classes=None mixes the loss, lam L(y_a) + (1 - lam) L(y_b), "
                "reusing the model's output, but training_step never called the module's forward (self(x)). Pass "
                "num_classes=... to mix the targets as class probabilities instead."
            )
        out_b = run(1, self._put(batch, self.target_key, targets[mixed.partner]), answer)
        partners = {name: value for name, value, _ in logged[1]}
        for name, a, kw in logged[0]:
            b = partners.get(name)
            if isinstance(a, (torch.Tensor, float, int)) and isinstance(b, (torch.Tensor, float, int)):
                a = lam * a + (1 - lam) * b
            pl_module.log(name, a, **kw)

        def loss(out: Any) -> torch.Tensor:
            return out if isinstance(out, torch.Tensor) else out["loss"]

        total = lam * loss(out_a) + (1 - lam) * loss(out_b)
        return total if isinstance(out_a, torch.Tensor) else {**out_a, "loss": total}
