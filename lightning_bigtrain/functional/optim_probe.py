"""Whether an optimizer is correct in the layouts the sharding strategies hand it, asked of the optimizer itself.

A ZeRO layout changes what the user's optimizer steps. Stages 1 and 2 (this package's flat engine, and DeepSpeed
at every stage) hand each rank a flat slice of many parameters: correct only for an *element-wise* optimizer, whose
update of an element depends on that element's own gradient and state (SGD, Adam, Lion, ...), not on a parameter's
shape or whole-tensor statistics (Adafactor's factored second moment, LAMB's trust ratio, Muon's orthogonalized
update, LBFGS's dot products). On a slice such an optimizer either fails or, worse, silently runs another algorithm
(DeepSpeed runs torch's Adafactor unfactored). Stage 3, tensor parallelism and this package's flat slices hand it
``DTensor`` shards instead: correct where the optimizer's arithmetic runs on DTensors, which some of torch's own do
not (in-place ops that would need a placement change).

Neither property is readable from a class name, so both are tried, once at setup, on a throwaway copy of the
optimizer (same class, same hyperparameters) over a few small tensors with deterministic values (no random draws:
the run's RNG streams are untouched):

* :func:`slice_step_error`: three steps over one 4x6 parameter, and the same steps over its two flat halves held
  by two independent optimizers (two ranks' slices). An element-wise optimizer gives the same numbers both ways.
* :func:`dtensor_step_error`: two steps over DTensors laid out as the real parameters are (their mesh and
  placements), or as stage 3 would lay them out (sharded on dim 0 over a given mesh). Every rank runs the same
  steps (DTensor arithmetic may communicate), so every rank reaches the same verdict.

The classes in :data:`ELEMENTWISE_OPTIMIZERS` (exact types: a subclass may override ``step``) skip the first probe.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ELEMENTWISE_OPTIMIZERS", "dtensor_step_error", "rebuild_optimizer", "slice_step_error"]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)

# Words of torch's DTensor errors (sharding propagation, in-place ops needing a placement change, plain tensors
# mixed with DTensors). Any other error of a probe step says nothing about the layout: the probe is then silent.
_DTENSOR_WORDS = ("dtensor", "placement", "sharding strategy", "sharding propagation")


def rebuild_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``groups`` (dicts with ``"params"`` and the group's
    hyperparameters), built from the constructor arguments its ``defaults`` name.

    Raises:
        TypeError: The class cannot be built that way (its constructor takes other arguments).
    """
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **kwargs)


def _over(optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` over ``param`` alone, with ``group``'s hyper-parameters."""
    return rebuild_optimizer(optimizer, [{**{k: v for k, v in group.items() if k != "params"}, "params": [param]}])


def _step(optimizer: torch.optim.Optimizer) -> None:
    """One step; a closure (returning a constant loss) where the class requires one (LBFGS)."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        optimizer.step(lambda: 1.0)
    else:
        optimizer.step()


def _values(shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """Deterministic, varied, signed values (no random draws); the two flat halves on scales a factor of 20 apart
    (the parameter's halves one way, the gradients' the other), so that any statistic of a whole tensor (a norm,
    a row or column mean) differs clearly from its halves'."""
    n = 1
    for s in shape:
        n *= s
    index = torch.arange(n, dtype=torch.float32)
    scale = torch.where(index < n // 2, 1.0, 0.05) if salt == 0 else torch.where(index < n // 2, 0.05, 1.0)
    return (torch.sin(index * (0.7 + 0.31 * salt) + salt) * scale).reshape(shape)


def slice_step_error(optimizer: torch.optim.Optimizer) -> str | None:
    """``None`` when ``optimizer`` steps a parameter's flat slices as it steps the whole parameter (element-wise,
    so correct on the flat partitions ZeRO-1/2 and DeepSpeed hand each rank); else what differed.

    Tried for each parameter group's hyperparameters: three steps of a 4x6 parameter, and of its two flat halves
    under two separate copies of the optimizer, compared to a few units in the last place. An optimizer that cannot
    be rebuilt from its ``defaults`` is not judged here (``None``): the engines that rebuild it say so themselves.
    """
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS:
        return None
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        whole = torch.nn.Parameter(_values((4, 6), 0))
        halves = [torch.nn.Parameter(half.clone()) for half in whole.detach().reshape(-1).chunk(2)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                reference = _over(optimizer, group, whole)
            except Exception:
                return None
            try:
                slices = [_over(optimizer, group, h) for h in halves]
            except Exception as err:
                return f"{name} refuses a flat slice of a parameter ({type(err).__name__}: {_first_line(err)})"
            for salt in (1, 2, 3):
                grad = _values((4, 6), salt)
                whole.grad = grad.clone()
                try:
                    _step(reference)
                except Exception:
                    return None
                for half, part, opt in zip(halves, grad.reshape(-1).chunk(2), slices, strict=True):
                    half.grad = part.clone()
                    try:
                        _step(opt)
                    except Exception as err:
                        return f"{name} fails on a flat slice of a parameter ({type(err).__name__}: {_first_line(err)})"
        stepped = torch.cat([h.detach() for h in halves])
        gap = (whole.detach().reshape(-1) - stepped).abs().max().item()
        # Element-wise arithmetic gives the same bits either way (torch's do); a few units in the last place are
        # allowed for kernels that vectorize a tensor's tail differently.
        if not gap <= 4 * torch.finfo(torch.float32).eps * max(1.0, whole.detach().abs().max().item()):
            return (
                f"{name} updates a parameter's flat slices differently from the whole parameter (by up to {gap:.2g} "
                "after three steps): its update depends on the parameter's shape or on statistics of the whole tensor"
            )
    return None


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _probe_layouts(
    optimizer: torch.optim.Optimizer, mesh: Any, flat: bool
) -> list[tuple[int, int, Any, tuple[Any, ...]]]:
    """(group index, ndim, mesh, placements) to try: the DTensor parameters' own layouts, one of each; for plain
    parameters and a given ``mesh``, their ndims sharded on dim 0 over it (stage 3's layout), or with ``flat`` 1-D
    shards (the flat engine's slices)."""
    from torch.distributed.tensor import Shard

    layouts: list[tuple[int, int, Any, tuple[Any, ...]]] = []
    seen: set[tuple[int, int, int, tuple[Any, ...]]] = set()
    for index, group in enumerate(optimizer.param_groups):
        params: Iterable[torch.Tensor] = group["params"]
        for p in params:
            p_mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
            ndim = p.ndim
            if p_mesh is None and mesh is not None and (p.ndim > 0 or flat):
                p_mesh, placements = mesh, (Shard(0),)
                ndim = 1 if flat else p.ndim
            if p_mesh is None or placements is None:
                continue
            key = (index, ndim, id(p_mesh), tuple(placements))
            if key not in seen:
                seen.add(key)
                layouts.append((index, ndim, p_mesh, tuple(placements)))
    return layouts


def dtensor_step_error(optimizer: torch.optim.Optimizer, mesh: Any = None, flat: bool = False) -> str | None:
    """``None`` when ``optimizer`` can step DTensor shards laid out as its parameters are (or, for plain
    parameters, sharded on dim 0 over ``mesh`` as stage 3 would, or as 1-D slices with ``flat``, as stages 1 and 2
    of the flat engine do); else torch's DTensor error, first line.

    Two steps over small DTensors of each (group, ndim, placements) the parameters show. Collective on the mesh:
    call it on every rank, with the same optimizer configuration. Errors that are not DTensor's (the probe's tensors
    do not suit the optimizer) leave the question open: ``None``.
    """
    from torch.distributed.tensor import DTensor

    def shard(salt: int, ndim: int, p_mesh: Any, placements: tuple[Any, ...]) -> Any:
        local = _values((2,) * ndim, salt).to(p_mesh.device_type)
        return DTensor.from_local(local, device_mesh=p_mesh, placements=placements, run_check=False)

    for index, ndim, p_mesh, placements in _probe_layouts(optimizer, mesh, flat):
        group = optimizer.param_groups[index]
        param = torch.nn.Parameter(shard(0, ndim, p_mesh, placements))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                probe = _over(optimizer, group, param)
            except Exception:
                return None
            for salt in (1, 2):
                param.grad = shard(salt, ndim, p_mesh, placements)
                try:
                    _step(probe)
                except Exception as err:
                    text = f"{type(err).__name__}: {_first_line(err)}"
                    return text if any(w in str(err).lower() for w in _DTENSOR_WORDS) else None
    return None
