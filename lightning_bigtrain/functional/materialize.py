"""Materializing a module built on the meta device, after it was sharded: real storage for this rank's shards only,
every weight initialized as the model would initialize it, identically on every rank."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import sys
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from lightning_bigtrain.functional.rng import fold_seed
from lightning_bigtrain.functional.sharding import local_view

__all__ = ["Materialized", "has_meta_tensors", "init_records", "init_seed", "materialize_", "record_init"]

_OPS = "_bigtrain_init_ops"  # on a meta tensor: the in-place operations applied to it (None: not replayable)
_MADE = "_bigtrain_made"  # on a meta tensor: how its value was made out of place (a `_Ref`; None: not replayable)
_View = tuple[tuple[int, ...], tuple[int, ...], int]  # (shape, stride, storage offset)
#: (operation, its other arguments, keyword arguments, the view of the tensor it wrote; None: the whole tensor)
_Op = tuple[Any, tuple[Any, ...], dict[str, Any], "_View | None"]
_EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


@dataclass(frozen=True, eq=False)
class _Node:
    """An out-of-place operation run on the meta device (``torch.zeros``, ``torch.arange``, ``x * 0.02``) and which
    of its outputs (None: its only one). A meta tensor argument is a :class:`_Ref` to its value at that moment."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    index: int | None


@dataclass(frozen=True, eq=False)
class _Ref:
    """The value of a meta tensor at one point while the model was built: the operation that made its storage, the
    in-place operations applied to that storage since (each with the view it wrote), then the view read."""

    node: _Node
    ops: tuple[_Op, ...]
    view: _View | None


#: A tensor's record: how its value was made (None: not recorded, e.g. made before recording began) and the
#: in-place operations applied to it since.
_Record = tuple[_Ref | None, list[_Op]]


class _Unreplayable(Exception):
    """A meta tensor argument whose value was not recorded (made before recording began, or from such a tensor)."""


def _geometry(t: torch.Tensor) -> _View:
    return tuple(t.shape), t.stride(), int(t.storage_offset())


def _is_ref(x: Any) -> bool:
    return isinstance(x, _Ref)


class _InitRecorder(TorchDispatchMode):
    """Records how each meta-device tensor gets its value, for :func:`materialize_` to compute it on real storage:

    * the out-of-place operation that made its storage (``torch.zeros(d)``, ``torch.ones(d) * 1e-6``,
      ``torch.arange(n)``), as ``_MADE`` on the tensor;
    * the in-place operations applied to that storage since (``uniform_``, ``normal_``, ``fill_``, ``mul_``,
      ``copy_`` ..., also through a view such as an embedding's padding row or a slice of a position table, or
      through ``.data``), with their arguments, as ``_OPS``.

    Both sit on the storage's *holder*: the tensor that made it, until a module registers a tensor on that storage
    (``nn.Parameter(value)`` is a new tensor object on the same storage, which no operation shows: the registration
    hooks call :meth:`adopt`); that tensor then carries the record, which :func:`init_records` reads by name.

    A meta tensor argument is recorded as a :class:`_Ref` to its value at that moment, so that a chain (a sinusoidal
    position table written through slices, a relative-position index) replays whole. A real tensor argument is kept
    (``load_state_dict`` of loaded weights copies them in: replayed, they land). A meta argument whose value was not
    recorded (made before recording began) makes the record unreplayable (None)."""

    def __init__(self) -> None:
        super().__init__()
        self._holders: dict[int, torch.Tensor] = {}  # storage -> the tensor carrying its record (kept alive)
        self._made: dict[int, _Ref | None] = {}  # storage -> how it was made (a deep copy replaces a tensor's dict)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _reads_values(func, args, kwargs):
            valued = self._valued((args, kwargs))
            if valued is not None:  # (else torch's own error: a meta tensor holds no data)
                return func(*valued[0], **valued[1])
        out = func(*args, **kwargs)
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and target.is_meta and func.overloadpacket.__name__.endswith("_"):
            if torch.Tag.inplace_view not in func.tags:
                self.record_inplace(func, target, args[1:], kwargs)
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not any(isinstance(o, torch.Tensor) and o.is_meta for o in outs):
            return out
        read = {_storage(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_meta}
        try:
            captured_args, captured_kwargs = self._capture((args, dict(kwargs)))
        except _Unreplayable:
            captured_args = None
        for i, o in enumerate(outs):
            if not isinstance(o, torch.Tensor) or not o.is_meta or _storage(o) in read:
                continue  # (a view of an argument: its value is read through the argument's record)
            made = None
            if captured_args is not None:
                made = _Ref(_Node(func, captured_args, captured_kwargs, None if o is out else i), (), None)
            with contextlib.suppress(AttributeError, TypeError):  # (a tensor subclass that takes no attributes)
                setattr(o, _MADE, made)
                self._holders[_storage(o)] = o
                self._made[_storage(o)] = made
        return out

    def _valued(self, tree: Any) -> Any:
        """``tree`` with each meta tensor replaced by its recorded value, computed on the CPU (a constructor that
        computes its layout from tensors: ``torch.arange(depth) * w_a + w_0`` then ``.tolist()``, torchvision's
        RegNet); None when one was not recorded. The default random streams are left as they were."""
        try:
            refs = self._capture(tree)
        except _Unreplayable:
            return None
        with torch.random.fork_rng(devices=[]), torch.no_grad():  # (this mode is off inside its own dispatch)
            return tree_map(_Values(torch.device("cpu")).value_of, refs, is_leaf=_is_ref)

    def record_inplace(self, func: Any, target: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``func(target, *args, **kwargs)`` ran (or, for a function that does nothing on meta, would run) in place."""
        holder = self._holder(target)
        ops: list[_Op] | None = getattr(holder, _OPS, [])
        if ops is not None:
            try:
                captured_args, captured_kwargs = self._capture((args, dict(kwargs)))
                view = None if _geometry(target) == _geometry(holder) else _geometry(target)
                ops = [*ops, (func, captured_args, captured_kwargs, view)]
            except _Unreplayable:
                ops = None  # computed from a tensor whose value was not recorded: nothing to replay it from
        with contextlib.suppress(AttributeError, TypeError):
            setattr(holder, _OPS, ops)

    def _holder(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor carrying the record of ``t``'s storage: its holder when its value was recorded, else its base
        (a tensor made before recording began: the in-place operations are recorded on it all the same). A parameter
        no module registered (``copy.deepcopy`` of a module sets them directly) takes the record over here."""
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter):
            self.adopt(base)
        holder = self._holders.get(_storage(t))
        return holder if holder is not None else base

    def _capture(self, tree: Any) -> Any:
        """``tree`` with each meta tensor replaced by a :class:`_Ref` to its current value."""
        return tree_map(lambda a: self._ref(a) if isinstance(a, torch.Tensor) and a.is_meta else a, tree)

    def _ref(self, t: torch.Tensor, holder: torch.Tensor | None = None) -> _Ref:
        """A reference to ``t``'s current value, read through ``holder`` (default: its storage's)."""
        holder = self._holder(t) if holder is None else holder
        made: _Ref | None = getattr(holder, _MADE, None)
        ops: list[_Op] | None = getattr(holder, _OPS, [])
        if made is None or ops is None or made.view is not None:  # (a holder is never a registered view)
            raise _Unreplayable
        view = None if _geometry(t) == _geometry(holder) else _geometry(t)
        return _Ref(made.node, (*made.ops, *ops), view)

    def adopt(self, tensor: Any) -> None:
        """A tensor is being registered in a module: when it is a new tensor object on a recorded storage (a
        parameter wrapping a value made on meta), it takes over the record. One that views part of the storage
        (``x.sum(-1).flatten()``) takes its value as it is now: an in-place operation after is not seen in it."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta or hasattr(tensor, _MADE):
            return
        holder = self._holders.get(_storage(tensor))
        if holder is None:
            return
        if holder is tensor:  # its attributes replaced (`Tensor.__deepcopy__` sets `__dict__`): made as recorded
            with contextlib.suppress(AttributeError, TypeError):
                setattr(tensor, _MADE, self._made.get(_storage(tensor)))
            return
        try:
            made: _Ref | None = self._ref(tensor, holder)
        except _Unreplayable:
            made = None
        with contextlib.suppress(AttributeError, TypeError):
            setattr(tensor, _MADE, made)
            setattr(tensor, _OPS, [])
            if _geometry(holder) == _geometry(tensor):
                self._holders[_storage(tensor)] = tensor


#: Operations that read a tensor's values out (``.item()``, ``.tolist()``, ``.cpu()``, comparisons in Python).
_READS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose"})


def _reads_values(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` reads the values of a meta tensor argument into Python or onto a real device."""
    metas = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_meta]
    if not metas:
        return False
    name = func.overloadpacket.__name__
    if name in _READS:
        return True
    if name == "_to_copy":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type != "meta"
    if name == "copy_":  # a real tensor written from a meta one
        return isinstance(args[0], torch.Tensor) and not args[0].is_meta
    return False


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class _DataOnMeta(TorchFunctionMode):
    """``torch.tensor(data)`` and ``x.new_tensor(data)`` for the meta device build on it directly, through no
    operation a dispatch mode sees: their values would be lost (``register_buffer("mean", torch.tensor([...]))``).
    While recording they are built on the CPU and then copied to meta, a copy :class:`_InitRecorder` records with
    its real argument."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.tensor or func is torch.Tensor.new_tensor:
            device = kwargs.get("device")
            if device is None:
                device = args[0].device if func is torch.Tensor.new_tensor else torch.get_default_device()
            if torch.device(device).type == "meta":
                grad = bool(kwargs.get("requires_grad", False))
                real = func(*args, **{**kwargs, "device": "cpu", "requires_grad": False})
                return real.to("meta").requires_grad_(grad)
        return func(*args, **kwargs)


@contextmanager
def record_init() -> Iterator[None]:
    """While active, how each meta-device tensor gets its value is recorded (see :class:`_InitRecorder`), for
    :func:`materialize_` to compute it on real storage: the in-place initializations a constructor applies
    (``nn.init`` functions, ``reset_parameters``, ``self.apply(self._init_weights)``, rescaling, writes through
    ``.data`` or a slice) and the values built out of place and wrapped in a parameter or registered as a buffer
    (``nn.Parameter(torch.zeros(1, 1, d))``, ``nn.Parameter(1e-6 * torch.ones(d))``, a sinusoidal table, a
    relative-position index, a constant from ``torch.tensor(data)``). A value read out on meta (``.tolist()``,
    ``.item()``, ``.cpu()``: a layout computed with tensors), which torch refuses there, is computed on the CPU from
    the record. Tensors on real devices are untouched. ``nn.init.trunc_normal_`` returns at once on a
    meta tensor, before any operation a dispatch mode sees: while active, that one function is wrapped (and
    restored after) so that its call is recorded. Module registration hooks are installed while active (a parameter
    wrapping a value takes its record when registered); on exit, the tensors of deep-copied modules, which are set
    without registration, take theirs."""
    original = torch.nn.init.trunc_normal_
    recorder = _InitRecorder()

    def trunc_normal_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # torch's returns at once on a meta tensor, before any operation this could record: record the call.
        if not tensor.is_meta:
            return original(tensor, *args, **kwargs)
        recorder.record_inplace(original, tensor, args, kwargs)
        return tensor

    def adopt(module: nn.Module, name: str, tensor: Any) -> None:
        recorder.adopt(tensor)

    modules: list[nn.Module] = []  # registered as children while recording (kept alive until the end)

    def child(module: nn.Module, name: str, submodule: Any) -> None:
        if isinstance(submodule, nn.Module):
            modules.append(submodule)

    module_hooks = torch.nn.modules.module
    torch.nn.init.trunc_normal_ = trunc_normal_  # (while recording only)
    hooks = [
        module_hooks.register_module_parameter_registration_hook(adopt),
        module_hooks.register_module_buffer_registration_hook(adopt),
        module_hooks.register_module_module_registration_hook(child),
    ]
    try:
        with recorder, _DataOnMeta():
            yield
            # A deep copy of a module (`_get_clones`: N copies of one layer) sets its tensors without registering
            # them: each copy's tensors take over the records of the values they wrap here.
            seen: set[int] = set()
            for module in modules:
                if id(module) in seen:
                    continue  # (visited with an enclosing module: its whole subtree was)
                for m in module.modules():
                    seen.add(id(m))
                    for _, t in _own_tensors(m):
                        recorder.adopt(t)
                    for _, holding, key in _attribute_tensors(m):
                        recorder.adopt(holding[key])  # (a metric's states, set as plain attributes)
    finally:
        for hook in hooks:
            hook.remove()
        torch.nn.init.trunc_normal_ = original


def init_records(module: nn.Module) -> dict[str, _Record | None]:
    """The recorded initializations of ``module``'s meta tensors by qualified name (every name of a tied tensor);
    None for one that cannot be replayed. Read them before sharding: sharding replaces the parameter objects that
    carry them."""
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    )
    records: dict[str, _Record | None] = {}
    for name, t in named:
        if not t.is_meta or not (hasattr(t, _OPS) or hasattr(t, _MADE)):
            continue
        made, ops = getattr(t, _MADE, None), getattr(t, _OPS, [])
        unreplayable = ops is None or (hasattr(t, _MADE) and made is None)
        records[name] = None if unreplayable else (made, ops)
    return records


class _Values:
    """Computes recorded values on ``device``. A value made out of place is computed once (a draw two tensors were
    built from stays shared): use one per submodule, so that nothing outlives it. A value several tensors copy
    (``shared``: a deep-copied layer's, a momentum encoder copied from its online one) is kept in ``kept`` once
    computed, across submodules, so that the copies hold the same values, as in an eager build."""

    def __init__(
        self,
        device: torch.device,
        shared: dict[tuple[int, int], int] | None = None,
        kept: dict[Any, torch.Tensor] | None = None,
    ) -> None:
        self.device = device
        self._made: dict[int, torch.Tensor] = {}
        self._shared = shared if shared is not None else {}  # value -> the seed it is drawn under
        self._kept = kept if kept is not None else {}

    def _resolve(self, tree: Any) -> Any:
        def here(a: Any) -> Any:
            if isinstance(a, _Ref):
                return self.value(a)
            if isinstance(a, torch.Tensor):
                return a.to(self.device)
            if isinstance(a, torch.device) and a.type == "meta":
                return self.device
            return a

        return tree_map(here, tree, is_leaf=_is_ref)

    def value_of(self, a: Any) -> Any:
        """``a`` computed when it is a :class:`_Ref`; as it is otherwise."""
        return self.value(a) if isinstance(a, _Ref) else a

    def value(self, ref: _Ref) -> torch.Tensor:
        key = _key(ref)
        kept = self._kept.get(key)
        if kept is not None:
            return kept if ref.view is None else kept.as_strided(*ref.view)
        if key in self._shared:
            with _seeded(self._shared[key], self.device):
                value = self._compute(ref)
            self._kept[key] = value
            return value if ref.view is None else value.as_strided(*ref.view)
        value = self._compute(ref)
        return value if ref.view is None else value.as_strided(*ref.view)

    def _compute(self, ref: _Ref) -> torch.Tensor:
        """``ref``'s value before its view."""
        node = ref.node
        made = self._made.get(id(node))
        if made is None:
            out = node.func(*self._resolve(node.args), **self._resolve(node.kwargs))
            made = out if node.index is None else out[node.index]
            if getattr(node.func, "overloadpacket", node.func).__name__ in _EMPTY:
                _poison_(made)  # (uninitialized memory: what is not written after is found unwritten)
            self._made[id(node)] = made
        if ref.ops:
            made = made.clone()
            self.replay(made, list(ref.ops))
        return made

    def replay(self, t: torch.Tensor, ops: list[_Op]) -> None:
        for func, args, kwargs, view in ops:
            target = t if view is None else t.as_strided(*view)
            func(target, *self._resolve(args), **self._resolve(kwargs))


def _value_ref(made: _Ref, ops: list[_Op]) -> _Ref:
    """A reference to a registered tensor's value: how it was made, then its own in-place operations. (A tensor
    registered as a view of part of a storage has none of its own: its value when registered.)"""
    return _Ref(made.node, (*made.ops, *ops), None) if made.view is None else made


def _key(ref: _Ref) -> tuple[int, int]:
    """Which value a reference reads, before its view: the storage's making and how many in-place operations since
    (a storage's operations are one history, so the count identifies the point in it)."""
    return id(ref.node), len(ref.ops)


def _shared_values(records: dict[str, _Record | None], seed: int) -> dict[tuple[int, int], int]:
    """The values (:func:`_key`) more than one tensor is computed from (each record's own value, and every value its
    recipe reads: a deep copy's source, a ``copy_``'s), each with the seed it is drawn under: ``seed`` folded with
    the first name, in order, of the tensors that read it, so that it does not depend on which reads it first (a
    pipeline stage may hold only later copies)."""
    readers: dict[tuple[int, int], set[str]] = {}
    seen: set[tuple[int, str]] = set()

    def read(tree: Any, name: str) -> None:
        for leaf in tree_leaves(tree, is_leaf=_is_ref):
            if isinstance(leaf, _Ref):
                readers.setdefault(_key(leaf), set()).add(name)
                visit(leaf, name)

    def visit(ref: _Ref, name: str) -> None:
        if (id(ref.node), name) not in seen:
            seen.add((id(ref.node), name))
            read((ref.node.args, ref.node.kwargs), name)
        for _, args, kwargs, _ in ref.ops:
            read((args, kwargs), name)

    tied: set[tuple[int, int]] = set()
    for name, record in records.items():
        if record is None or (id(record[0]), id(record[1])) in tied:
            continue  # (a tied tensor's other names: one tensor, materialized once)
        tied.add((id(record[0]), id(record[1])))
        made, ops = record
        if made is not None:
            whole = _value_ref(made, ops)
            readers.setdefault(_key(whole), set()).add(name)
            visit(whole, name)
        else:
            for _, args, kwargs, _ in ops:
                read((args, kwargs), name)
    return {key: _module_seed(seed, min(names)) for key, names in readers.items() if len(names) > 1}


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


def _attribute_tensors(module: nn.Module) -> Iterator[tuple[str, dict[str, Any], str]]:
    """Tensors a module holds outside its parameters and buffers, as ``(name, holding dict, key)``: plain tensor
    attributes (a torchmetrics metric's states) and a torchmetrics metric's ``_defaults`` (what ``reset()``
    restores)."""
    for key, value in vars(module).items():
        if isinstance(value, torch.Tensor):
            yield key, vars(module), key
    defaults = vars(module).get("_defaults")
    if isinstance(defaults, dict) and type(module).__module__.startswith("torchmetrics"):
        for key, value in defaults.items():
            if isinstance(value, torch.Tensor):
                yield f"_defaults.{key}", defaults, key


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
    #: Tensors whose recorded initialization could not be replayed (computed from meta tensors made before recording
    #: began), initialized by ``reset_parameters()`` instead (or left unwritten, then also in ``unwritten``).
    not_replayed: list[str]
    #: Tensors the constructor itself left uninitialized (``torch.empty``, nothing written after), as an eager build
    #: leaves them: filled with NaN (integers: their minimum), so that a read before the model's own write shows.
    uninitialized: list[str] = []

    @staticmethod
    def join(parts: list[Materialized]) -> Materialized:
        """One report of a model materialized in parts (:func:`materialize_` with ``within``)."""
        return Materialized(
            [x for p in parts for x in p.unwritten],
            [x for p in parts for x in p.not_replayed],
            [x for p in parts for x in p.uninitialized],
        )


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
    records: dict[str, _Record | None] | None = None,
    *,
    within: nn.Module | None = None,
    seed: int | None = None,
    copied: dict[Any, Any] | None = None,
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
    after it) and the values it built out of place (``nn.Parameter(torch.zeros(d))``, a position table, a
    relative-position index) are kept, and real values copied in (``load_state_dict``) land, over a Hugging Face
    init too; then
    ``reset_parameters()`` (``_reset_parameters()`` in torch's attention) for tensors still unwritten. Each
    submodule draws from its own seed: the same distributions as an eager build, not the same draws. A sharded
    parameter is initialized whole on every rank (the same seed gives the same values) and each rank keeps its
    shard, so the values do not depend on the number of ranks or the layout, and need no random-number support from
    DTensor (which has none on CPU). Tied weights stay tied (``to_empty`` alone unties them). A value several
    tensors copy (the layers ``copy.deepcopy`` made of one, a momentum encoder ``copy_``-ed from its online encoder)
    is computed once, under a seed of the copies' first name, and kept until the materialization ends: the copies
    start equal, as in an eager build, whichever is materialized first. Pass the same ``copied`` dict to the calls
    of a model materialized in parts.
    """
    scope = module if within is None else within
    if not has_meta_tensors(scope):
        return Materialized([], [], [])
    if records is None:
        records = init_records(module)
    if seed is None:
        seed = init_seed()
    copied = {} if copied is None else copied
    shared = copied.get(("shared", seed))  # (once per model materialized in parts: it reads every record)
    if shared is None:
        shared = copied[("shared", seed)] = _shared_values(records, seed)
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
                values = _Values(device, shared, copied)
                for name in own:
                    record = records.get(_join(names.get(id(m), ""), name))
                    if record is None:
                        continue
                    made, ops = record
                    t = getattr(m, name)
                    loaded = _last_load(ops)
                    if loaded is not None:  # values copied in after the build win, over HF's init too
                        values.replay(t, ops[loaded:])
                    elif _unwritten(t) and made is not None:
                        t.copy_(values.value(_value_ref(made, ops)))
                    elif _unwritten(t):
                        values.replay(t, ops)
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
    unwritten: list[tuple[str, bool]] = []
    for m in scope.modules():  # tensors held as plain attributes (a torchmetrics metric's states and defaults)
        for key, value in list(vars(m).items()):
            if isinstance(value, torch.device) and value.type == "meta":  # (a metric's `_device`, read by `.to()`)
                vars(m)[key] = device
        for name, holding, key in list(_attribute_tensors(m)):
            t = holding[key]
            if not t.is_meta:
                continue
            made, ops = getattr(t, _MADE, None), getattr(t, _OPS, [])
            if made is None or ops is None:
                unwritten.append((_join(names.get(id(m), ""), name), False))
                continue
            with _seeded(_module_seed(seed, names.get(id(m), "")), device), torch.no_grad():
                holding[key] = _Values(device, shared, copied).value(_value_ref(made, ops)).clone()
    uninitialized: list[str] = []
    for m, name, t in fresh.values():
        if _unwritten(local_view(t)):
            qualified = _join(names.get(id(m), ""), name)
            if _left_empty(records.get(qualified)):
                uninitialized.append(qualified)
            else:
                unwritten.append((qualified, name in m._parameters or name not in m._non_persistent_buffers_set))
    not_replayed = [
        qualified
        for m, name, _ in fresh.values()
        if id(m) not in hf
        and (qualified := _join(names.get(id(m), ""), name)) in records
        and records[qualified] is None
    ]
    return Materialized(unwritten, not_replayed, uninitialized)


def _left_empty(record: _Record | None) -> bool:
    """Whether a record says: made by ``torch.empty`` (or alike) and nothing written after."""
    if record is None or record[0] is None or record[1]:
        return False
    made = record[0]
    func = made.node.func
    return not made.ops and made.view is None and getattr(func, "overloadpacket", func).__name__ in _EMPTY


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
