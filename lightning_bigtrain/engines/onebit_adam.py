"""Adam with a frozen variance and compressed momentum: the optimizer half of 1-bit Adam (Tang et al., 2021, "1-bit
Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed").

The method: Adam's variance ``v`` becomes stable early in training. For a warm-up of ``T_w`` steps the run is plain
Adam over all-reduced gradients; then ``v`` is frozen, each rank folds its *local* gradient into the shared momentum,
``m_i = beta1 m + (1 - beta1) g_i``, and the ranks exchange ``m_i`` compressed with error feedback (1 bit per entry
with :class:`~lightning_bigtrain.functional.compression.OneBit`); the average ``m`` is the same on every rank, and the
update ``m_hat / (sqrt(v_hat) + eps)`` uses the variance of the last warm-up step. Because ``v`` no longer moves, the
update is linear in ``m``: compressing the momentum with error feedback is then the EF-SGD setting, whose
convergence is known, where compressing the gradient under a moving ``v`` is not (the paper's Section 3).

Gradients are not exchanged at all after the warm-up (the strategy's DDP hook returns each rank's own gradient), so
the bytes per step are the compressed momentum's: 32x fewer than an fp32 all-reduce at 2 ranks with ``OneBit``.

A variance frozen for good is what the paper does, and it costs a short run its quality when the variance has not
settled by the end of the warm-up (our char-GPT: AdamW betas (0.9, 0.95), a 20-step LR warm-up, frozen at step 15;
``docs/compression.md`` has the ablation). 0/1 Adam (Lu et al., 2022, "Maximizing Communication Efficiency for
Large-scale Training via 0/1 Adam") keeps updating the variance at sparse steps instead. Ours does that at a fixed
interval (``variance_refresh``, default every 8th compressed-phase step), from one of two sources (``refresh_from``):

- ``"gradients"`` (the default): on a refresh step the ranks exchange that step's gradients with 8-bit stochastic
  rounding (unbiased, a quarter of fp32's bytes) instead of the momentum, and both the momentum and the variance
  are updated from that average as in a warm-up step; the one sample stands for the ``K`` steps since the last
  one, ``v <- beta2^K v + (1 - beta2^K) g^2``, so its time constant in steps stays Adam's. Bytes per compressed-
  phase step with ``OneBit`` at 2 ranks: ``((K - 1) / 32 + 1 / 3.94) / K`` of dense, about 1/17 at ``K = 8``.
- ``"squares"``: every step each rank folds its *own* squared gradient into its own running second moment (an EMA
  with Adam's ``beta2``, one more buffer the size of the parameters; no bytes). A refresh averages the ranks' second
  moments (their square roots, in 8 bits) and turns them into the variance of the *averaged* gradient, which is what
  Adam's ``v`` measures: with ``W`` ranks whose gradients have mean ``mu`` and noise ``sigma^2`` each, ``E[g_i^2] =
  mu^2 + sigma^2`` but ``E[g_bar^2] = mu^2 + sigma^2 / W``, so ``v = s / W + (1 - 1 / W) mu^2`` with ``s`` the ranks'
  mean second moment and ``mu`` the averaged momentum (at most ``s``). It summarises every step since the last
  refresh instead of one sample, but did not train the char-GPT better (``docs/compression.md``). The momentum is
  exchanged on a refresh step too: ``(K / 32 + 1 / 3.94) / K`` of dense, over 16x fewer bytes from ``K = 10``.

Between refreshes a frozen variance goes stale in two ways, and both spiked the char-GPT's loss at its peak learning
rate (``docs/compression.md``): a gradient that grows is not damped (Adam's variance would grow in the same step),
and a coordinate whose variance was ~0 when it froze (a token first seen after the warm-up; or one with no momentum,
which ``OneBit`` still sends the tensor's shared magnitude) steps ``m / eps``. Three guards, none of which changes
Adam where its variance is current:

- **Tracked scale** (``track_scale``): every step the ranks all-reduce one number per tensor, the mean of their
  squared local gradients, and keep its EMA (Adam's ``beta2``); the variance in use is the refreshed one times that
  EMA over its value at the last refresh. 4 bytes per tensor per step.
- **Adam's step bound**: with ``m`` and ``v`` averaging the same gradients, ``|m_hat| / sqrt(v_hat) <= B_t``
  (Kingma & Ba, 2015, Section 2.1, in its Cauchy-Schwarz form; :meth:`CompressedMomentumAdam._raise_variance`).
  After the momentum is averaged, ``v`` is raised to ``(m_hat / B_t)^2`` wherever it is below: the same on every
  rank, and a no-op for a variance that is current.
- **Preconditioned exchange** (``preconditioned``): the momentum is exchanged divided by Adam's denominator and
  clipped to the bound on each rank, then multiplied back, so a compressor's shared scale (``OneBit``'s one
  magnitude per tensor) and its error feedback act in the update's units; in the raw momentum's units the shared
  magnitude divided by a small variance is a large step.

:class:`OneBitAdam` is the specification a user passes as ``CompressedDDPStrategy(compression=OneBitAdam(...))``;
:class:`CompressedMomentumAdam` is the optimizer the strategy builds from the module's own ``Adam`` / ``AdamW`` (its
parameter groups, learning rates, betas, eps and weight decay), so ``configure_optimizers`` and LR schedulers stay
as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lightning_bigtrain.engines.compression import GradientCompression
from lightning_bigtrain.functional.compression import COMPRESSION_NAMES, Compressor, allreduce_bytes

__all__ = ["CompressedMomentumAdam", "OneBitAdam"]

#: Where a variance refresh takes the variance from (``OneBitAdam(refresh_from=...)``).
REFRESH_SOURCES = ("squares", "gradients")


class OneBitAdam:
    """Compressed-momentum Adam for ``CompressedDDPStrategy(compression=OneBitAdam(...))``.

    The module's optimizer must be ``torch.optim.Adam`` or ``AdamW`` (``amsgrad=False``); the strategy steps an
    equivalent :class:`CompressedMomentumAdam` instead, with the same parameter groups (so LR schedulers act on it).

    Args:
        warmup_steps: Optimizer steps of plain Adam over all-reduced fp32 gradients before the variance is frozen:
            an int, or a fraction in ``(0, 1)`` of the run's optimizer steps (``trainer.estimated_stepping_batches``).
            The whole run's bytes are about ``f + (1 - f) r`` of dense, ``r`` the compressed phase's share
            (``1 / 32`` frozen, about ``1 / 17`` refreshed every 8th step, with ``OneBit`` at 2 ranks), so
            ``0.15`` keeps 5x fewer bytes over the run.
        compressor: How the momentum is exchanged (with error feedback): ``OneBit()`` (the paper), or ``TopK``,
            ``PowerSGD``, ``Quantize``, or one of their names. Its own ``warmup_steps`` must be 0 (this warm-up
            is the one that counts).
        variance_refresh: Every how many compressed-phase steps the variance is refreshed (an int >= 2; the module
            docstring has the method), or ``None`` for the paper's variance frozen after the warm-up. ``8`` keeps
            the compressed phase over 16x fewer bytes than fp32 with ``OneBit`` (about 1/17 at 2 ranks; with
            ``refresh_from="squares"``, which also sends the momentum on a refresh step, ``10`` does).
        track_scale: Between refreshes, scale each tensor's variance by its gradient's tracked mean square (one
            number per tensor all-reduced per step), so a gradient that grows damps its steps at once as Adam's
            variance would. ``False``: the variance moves only at refreshes.
        preconditioned: Exchange the momentum divided by Adam's denominator (the update's units, each rank's
            bounded by Adam's own step bound), so the compressor's shared scale and its error feedback weigh every
            coordinate by its step, not by its raw momentum. ``False``: the raw momentum, as the paper.
        refresh_from: ``"gradients"``: a refresh averages one step's gradients instead of that step's momentum and
            folds their square in. ``"squares"``: it averages the ranks' own running second moments (kept every
            step, one more buffer the size of the parameters per rank) into the averaged gradient's variance.
        refresh_bits: The stochastic rounding of a refresh's exchange, 8 (a quarter of fp32's bytes) or 4 (an
            eighth: refreshing every 4th step then keeps the compressed phase over 16x fewer bytes with ``OneBit``
            at 2 ranks, ``(3 / 32 + 1 / 7.76) / 4`` of dense). 4-bit samples overstate small squares (rounding
            noise adds to ``g^2``), so the variance errs large: smaller steps.
    """

    def __init__(
        self,
        warmup_steps: int | float = 0.15,
        compressor: Compressor | str = "onebit",
        variance_refresh: int | None = 8,
        track_scale: bool = True,
        preconditioned: bool = True,
        refresh_from: str = "gradients",
        refresh_bits: int = 8,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, float)):
            raise TypeError(f"`OneBitAdam(warmup_steps={warmup_steps!r})`: pass an int or a fraction in (0, 1).")
        if isinstance(warmup_steps, float) and not 0.0 < warmup_steps < 1.0:
            raise ValueError(
                f"`OneBitAdam(warmup_steps={warmup_steps})`: a float is a fraction of the run's steps and must lie "
                "in (0, 1); pass an int for a number of steps."
            )
        if isinstance(warmup_steps, int) and warmup_steps < 1:
            raise ValueError(
                f"`OneBitAdam(warmup_steps={warmup_steps})`: the variance is frozen after the warm-up, so at least "
                "one step of plain Adam is needed (the paper warms up for 15-25% of training)."
            )
        if isinstance(compressor, str):
            if compressor not in COMPRESSION_NAMES:
                raise ValueError(
                    f"`OneBitAdam(compressor={compressor!r})` is not supported: pass a compressor or one of "
                    f"{', '.join(repr(k) for k in COMPRESSION_NAMES)}."
                )
            compressor = COMPRESSION_NAMES[compressor]()
        if not isinstance(compressor, Compressor):
            raise TypeError(f"`OneBitAdam(compressor={compressor!r})`: pass a Compressor or its name.")
        if compressor.name == "auto":  # AutoCompression: a timed choice of gradient exchanges, not a momentum codec
            raise ValueError(
                f"`OneBitAdam(compressor={compressor!r})` is not supported: the momentum is exchanged by one "
                "compressor with error feedback (OneBit, TopK, PowerSGD, Quantize); 'auto' picks a gradient "
                "exchange under CompressedDDPStrategy(compression='auto')."
            )
        if compressor.warmup_steps:
            raise ValueError(
                f"`OneBitAdam(compressor={compressor!r})`: the compressor's own warmup_steps must be 0; set "
                "`OneBitAdam(warmup_steps=...)` instead."
            )
        if not compressor.error_feedback:
            raise ValueError(
                f"`OneBitAdam(compressor={compressor!r})` needs error feedback on the momentum (the method's "
                "convergence rests on it): leave `error_feedback` at its default or set it True."
            )
        if variance_refresh is not None and (
            isinstance(variance_refresh, bool) or not isinstance(variance_refresh, int) or variance_refresh < 2
        ):
            raise ValueError(
                f"`OneBitAdam(variance_refresh={variance_refresh!r})`: pass an int >= 2 (every how many compressed "
                "steps the variance is refreshed from 8-bit averaged gradients), or None to keep it frozen."
            )
        for name, flag in (("track_scale", track_scale), ("preconditioned", preconditioned)):
            if not isinstance(flag, bool):
                raise TypeError(f"`OneBitAdam({name}={flag!r})`: pass True or False.")
        if refresh_from not in REFRESH_SOURCES:
            raise ValueError(
                f"`OneBitAdam(refresh_from={refresh_from!r})`: pass 'squares' (each rank's running mean of its "
                "squared gradients, averaged at a refresh) or 'gradients' (one 8-bit averaged gradient per refresh)."
            )
        if refresh_from == "squares" and variance_refresh is None:
            raise ValueError(
                "`OneBitAdam(refresh_from='squares', variance_refresh=None)`: a frozen variance is never refreshed, "
                "so there is nothing to refresh it from; pass variance_refresh=10 (or another int >= 2), or leave "
                "refresh_from at 'gradients'."
            )
        if isinstance(refresh_bits, bool) or refresh_bits not in (4, 8):
            raise ValueError(
                f"`OneBitAdam(refresh_bits={refresh_bits!r})`: a refresh averages with 8- or 4-bit stochastic "
                "rounding; pass 8 or 4."
            )
        self.refresh_bits = refresh_bits
        self.refresh_from = refresh_from
        self.warmup_steps = warmup_steps
        self.compressor = compressor
        self.variance_refresh = variance_refresh
        self.track_scale = track_scale
        self.preconditioned = preconditioned

    def resolve_warmup(self, total_steps: float) -> int:
        """The warm-up in optimizer steps for a run of ``total_steps`` (at least 1)."""
        if isinstance(self.warmup_steps, int):
            return self.warmup_steps
        if not math.isfinite(total_steps):
            raise ValueError(
                f"`OneBitAdam(warmup_steps={self.warmup_steps})` is a fraction of the run, but the run has no "
                "known length (max_steps=-1 and max_epochs=-1): pass an int number of steps."
            )
        return max(1, round(self.warmup_steps * total_steps))

    def __repr__(self) -> str:
        return (
            f"OneBitAdam(warmup_steps={self.warmup_steps!r}, compressor={self.compressor!r}, "
            f"variance_refresh={self.variance_refresh!r}, track_scale={self.track_scale!r}, "
            f"preconditioned={self.preconditioned!r}, refresh_from={self.refresh_from!r}, "
            f"refresh_bits={self.refresh_bits!r})"
        )


class CompressedMomentumAdam(torch.optim.Optimizer):
    """Adam(W) whose momentum is averaged compressed after a dense warm-up, with the variance frozen from then on.

    Built by the strategy from the module's optimizer (:meth:`from_optimizer`): it shares that optimizer's
    ``param_groups`` (learning rate, betas, eps, weight decay; an LR scheduler bound to either acts on both). Its
    state per parameter: ``step``, ``exp_avg`` (the momentum, identical on every rank), ``exp_avg_sq`` (frozen
    after the warm-up but for refreshes), ``frozen_step`` (its count) and with ``track_scale`` ``scale``/``scale_ref``;
    each rank's error-feedback buffers and, with ``refresh_from="squares"``, its running second moments live in
    ``engine`` (checkpointed per rank by the strategy).

    Args:
        params: Parameter groups (see :meth:`from_optimizer`).
        engine: The compression engine that averages the momentum (its compressor's error feedback per parameter).
        warmup_steps: Dense Adam steps before the variance is frozen.
        decoupled: AdamW's decoupled weight decay (else Adam's L2 term added to the gradient).
        refresh: The engine that averages in 8 bits at a variance refresh (with ``refresh_every``).
        refresh_every: Every how many compressed-phase steps the variance is refreshed (None: frozen).
        refresh_from: What a refresh averages: the ranks' running second moments or one step's gradients.
        track_scale: Scale each tensor's variance by its tracked gradient scale between refreshes.
        preconditioned: Exchange the momentum in the update's units (divided by Adam's denominator).

    In the compressed phase the variance is also raised wherever the averaged momentum would step a coordinate
    further than Adam ever could (:meth:`_raise_variance`).
    """

    def __init__(
        self,
        params: Any,
        *,
        engine: GradientCompression,
        warmup_steps: int,
        decoupled: bool,
        refresh: GradientCompression | None = None,
        refresh_every: int | None = None,
        track_scale: bool = True,
        preconditioned: bool = True,
        refresh_from: str = "gradients",
        **defaults: Any,
    ) -> None:
        super().__init__(params, defaults)
        if refresh_from not in REFRESH_SOURCES:
            raise ValueError(f"CompressedMomentumAdam(refresh_from={refresh_from!r}): pass one of {REFRESH_SOURCES}.")
        self.refresh_from = refresh_from
        self.preconditioned = preconditioned
        self.track_scale = track_scale
        if (refresh is None) != (refresh_every is None):
            raise ValueError("CompressedMomentumAdam: pass both `refresh` and `refresh_every`, or neither.")
        self.engine = engine
        self.warmup_steps = int(warmup_steps)
        self.decoupled = decoupled
        self.refresh = refresh
        self.refresh_every = refresh_every
        self.steps = 0  # optimizer steps taken (the phase); in state_dict

    @classmethod
    def from_optimizer(
        cls,
        optimizer: torch.optim.Optimizer,
        engine: GradientCompression,
        warmup_steps: int,
        refresh: GradientCompression | None = None,
        refresh_every: int | None = None,
        track_scale: bool = True,
        preconditioned: bool = True,
        refresh_from: str = "gradients",
    ) -> CompressedMomentumAdam:
        """The equivalent of ``optimizer`` (``Adam`` / ``AdamW``), sharing its parameter groups."""
        name = type(optimizer).__name__
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(
                f"`OneBitAdam` replaces the module's Adam or AdamW with its compressed-momentum form, but "
                f"configure_optimizers returned {name}. Return torch.optim.Adam or AdamW, or pick a gradient "
                "compressor (CompressedDDPStrategy(compression='powersgd' | 'topk' | 'onebit' | ...))."
            )
        for group in optimizer.param_groups:
            for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
                if group.get(flag):
                    raise ValueError(f"`OneBitAdam` does not support {name}({flag}=True): construct it without.")
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
            optimizer.param_groups[0].get("decoupled_weight_decay")
        )
        first = optimizer.param_groups[0]
        out = cls(
            [{"params": g["params"]} for g in optimizer.param_groups],
            engine=engine,
            warmup_steps=warmup_steps,
            decoupled=decoupled,
            refresh=refresh,
            refresh_every=refresh_every,
            track_scale=track_scale,
            preconditioned=preconditioned,
            refresh_from=refresh_from,
            lr=first["lr"],
            betas=first["betas"],
            eps=first["eps"],
            weight_decay=first["weight_decay"],
        )
        out.param_groups = optimizer.param_groups  # shared: lr, betas, eps, weight decay and schedulers' keys
        return out

    @property
    def compressing(self) -> bool:
        """Whether this step exchanges the compressed momentum (else plain Adam on all-reduced gradients)."""
        return self.steps >= self.warmup_steps

    @property
    def refreshing(self) -> bool:
        """Whether this compressed-phase step refreshes the variance (from 8-bit averaged gradients) instead of
        exchanging the momentum."""
        if not self.compressing or self.refresh_every is None:
            return False
        return (self.steps - self.warmup_steps + 1) % self.refresh_every == 0

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)  # averaged in place
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["frozen_step"] = 1  # a parameter first seen after the warm-up has no variance (v = 0)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing, refreshing = self.compressing, self.refreshing
        squares = self.refresh_from == "squares" and self.refresh_every is not None
        if compressing and self.track_scale:
            self._track_scale()
        grads = self._averaged_gradients() if refreshing and not squares else {}
        span = self.refresh_every or 1
        # 1. Momentum (and, in the warm-up or at a refresh, variance) from this step's gradients: all-reduced in
        #    the warm-up, 8-bit averaged at a refresh, this rank's own otherwise. Every parameter takes part after
        #    the warm-up (a missing gradient counts as zero), so that every rank exchanges the same tensors.
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if not p.requires_grad or (p.grad is None and not compressing):
                    continue
                state = self._state(p)
                grad = grads.get(p, p.grad)
                if grad is None:
                    grad = torch.zeros_like(p)
                if group["weight_decay"] and not self.decoupled:
                    grad = grad.add(p, alpha=group["weight_decay"])
                state["exp_avg"].lerp_(grad, 1 - beta1)
                if not compressing:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    state["frozen_step"] = state["step"] + 1  # the variance's bias correction, kept when frozen
                elif squares:
                    # This rank's own variance, every step, from where the shared one froze; a refresh averages them.
                    self._local_sq(p, state).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    state["local_step"] += 1
                elif refreshing:
                    # One sample stands for the `span` steps since the last one: weight it as their EMA would.
                    keep = beta2**span
                    state["exp_avg_sq"].mul_(keep).addcmul_(grad, grad, value=1 - keep)
                    state["frozen_step"] += span
                    if "scale" in state:  # the variance is current again: its scale is measured from here
                        state["scale_ref"] = state["scale"].clone()
                state["step"] += 1
        # 2. After the warm-up, but at a refresh: the ranks' momenta averaged, compressed with error feedback; then
        #    the variance raised where the averaged momentum shows it stale (Adam's own bound on a step).
        if compressing and not (refreshing and not squares):
            self._average_momentum()
        if refreshing and squares:
            self._refresh_from_squares()
        if compressing:
            for group in self.param_groups:
                for p in group["params"]:
                    if self.state.get(p):
                        self._raise_variance(self.state[p], group)
        # 3. The update: m_hat / (sqrt(v_hat) + eps), v_hat frozen after the warm-up.
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if not self.state.get(p):
                    continue
                state = self.state[p]
                if group["weight_decay"] and self.decoupled:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                # As torch's Adam writes it (the warm-up then rounds as torch.optim.AdamW does).
                step_size = group["lr"] / (1 - beta1 ** state["step"])
                p.addcdiv_(state["exp_avg"], self._denominator(state, group, compressing), value=-step_size)
        self.steps += 1
        self._opt_called = True  # an LR scheduler re-bound to this optimizer checks it
        return loss

    def _track_scale(self) -> None:
        """The compressed phase's variance follows each tensor's gradient scale: every step the ranks all-reduce one
        number per tensor, the mean of this rank's squared gradient, and keep its EMA (Adam's ``beta2``); the
        frozen (or last refreshed) variance is used times that EMA over its value when the variance was last
        current. A gradient that grows between refreshes then damps its tensor's steps in the same step, as
        Adam's own variance would, for 4 bytes per tensor."""
        groups = {p: g for g in self.param_groups for p in g["params"]}
        params = [p for p in self._params() if self.state.get(p)]
        if not params:
            return
        local = torch.stack([
            p.grad.detach().float().square().mean() if p.grad is not None else p.new_zeros((), dtype=torch.float32)
            for p in params
        ])  # fmt: skip
        self.engine.allreduce(local)
        local.div_(self.engine.world)
        for p, sample in zip(params, local, strict=True):
            state, beta2 = self.state[p], groups[p]["betas"][1]
            if "scale" not in state:  # the first compressed step: the reference is where the variance froze
                state["scale"] = sample.clone()
                state["scale_ref"] = sample.clone()
            else:
                state["scale"].mul_(beta2).add_(sample, alpha=1 - beta2)

    @staticmethod
    def _raise_variance(state: dict[str, Any], group: dict[str, Any]) -> None:
        """``v_hat <- max(v_hat, (m_hat / B_t)^2)``: Adam's update of one coordinate, ``m_hat / sqrt(v_hat)``, is
        at most ``B_t`` when ``m`` and ``v`` average the same gradients (Kingma & Ba, 2015, Section 2.1; by
        Cauchy-Schwarz, ``B_t = (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2)) * sqrt(sum_{k<t} (b1^2 /
        b2)^k)``). A frozen variance breaks that where a coordinate's gradients have grown since it was last
        measured (a token first seen after the warm-up has ``v = 0``): its step is then unbounded. Raising ``v`` to
        the bound leaves every coordinate whose variance is current as it is, and the same on every rank (``m``
        and ``v`` are)."""
        beta1, beta2 = group["betas"]
        t = state["step"]
        bound = _step_bound(beta1, beta2, t)
        # In the un-corrected state: v >= (1 - b2^f) * (m / (1 - b1^t))^2 / B^2, f the variance's own count.
        scale = math.sqrt(1 - beta2 ** state["frozen_step"]) / ((1 - beta1**t) * bound)
        if "scale" in state:  # the bound holds for the variance in use (scaled by the tracked gradient scale)
            scale = scale / _scale_ratio(state).sqrt()
        floor = state["exp_avg"] * scale
        torch.maximum(state["exp_avg_sq"], floor.mul_(floor), out=state["exp_avg_sq"])

    @staticmethod
    def _denominator(state: dict[str, Any], group: dict[str, Any], compressing: bool) -> torch.Tensor:
        """Adam's ``sqrt(v_hat) + eps``, the frozen variance scaled by its tensor's tracked gradient scale."""
        denom = state["exp_avg_sq"].sqrt() / (1 - group["betas"][1] ** state["frozen_step"]) ** 0.5
        if compressing and "scale" in state:
            denom.mul_(_scale_ratio(state).sqrt())
        return denom.add_(group["eps"])

    def _average_momentum(self) -> None:
        """Every rank's momentum replaced by the ranks' compressed average, in place (no copy of the momenta)."""
        params = [p for p in self._params() if self.state.get(p)]
        momenta = [self.state[p]["exp_avg"] for p in params]
        denominators = []
        if self.preconditioned:  # exchanged in the update's units, each rank's bounded as Adam's would be
            groups = {p: g for g in self.param_groups for p in g["params"]}
            for p, m in zip(params, momenta, strict=True):
                state, group = self.state[p], groups[p]
                d = self._denominator(state, group, True)
                beta1, beta2 = group["betas"]
                limit = _step_bound(beta1, beta2, state["step"]) * (1 - beta1 ** state["step"])
                m.div_(d).clamp_(-limit, limit)
                denominators.append(d)
        self.engine.exchange_now(self.engine.tensor_segments(momenta, params))
        for m, d in zip(momenta, denominators, strict=False):
            m.mul_(d)

    def _local_sq(self, p: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """This rank's running second moment of ``p``'s gradient. It differs between ranks, so it is kept in the
        engine's per-rank state (checkpointed per rank, like the error-feedback buffers), not in the optimizer's
        state (saved from rank 0 only); where it is missing (the first compressed step, or a checkpoint written at
        another world size) it starts from the shared variance."""
        key = self.engine.param_name(p)
        local = self.engine.rank_state.get(key)
        if local is None or local.shape != p.shape or "local_step" not in state:
            local = self.engine.rank_state[key] = state["exp_avg_sq"].clone()
            state["local_step"] = state["frozen_step"]
        elif local.device != p.device:
            local = self.engine.rank_state[key] = local.to(p.device)
        return local

    def _refresh_from_squares(self) -> None:
        """The shared variance re-estimated from every rank's own second moment (its EMA of its squared gradients,
        kept every step): the variance Adam would have, that of the *averaged* gradient, is ``E[g_bar^2] = mu^2 +
        sigma^2 / W`` where each rank's is ``E[g_i^2] = mu^2 + sigma^2`` (``W`` ranks, noise ``sigma^2`` per rank),
        so ``v = s / W + (1 - 1 / W) mu^2`` with ``s`` the ranks' mean second moment and ``mu^2`` estimated by the
        averaged momentum's square (bias-corrected, at most ``s``). ``s`` is averaged from the ranks' root mean
        squares with 8-bit stochastic rounding, then squared. Only the bytes are counted on the momentum's engine:
        the dense equivalent of the step is its momentum's exchange."""
        groups = {p: g for g in self.param_groups for p in g["params"]}
        params = [p for p in self._params() if "local_step" in self.state.get(p, {})]
        roots = [self._local_sq(p, self.state[p]).sqrt() for p in params]
        self._refresh_exchange(roots, params, count_dense=False)
        world = self.engine.world
        for p, root in zip(params, roots, strict=True):
            state, (beta1, beta2) = self.state[p], groups[p]["betas"]
            f = state["local_step"]
            second = root.square_().div_(1 - beta2**f)  # the ranks' mean second moment, bias-corrected
            v = _variance_of_the_mean(second, state["exp_avg"] / (1 - beta1 ** state["step"]), world)
            state["exp_avg_sq"].copy_(v.mul_(1 - beta2**f))  # stored un-corrected, with its count
            state["frozen_step"] = f
            if "scale" in state:  # the variance is current again: its scale is measured from here
                state["scale_ref"] = state["scale"].clone()

    def _averaged_gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """This step's gradients averaged over the ranks with 8-bit stochastic rounding (a refresh step; the DDP
        hook left each rank its own). The bytes are counted on the momentum's engine."""
        assert self.refresh is not None
        params = [p for p in self._params() if self.state.get(p)]
        grads = [p.grad.contiguous() if p.grad is not None else torch.zeros_like(p) for p in params]
        self._refresh_exchange(grads, params, count_dense=True)
        return dict(zip(params, grads, strict=True))

    def _refresh_exchange(self, tensors: list[torch.Tensor], params: list[torch.Tensor], *, count_dense: bool) -> None:
        """Average ``tensors`` (shaped like ``params``) over the ranks in place with the refresh's 8-bit stochastic
        rounding, its bytes counted on the momentum's engine; its dense equivalent too where it stands in for the
        step's momentum exchange (``count_dense``), not where it comes on top of one."""
        assert self.refresh is not None
        sent, dense = self.refresh.sent_bytes, self.refresh.dense_bytes
        self.refresh.exchange_now(self.refresh.tensor_segments(tensors, params))
        self.refresh.advance()
        self.engine.sent_bytes += self.refresh.sent_bytes - sent
        if count_dense:
            self.engine.dense_bytes += self.refresh.dense_bytes - dense

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["bigtrain_onebit_adam"] = {
            "steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "refreshes": None if self.refresh is None else self.refresh.step,
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        own = state_dict.pop("bigtrain_onebit_adam", None)
        groups = self.param_groups
        super().load_state_dict(state_dict)
        # Keep sharing the module optimizer's group dicts (schedulers hold them); take the loaded values.
        for shared, loaded in zip(groups, self.param_groups, strict=True):
            shared.update({k: v for k, v in loaded.items() if k != "params"})
        self.param_groups = groups
        if own is not None:
            self.steps = int(own["steps"])
            if self.refresh is not None and own.get("refreshes") is not None:
                self.refresh.step = int(own["refreshes"])


def _step_bound(beta1: float, beta2: float, t: int) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` Adam can reach at step ``t`` (``_raise_variance`` has the formula)."""
    r = beta1 * beta1 / beta2
    history = t if r == 1.0 else (1 - r**t) / (1 - r)
    return (1 - beta1) / (1 - beta1**t) * math.sqrt((1 - beta2**t) / (1 - beta2) * history)


def _variance_of_the_mean(second: torch.Tensor, mean: torch.Tensor, world: int) -> torch.Tensor:
    """``E[g_bar^2]`` of the ranks' averaged gradient from their mean second moment ``second`` (``E[g_i^2]``) and
    the gradient's mean ``mean``: ``second / W + (1 - 1 / W) min(mean^2, second)`` (``_refresh_from_squares`` has
    the derivation). Overwrites ``second``."""
    signal = torch.minimum(mean.square(), second)
    return second.div_(world).add_(signal, alpha=1 - 1 / world)


def _scale_ratio(state: dict[str, Any]) -> torch.Tensor:
    """The tracked gradient scale over its value when the variance was last current (1 where either is 0)."""
    scale, ref = state["scale"], state["scale_ref"]
    ok = (scale > 0) & (ref > 0)
    return torch.where(ok, scale / torch.where(ok, ref, 1.0), 1.0)


# The step notes its own call for LR schedulers (`_opt_called`), which torch's schedulers would otherwise patch in
# when built; a scheduler re-bound to this optimizer after it was built would warn that `step` was overridden.
CompressedMomentumAdam.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def phase_hook(optimizer_ref: list[CompressedMomentumAdam | None], bucket: Any) -> Any:
    """DDP comm hook of the compressed-momentum phase: the mean all-reduce in the warm-up (bytes counted), this
    rank's own gradient afterwards (the optimizer exchanges the momentum)."""
    buffer = bucket.buffer()
    optimizer = optimizer_ref[0]
    if optimizer is not None and optimizer.compressing:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    world = dist.get_world_size()
    if optimizer is not None:
        nbytes = buffer.numel() * 4
        optimizer.engine.sent_bytes += allreduce_bytes(buffer.numel() * buffer.element_size(), world)
        optimizer.engine.dense_bytes += allreduce_bytes(nbytes, world)
    buffer.div_(world)
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks the hook's annotations as objects, which `from __future__ import annotations` turns into strings.
phase_hook.__annotations__ = {
    "optimizer_ref": list,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
