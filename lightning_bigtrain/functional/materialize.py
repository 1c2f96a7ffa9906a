"""Materializing a module built on the meta device, after it was sharded: real storage for this rank's shards only,
every weight initialized as the model would initialize it, identically on every rank."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import sys
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_bigtrain.functional.rng import fold_seed
from lightning_bigtrain.functional.sharding import local_view

__all__ = ["Materialized", "has_meta_tensors", "init_records", "init_seed", "materialize_", "record_init"]

_OPS = "_bigtrain_init_ops"  # on a meta tensor: the in-place initializations applied to it (None: not replayable)
_Op = tuple[Any, tuple[Any, ...], dict[str, Any], "tuple[tuple[int, ...], tuple[int, ...], int] | None"]


class _InitRecorder(TorchDispatchMode):
    """Records, on each meta-device tensor, the in-place operations applied to it (``uniform_``, ``normal_``,
    ``fill_``, ``mul_`` ..., also through a view such as an embedding's padding row), with their arguments, so that
    they can be replayed on real storage. A real tensor argument is kept (``load_state_dict`` of loaded weights
    copies them in: replayed, they land); a meta one (``copy_`` from a tensor computed on meta) makes the record
    unreplayable."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        target = args[0] if args else None
        if (
            isinstance(target, torch.Tensor)
            and target.is_meta
            and func.overloadpacket.__name__.endswith("_")
            and torch.Tag.inplace_view not in func.tags
        ):
            base = target._base if target._base is not None else target
            ops: list[_Op] | None = getattr(base, _OPS, [])
            if ops is not None:
                if any(isinstance(a, torch.Tensor) and a.is_meta for a in tree_leaves((args[1:], kwargs))):
                    ops = None  # computed from other meta tensors: nothing to replay it from
                else:
                    view = (
                        None if target is base else (tuple(target.shape), target.stride(), int(target.storage_offset()))
                    )
                    ops = [*ops, (func, args[1:], dict(kwargs), view)]
            with contextlib.suppress(AttributeError, TypeError):  # (a tensor subclass that takes no attributes)
                setattr(base, _OPS, ops)
        return out


@contextmanager
def record_init() -> Iterator[None]:
    """While active, the in-place initializations a constructor applies to meta-device tensors (``nn.init``
    functions, ``reset_parameters``, ``self.apply(self._init_weights)``, rescaling) are recorded on the tensors, for
    :func:`materialize_` to replay on real storage. Tensors on real devices are untouched. ``nn.init.trunc_normal_``
    returns at once on a meta tensor, before any operation a dispatch mode sees: while active, that one function is
    wrapped (and restored after) so that its call is recorded. A value built out of place and then wrapped in a
    parameter (``nn.Parameter(torch.zeros(n))``) is not recorded: the wrapping is invisible here."""
    original = torch.nn.init.trunc_normal_

    def trunc_normal_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # torch's returns at once on a meta tensor, before any operation this could record: record the call.
        if not tensor.is_meta or tensor._base is not None:
            return original(tensor, *args, **kwargs)
        ops: list[_Op] | None = getattr(tensor, _OPS, [])
        if ops is not None:
            ops = [*ops, (original, args, kwargs, None)]
        with contextlib.suppress(AttributeError, TypeError):
            setattr(tensor, _OPS, ops)
        return tensor

    torch.nn.init.trunc_normal_ = trunc_normal_  # (while recording only)
    try:
        with _InitRecorder():
            yield
    finally:
        torch.nn.init.trunc_normal_ = original


def init_records(module: nn.Module) -> dict[str, list[_Op] | None]:
    """The recorded initializations of ``module``'s meta tensors by qualified name (every name of a tied tensor).
    Read them before sharding: sharding replaces the parameter objects that carry them."""
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    )
    return {name: getattr(t, _OPS) for name, t in named if t.is_meta and hasattr(t, _OPS)}


def _replay(t: torch.Tensor, ops: list[_Op]) -> None:
    def here(a: Any) -> Any:
        return a.to(t.device) if isinstance(a, torch.Tensor) else a

    for func, args, kwargs, view in ops:
        target = t if view is None else t.as_strided(*view)
        func(target, *(here(a) for a in args), **{k: here(v) for k, v in kwargs.items()})


def _last_load(ops: list[_Op]) -> int | None:
    """Index of the last operation that copied real values over the whole tensor (``load_state_dict``), if any."""
    for i in range(len(ops) - 1, -1, -1):
        func, args, _, view = ops[i]
        name = getattr(getattr(func, "overloadpacket", None), "__name__", None)
        if name == "copy_" and view is None and args and isinstance(args[0], torch.Tensor):
            return i
    return None


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (or of a submodule) is on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def _hf_owners(root: nn.Module) -> dict[int, nn.Module]:
    """Each submodule's nearest enclosing Hugging Face ``PreTrainedModel`` (itself included), by ``id``."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    owners: dict[int, nn.Module] = {}
    if base is None:
        return owners

    def visit(module: nn.Module, owner: nn.Module | None) -> None:
        if isinstance(module, base) and callable(getattr(module, "_init_weights", None)):
            owner = module
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(root, None)
    return owners


def _reset_method(module: nn.Module) -> Callable[[], None] | None:
    """``reset_parameters()``; torch's ``MultiheadAttention`` and ``Transformer`` name theirs ``_reset_parameters``."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return cast("Callable[[], None]", method)
    return None


def _poison_(t: torch.Tensor) -> None:
    """Fill with a value no initializer writes, so that what none wrote can be found afterwards."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _unwritten(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).any())


def _shared_slots(root: nn.Module) -> list[list[tuple[nn.Module, str, bool]]]:
    """Places (module, attribute, is_parameter) that hold one tensor object, for each tensor held in more than one
    (tied weights). ``to_empty`` gives each place its own new tensor; :func:`_retie_` puts one back in all."""
    places: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for m in root.modules():
        for name, param in m._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((m, name, True))
        for name, buffer in m._buffers.items():
            if buffer is not None:
                places.setdefault(id(buffer), []).append((m, name, False))
    return [group for group in places.values() if len(group) > 1]


def _retie_(groups: list[list[tuple[nn.Module, str, bool]]]) -> None:
    for (first, name, is_param), *rest in groups:
        tensor = (first._parameters if is_param else first._buffers)[name]
        for m, other, other_is_param in rest:
            (m._parameters if other_is_param else m._buffers)[other] = tensor  # type: ignore[assignment]


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    seen: set[int] = set()

    def visit(m: nn.Module) -> Iterator[nn.Module]:
        for child in m.children():
            if id(child) not in seen:
                seen.add(id(child))
                yield from visit(child)
        yield m

    yield from visit(module)


@contextmanager
def _whole(modules: list[nn.Module], targets: Container[int]) -> Iterator[None]:
    """Inside: the sharded (DTensor) parameters among ``targets`` (by ``id``) that ``modules`` hold directly are
    replaced by whole plain tensors (gathered: what earlier initializers wrote, or the poison); on exit each rank
    copies its own shard of the whole tensor back into the DTensor's local storage. Every rank computes the same
    whole tensor (same seed), so the shards fit together as if one rank had initialized the unsharded module."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    swapped: list[tuple[nn.Module, str, DTensor]] = []
    wholes: dict[int, nn.Parameter] = {}  # one whole tensor per DTensor, wherever it is tied
    for m in modules:
        for name, p in list(m._parameters.items()):
            if isinstance(p, DTensor) and id(p) in targets:
                swapped.append((m, name, p))
                if id(p) not in wholes:
                    wholes[id(p)] = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
                m._parameters[name] = wholes[id(p)]
    try:
        yield
    finally:
        for m, name, sharded in swapped:
            m._parameters[name] = sharded  # type: ignore[assignment]  # (a DTensor parameter: FSDP2's)
        for _, _, sharded in swapped:
            whole = wholes.pop(id(sharded), None)
            if whole is not None:
                mine = distribute_tensor(whole.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None)
                sharded.to_local().copy_(mine.to_local())


class Materialized(NamedTuple):
    """What :func:`materialize_` could not initialize as the model would have."""

    #: Tensors no initializer wrote (uninitialized memory): ``(qualified name, restorable)``, restorable when a
    #: checkpoint holds it (a parameter or a persistent buffer; not a non-persistent buffer).
    unwritten: list[tuple[str, bool]]
    #: Tensors whose recorded initialization could not be replayed (computed from other meta tensors), initialized
    #: by ``reset_parameters()`` instead (or left unwritten, then also in ``unwritten``).
    not_replayed: list[str]

    @staticmethod
    def join(parts: list[Materialized]) -> Materialized:
        """One report of a model materialized in parts (:func:`materialize_` with ``within``)."""
        return Materialized([x for p in parts for x in p.unwritten], [x for p in parts for x in p.not_replayed])


def init_seed() -> int:
    """A base seed for :func:`materialize_`, drawn from the default generator (the same on every rank seeded alike).
    Draw it once per model when materializing it in parts."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _module_seed(seed: int, name: str) -> int:
    """The seed a submodule is initialized under: ``seed`` folded with a stable hash of its qualified name."""
    counter = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1
    return fold_seed(seed, counter)


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The default generators (CPU, and ``device``'s when it is an accelerator) seeded with ``seed`` inside; their
    states restored after."""
    if device.type in ("cpu", "meta"):
        with torch.random.fork_rng(devices=[], device_type="cpu"):
            torch.random.default_generator.manual_seed(seed)
            yield
        return
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type), module.device(index):
        torch.random.default_generator.manual_seed(seed)
        module.manual_seed(seed)  # (the current device's generator: ``index``'s)
        yield


def materialize_(
    module: nn.Module,
    device: torch.device,
    records: dict[str, list[_Op] | None] | None = None,
    *,
    within: nn.Module | None = None,
    seed: int | None = None,
) -> Materialized:
    """Give every meta-device parameter and buffer of ``module`` storage on ``device`` and initialize it; returns
    what could not be initialized as the model would have (:class:`Materialized`). With ``within`` (a
    submodule of ``module``), only that submodule's meta tensors (names, records and Hugging Face models are
    ``module``'s): one unit at a time, for an engine that partitions each unit once it is initialized.

    Each submodule is initialized under its own seed, ``seed`` (default: :func:`init_seed`) folded with its
    qualified name: its values do not depend on which other submodules are materialized, or in what order (a
    pipeline stage materializes its own blocks only; DeepSpeed's stage 3 one unit at a time).

    Run after sharding (FSDP2 ``fully_shard``, tensor-parallel splits): each rank then allocates only its shards,
    plus one submodule's whole tensors at a time while that submodule is initialized. Submodules are visited
    children first (the order of ``nn.Module.apply`` and of a Hugging Face model's ``post_init``) and initialized by,
    in turn: a Hugging Face model's own ``_init_weights`` (what ``post_init`` would apply; it may rescale a child's
    weights, GPT-2's residual projections); the initializations recorded while the model was built under
    :func:`record_init` (``records``, by qualified name; read from the tensors themselves when not given), replayed
    tensor by tensor, so that a constructor's own initialization (``self.apply(self._init_weights)``, a rescaling
    after it) is kept, and real values copied in (``load_state_dict``) land, over a Hugging Face init too; then
    ``reset_parameters()`` (``_reset_parameters()`` in torch's attention) for tensors still unwritten. Each
    submodule draws from its own seed: the same distributions as an eager build, not the same draws. A sharded
    parameter is initialized whole on every rank (the same seed gives the same values) and each rank keeps its
    shard, so the values do not depend on the number of ranks or the layout, and need no random-number support from
    DTensor (which has none on CPU). Tied weights stay tied (``to_empty`` alone unties them).
    """
    scope = module if within is None else within
    if not has_meta_tensors(scope):
        return Materialized([], [])
    if records is None:
        records = init_records(module)
    if seed is None:
        seed = init_seed()
    names = {id(m): name for name, m in module.named_modules()}
    slots = [(m, name) for m in scope.modules() for name, t in _own_tensors(m) if t.is_meta]
    tied = _shared_slots(scope)
    for m in {id(m): m for m, _ in slots}.values():
        _to_empty_own(m, device)
    _retie_(tied)
    fresh: dict[int, tuple[nn.Module, str, torch.Tensor]] = {}  # was on meta: poisoned, then initialized
    for m, name in slots:
        t = getattr(m, name)
        fresh.setdefault(id(t), (m, name, t))
    hf = _hf_owners(module)
    by_reset: set[tuple[int, str]] = set()  # (module, name) of tensors a `reset_parameters` fallback wrote
    with torch.no_grad():
        for _, _, t in fresh.values():
            _poison_(local_view(t))
        for m in _post_order(scope):
            own = [name for name, t in _own_tensors(m) if id(t) in fresh]
            owner = hf.get(id(m))
            near = [m, *m.children()]
            if not own and (owner is None or not any(id(t) in fresh for c in near for _, t in _own_tensors(c))):
                continue
            new_near = [(c, name) for c in near for name, t in _own_tensors(c) if id(t) in fresh]
            # Every decision below reads whole tensors, the same on every rank (a shard may be empty on some): each
            # rank takes the same branches, so the gathers inside `_whole` stay matched.
            with _seeded(_module_seed(seed, names.get(id(m), "")), device), _whole(near, fresh):
                if owner is not None:
                    owner._init_weights(m)  # type: ignore[operator]
                for name in own:
                    ops = records.get(_join(names.get(id(m), ""), name))
                    loaded = _last_load(ops) if ops else None
                    if ops and loaded is not None:  # values copied in after the build win, over HF's init too
                        _replay(getattr(m, name), ops[loaded:])
                    elif ops and _unwritten(getattr(m, name)):
                        _replay(getattr(m, name), ops)
                reset = _reset_method(m)
                if reset is not None and any(_unwritten(getattr(m, name)) for name in own):
                    # It re-initializes the module's tensors (and a child's, torch's attention): keep what an
                    # initializer above wrote already (a Linear's replayed weight when only its bias is missing).
                    # A value another reset gave (a child's, as a fallback) is not kept: this module's is the more
                    # specific (torch's attention zeroes its projection's bias).
                    kept = [
                        (c, name, t, t.detach().clone())
                        for c, name in new_near
                        if (id(c), name) not in by_reset and not _unwritten(t := getattr(c, name))
                    ]
                    reset()
                    for _, _, t, value in kept:
                        t.copy_(value)
                    by_reset.update((id(c), name) for c, name in new_near)
                    by_reset.difference_update((id(c), name) for c, name, _, _ in kept)
    unwritten = [
        (_join(names.get(id(m), ""), name), name in m._parameters or name not in m._non_persistent_buffers_set)
        for m, name, t in fresh.values()
        if _unwritten(local_view(t))
    ]
    not_replayed = [
        qualified
        for m, name, _ in fresh.values()
        if id(m) not in hf
        and (qualified := _join(names.get(id(m), ""), name)) in records
        and records[qualified] is None
    ]
    return Materialized(unwritten, not_replayed)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _to_empty_own(module: nn.Module, device: torch.device) -> None:
    """Storage on ``device`` for ``module``'s own meta tensors; its tensors elsewhere (a model partly loaded, a part
    DeepSpeed has partitioned already) are left as they are."""
    own = list(_own_tensors(module))
    if all(t.is_meta for _, t in own):
        module.to_empty(device=device, recurse=False)  # (DTensor parameters too: FSDP2 re-reads them on first use)
        return
    for name, p in list(module._parameters.items()):
        if p is not None and p.is_meta:
            module._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
    for name, b in list(module._buffers.items()):
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty_like(b, device=device)
