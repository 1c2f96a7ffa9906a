"""KnowledgeDistillation: logit and feature distillation from a frozen teacher, for any LightningModule."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from lightning_bigtrain._logging import is_logging_step
from lightning_bigtrain.engines.logit_cache import LogitCache
from lightning_bigtrain.functional.distillation import (
    agreement,
    feature_loss,
    kd_loss,
    make_projection,
    module_fingerprint,
    sample_keys,
    topk_kd_loss,
    topk_logits,
)
from lightning_bigtrain.warnings import BigtrainWarning, warn_once

__all__ = ["DistillationOptions", "KnowledgeDistillation"]

_PROJECTIONS = "kd_projections"
_CHECKPOINT_KEY = "bigtrain_distillation"
_WIDTH_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.BatchNorm2d, nn.LayerNorm, nn.Embedding)


@dataclass(frozen=True)
class DistillationOptions:
    """Rarer settings of :class:`KnowledgeDistillation`.

    Args:
        alpha_end: Anneal ``alpha`` linearly to this value over the run (``trainer.estimated_stepping_batches``);
            None keeps it constant.
        feature_weight: Weight of each feature-hint loss in the total.
        cache_top_k: Teacher logits kept per position in the cache.
        student_module: Name of the student's submodule whose output is the logits; ``""``: the LightningModule's
            own ``forward`` (what ``self(x)`` in ``training_step`` returns).
        teacher_module: The same for the teacher; ``""``: the teacher's ``forward``.
        teacher_class: ``"package.module.Class"`` that rebuilds a teacher given as a checkpoint path; default: the
            student's class (``load_from_checkpoint`` reads the teacher's own hyperparameters).
        rebuild_cache: Overwrite a cache file written for another teacher instead of refusing it.
        teacher_call: How to call a teacher whose forward takes other inputs than the student's:
            ``teacher_call(teacher, *args, **kwargs)`` gets the student's call and returns the teacher's logits
            (e.g. ``lambda teacher, x: teacher(x, x)`` for Lightning's demo Transformer, whose forward takes
            ``(inputs, target)``). Default: the teacher is called exactly as the student was.
    """

    alpha_end: float | None = None
    feature_weight: float = 1.0
    cache_top_k: int = 16
    student_module: str = ""
    teacher_module: str = ""
    teacher_class: str | None = None
    rebuild_cache: bool = False
    teacher_call: Callable[..., Any] | None = None


def _logs_this_step(trainer: L.Trainer) -> bool:
    """Whether to log this training step's metrics: when Lightning writes them to the loggers
    (``log_every_n_steps``), and on the first and the last step so that ``callback_metrics`` always hold them."""
    if is_logging_step(trainer) or trainer.global_step == 0:
        return True
    last_step = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step + 1
    epoch_loop = trainer.fit_loop.epoch_loop
    last_epoch = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs
    return last_step or (last_epoch and bool(epoch_loop.batch_progress.is_last_batch))


def _first_tensor(out: Any, who: str) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(
        f"KnowledgeDistillation: the {who}'s output is a {type(out).__name__}; expected logits (a tensor, a "
        "tuple starting with it, or a dict with 'logits'). Name the submodule that returns logits in "
        f"DistillationOptions({who}_module=...)."
    )


def _submodule(root: nn.Module, name: str, who: str) -> nn.Module:
    if not name:
        return root
    try:
        return root.get_submodule(name)
    except AttributeError:
        names = [n for n, _ in root.named_modules() if n]
        shown = ", ".join(names[:40]) + (" ..." if len(names) > 40 else "")
        raise ValueError(f"KnowledgeDistillation: the {who} has no layer named {name!r}. Available: {shown}") from None


def _width(module: nn.Module, name: str) -> tuple[int, bool]:
    """Output width of a layer and whether it yields channel maps (N, C, H, W)."""
    candidates = [module] + [m for m in reversed(list(module.modules())) if m is not module]
    for m in candidates:
        if isinstance(m, nn.Linear):
            return m.out_features, False
        if isinstance(m, (nn.Conv1d, nn.Conv3d)):
            return m.out_channels, False
        if isinstance(m, nn.Conv2d):
            return m.out_channels, True
        if isinstance(m, nn.BatchNorm2d):
            return m.num_features, True
        if isinstance(m, nn.LayerNorm):
            return int(m.normalized_shape[-1]), False
        if isinstance(m, nn.Embedding):
            return m.embedding_dim, False
    raise ValueError(
        f"KnowledgeDistillation(features=...): cannot tell the output width of layer {name!r} "
        f"({type(module).__name__}); name a Linear, Conv, BatchNorm2d, LayerNorm or Embedding layer, or a block "
        "that ends in one."
    )


def _has_submodule(root: nn.Module | None, name: str) -> bool:
    try:
        return root is not None and isinstance(root.get_submodule(name), nn.Module)
    except AttributeError:
        return False


def _check_call(teacher: nn.Module, args: tuple, kwargs: dict, name: str) -> None:
    """Refuse, with what to do, a teacher whose forward cannot take the student's call (instead of the
    teacher's own TypeError from deep inside the step)."""
    import inspect

    try:
        signature = inspect.signature(teacher.forward)
    except (TypeError, ValueError):  # a builtin or C++ forward: nothing to check
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        given = [type(a).__name__ for a in args] + [f"{k}=" for k in kwargs]
        who = f"teacher.{name}" if name else "teacher"
        raise TypeError(
            f"KnowledgeDistillation: the {who} ({type(teacher).__name__}.forward{signature}) cannot be called "
            f"the way the student was called ({', '.join(given)}): {err}. Pass "
            "DistillationOptions(teacher_call=lambda teacher, *args, **kwargs: ...) returning the teacher's logits "
            "(e.g. `lambda teacher, x: teacher(x, x)`), or name matching submodules in "
            "DistillationOptions(student_module=..., teacher_module=...)."
        ) from None


class KnowledgeDistillation(L.Callback):
    """Distil a frozen teacher into the LightningModule being trained, without changing its code.

    Logit distillation (Hinton et al., 2015): the loss the module's ``training_step`` returns (the task loss)
    becomes ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * task`` (+ ``feature_weight`` times
    each FitNets feature hint, Romero et al., 2015). The student's logits are the output of its ``forward``
    (or of ``DistillationOptions.student_module``) during ``training_step``; the teacher sees the very same
    inputs (augmentations included), in eval mode, without autograd, in the run's precision.

    Mechanism (a callback cannot replace the loss from ``on_before_backward``): in ``setup`` it wraps the
    module's ``training_step`` (and, with feature hints, ``configure_optimizers`` and ``on_load_checkpoint``)
    as instance attributes, registers forward hooks on the student's and teacher's output layers, and restores
    all of it in ``teardown``. Feature projections are added as the submodule ``kd_projections`` so that
    DDP/ZeRO synchronize them and the optimizer trains them; they are checkpointed under
    ``"bigtrain_distillation"`` (not in ``state_dict``, so the student's checkpoint loads without the callback).

    ``cache=``: teacher logits are stored as top-k (values + class indices) per input sample, addressed by the
    sample's content, at a local path or fsspec URL; reused across epochs and runs, refused when written for
    another teacher. Distilling from top-k is an approximation (see
    :func:`~lightning_bigtrain.functional.distillation.topk_kd_loss`); with a cache, live teacher outputs are
    truncated to the same top-k so the loss is the same whether a batch hits or misses. Inputs the cache has not
    seen once it is complete (random augmentation, new data) run the live teacher, with a warning.

    Under ``ZeroStrategy(stage=3)`` the teacher is sharded over the same ranks (FSDP2), so it costs each rank
    1/N of its parameters.

    Logged on the steps Lightning writes to the loggers (``log_every_n_steps``) and on the first and last step:
    ``distill/kd_loss``, ``distill/task_loss``, ``distill/agreement`` (top-1 match), ``distill/alpha``, and
    ``distill/feature_loss``, ``distill/cache_hit_rate`` when used (six ``self.log`` calls on every step cost
    more than the cached teacher itself).

    Acts in: ``setup`` (teacher, hooks, projections, cache), ``on_fit_start`` (teacher placement, precision,
    sharding), ``training_step`` (wrapped), ``on_train_epoch_end`` (cache write), ``on_save_checkpoint``,
    ``teardown``.

    Args:
        teacher: An ``nn.Module`` (a LightningModule included) or the path of a Lightning checkpoint (a file, or
            the folder of a sharded ZeroStrategy checkpoint).
        temperature: Softening temperature ``T`` > 0.
        alpha: Weight of the distillation loss in [0, 1] (1: distillation only).
        features: Feature hints ``{student_layer: teacher_layer}`` by module name.
        cache: Path or fsspec URL of a top-k teacher-logit cache file; None computes the teacher every step.
        options: :class:`DistillationOptions`.
    """

    def __init__(
        self,
        teacher: nn.Module | str | os.PathLike[str],
        *,
        temperature: float = 2.0,
        alpha: float = 0.5,
        features: dict[str, str] | None = None,
        cache: str | os.PathLike[str] | None = None,
        options: DistillationOptions | None = None,
    ) -> None:
        options = options or DistillationOptions()
        if not isinstance(teacher, (nn.Module, str, os.PathLike)):
            raise TypeError(
                f"`KnowledgeDistillation(teacher={type(teacher).__name__})`: pass an nn.Module, a LightningModule "
                "or the path of a Lightning checkpoint."
            )
        if not temperature > 0:
            raise ValueError(f"`KnowledgeDistillation(temperature={temperature})`: temperature must be > 0.")
        for name, value in (("alpha", alpha), ("DistillationOptions.alpha_end", options.alpha_end)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"`KnowledgeDistillation({name}={value})`: must be in [0, 1].")
        if not options.feature_weight >= 0:
            raise ValueError(
                f"`DistillationOptions(feature_weight={options.feature_weight})`: must be >= 0 (a negative weight "
                "would push the student's features away from the teacher's)."
            )
        if options.cache_top_k < 1:
            raise ValueError(f"`DistillationOptions(cache_top_k={options.cache_top_k})`: must be >= 1.")
        if options.teacher_call is not None and not callable(options.teacher_call):
            raise TypeError(
                f"`DistillationOptions(teacher_call={options.teacher_call!r})`: pass a function "
                "`(teacher, *args, **kwargs) -> logits`, e.g. `lambda teacher, x: teacher(x, x)`."
            )
        if features is not None and (
            not isinstance(features, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in features.items())
        ):
            raise TypeError(
                f"`KnowledgeDistillation(features={features!r})`: pass {{student_layer_name: teacher_layer_name}}."
            )
        if features and cache is not None:
            raise ValueError(
                "`KnowledgeDistillation(features=..., cache=...)`: the cache stores logits only, and feature hints "
                "need the teacher's layers every step. Drop one of them."
            )
        self.teacher_source = teacher
        self.temperature = float(temperature)
        self.alpha = float(alpha)
        self.features = dict(features or {})
        self.cache_url = None if cache is None else os.fspath(cache)
        self.options = options
        self.teacher: nn.Module | None = None
        self.cache: LogitCache | None = None
        self._originals: dict[str, Any] = {}
        self._hooks: list[Any] = []
        self._capturing = False
        self._student: dict[str, Any] = {}
        self._student_feats: dict[str, torch.Tensor] = {}
        self._teacher_feats: dict[str, torch.Tensor] = {}
        self._complete = False
        self._hits = 0
        self._misses = 0
        self._checked_shapes = False
        self._pending_projections: dict[str, torch.Tensor] | None = None
        self._children: dict[str, dict[str, Any]] = {}
        self._teacher_target: str = ""
        self._signature_checked = False

    # -- setup --
    def _load_teacher(self, pl_module: L.LightningModule) -> nn.Module:
        source = self.teacher_source
        if isinstance(source, nn.Module):
            return source
        path = os.fspath(source)
        if self.options.teacher_class:
            module_name, _, cls_name = self.options.teacher_class.rpartition(".")
            cls = getattr(importlib.import_module(module_name), cls_name)
        else:
            cls = type(pl_module)
        if not hasattr(cls, "load_from_checkpoint"):
            raise TypeError(
                f"KnowledgeDistillation: cannot rebuild the teacher from {path!r} with {cls.__name__} (not a "
                "LightningModule); pass the teacher module itself or DistillationOptions(teacher_class=...)."
            )
        if os.path.isdir(path):
            # A sharded ZeroStrategy checkpoint (a folder): consolidate it into one file first.
            import tempfile

            from lightning_bigtrain.strategies.zero import consolidate_checkpoint

            with tempfile.TemporaryDirectory() as tmp:
                single = consolidate_checkpoint(path, Path(tmp) / "teacher.ckpt")
                return cls.load_from_checkpoint(single, map_location="cpu")
        return cls.load_from_checkpoint(path, map_location="cpu")

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        teacher = self._load_teacher(pl_module)
        teacher.eval().requires_grad_(False)
        self.teacher = teacher
        student_out = _submodule(pl_module, self.options.student_module, "student")
        teacher_out = _submodule(teacher, self.options.teacher_module, "teacher")
        self._hooks.append(student_out.register_forward_hook(self._capture_student, with_kwargs=True))
        self._hooks.append(teacher_out.register_forward_hook(self._capture_teacher_logits))
        if not self.options.student_module:
            # A step that calls a submodule instead of `self(x)` (Hugging Face users write
            # `self.model(input_ids, labels=...)`): the submodule's call is the student's, and the teacher's
            # submodule of the same name (or the teacher itself) is called the same way.
            for name, child in pl_module.named_children():
                hook = child.register_forward_hook(self._capture_child(name), with_kwargs=True)
                self._hooks.append(hook)
        self._signature_checked = False  # checked once per fit, on the first step's call
        if self.features:
            projections = nn.ModuleDict()
            for i, (s_name, t_name) in enumerate(self.features.items()):
                s_layer = _submodule(pl_module, s_name, "student")
                t_layer = _submodule(teacher, t_name, "teacher")
                (s_width, s_conv), (t_width, _) = _width(s_layer, s_name), _width(t_layer, t_name)
                projections[f"hint{i}"] = make_projection(s_width, t_width, conv=s_conv)
                self._hooks.append(s_layer.register_forward_hook(self._feature_hook(self._student_feats, s_name)))
                self._hooks.append(t_layer.register_forward_hook(self._feature_hook(self._teacher_feats, s_name)))
            pl_module.add_module(_PROJECTIONS, projections)
            self._wrap(pl_module, "configure_optimizers", self._configure_optimizers)
            self._wrap(pl_module, "on_load_checkpoint", self._module_on_load_checkpoint)
        self._wrap(pl_module, "training_step", self._training_step)
        if self.cache_url is not None:
            fingerprint = module_fingerprint(teacher)
            k = self.options.cache_top_k
            cache = None
            try:
                cache = LogitCache.load(self.cache_url, fingerprint, k, self.temperature)
            except ValueError:
                if not self.options.rebuild_cache:
                    raise
                warn_once(f"KnowledgeDistillation: rebuilding the cache at {self.cache_url!r} (another teacher).")
            self.cache = cache or LogitCache(fingerprint, k, self.temperature)
            self._complete = len(self.cache) > 0

    def _wrap(self, pl_module: L.LightningModule, name: str, replacement: Any) -> None:
        original = getattr(pl_module, name)
        self._originals[name] = (original, name in vars(pl_module))

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return replacement(pl_module, original, *args, **kwargs)

        setattr(pl_module, name, wrapped)

    def _configure_optimizers(self, pl_module: L.LightningModule, original: Any) -> Any:
        """The user's optimizers; the projections join the first one if its groups do not hold them."""
        result = original()
        params = list(getattr(pl_module, _PROJECTIONS).parameters())
        if not params:
            return result
        optimizer = result
        if isinstance(result, dict):
            optimizer = result["optimizer"]
        elif isinstance(result, (list, tuple)) and result:
            first = result[0]
            optimizer = first[0] if isinstance(first, (list, tuple)) else first
            optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "KnowledgeDistillation(features=...): could not find the optimizer configure_optimizers returned "
                f"({type(result).__name__}) to add the feature projections to; include self.parameters() in it."
            )
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [p for p in params if id(p) not in held]
        if missing:
            optimizer.add_param_group({"params": missing})
        return result

    def _module_on_load_checkpoint(self, pl_module: L.LightningModule, original: Any, checkpoint: dict) -> Any:
        # Called before the module's state is loaded: put the projections back where the strict load expects them.
        saved = checkpoint.get(_CHECKPOINT_KEY, {}).get("projections")
        state = checkpoint.get("state_dict")
        if saved and isinstance(state, dict):
            state.update(saved)
        return original(checkpoint)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.teacher is not None
        teacher = trainer.precision_plugin.convert_module(self.teacher)
        strategy = trainer.strategy
        if getattr(strategy, "stage", None) == 3 and hasattr(strategy, "device_mesh"):
            from lightning_bigtrain.functional.sharding import auto_wrap_targets, is_fully_sharded, shard_module_

            teacher.to(pl_module.device)
            if not is_fully_sharded(teacher):
                shard_module_(
                    teacher,
                    strategy.device_mesh["data_parallel"],
                    reshard_after_forward=True,
                    targets=auto_wrap_targets(teacher, getattr(strategy, "min_wrap_params", 1)),
                )
        else:
            teacher.to(pl_module.device)
        self.teacher = teacher

    # -- hooks --
    def _capture_student(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._capturing and "output" not in self._student:
            self._student.update(args=args, kwargs=kwargs, output=output)

    def _capture_child(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._capturing and name not in self._children:
                self._children[name] = {"args": args, "kwargs": kwargs, "output": output}

        return hook

    def _capture_teacher_logits(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._teacher_out = output

    def _feature_hook(self, store: dict[str, torch.Tensor], key: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._capturing and key not in store:
                store[key] = _first_tensor(output, "feature layer")

        return hook

    # -- the wrapped training_step --
    def _alpha(self, trainer: L.Trainer) -> float:
        end = self.options.alpha_end
        if end is None:
            return self.alpha
        total = max(1, int(trainer.estimated_stepping_batches))
        return self.alpha + (end - self.alpha) * min(1.0, trainer.global_step / total)

    def _teacher_logits(self, trainer: L.Trainer) -> Any:
        assert self.teacher is not None
        args, kwargs = self._student["args"], self._student["kwargs"]
        keys = None
        if self.cache is not None:
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is None:
                raise TypeError("KnowledgeDistillation(cache=...): the student's forward gets no input tensor to key.")
            keys = sample_keys(first)
            hit = self.cache.get(keys)
            if hit is not None:
                self._hits += 1
                device = self._student_logits.device
                return tuple(t.to(device) for t in hit)
            self._misses += 1
            if self._complete:
                warn_once(
                    "KnowledgeDistillation(cache=...): inputs the cache has not seen (random augmentation or "
                    "new data?); the live teacher answers for them. Cached logits are only right for "
                    "inputs seen before: cache a fixed dataset, or drop cache= under random augmentation.",
                    BigtrainWarning,
                )
        self._teacher_out = None
        direct = self._teacher_target and not self.options.teacher_module  # the same-named submodule, called
        target = self.teacher.get_submodule(self._teacher_target) if direct else self.teacher
        if self.options.teacher_call is None and not self._signature_checked:
            _check_call(target, args, kwargs, self._teacher_target)
        self._signature_checked = True
        with torch.no_grad(), trainer.precision_plugin.forward_context(), _root_gathered(self.teacher, target):
            if self.options.teacher_call is not None:
                returned = self.options.teacher_call(target, *args, **kwargs)
            else:
                returned = target(*args, **kwargs)
        # With teacher_module, the logits are that layer's output (its hook); otherwise what the call returned.
        logits = _first_tensor(self._teacher_out if self.options.teacher_module else returned, "teacher")
        self._teacher_out = None
        if keys is not None and self.cache is not None:
            values, indices, log_partition = topk_logits(logits, self.cache.k, self.temperature)
            self.cache.put(keys, values, indices, log_partition)
            # The same top-k the cache returns (values rounded as stored): a hit and a miss give the same loss.
            return values.half().float(), indices, log_partition
        return logits

    def _training_step(self, pl_module: L.LightningModule, original: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = pl_module.trainer
        self._student = {}
        self._children = {}
        self._student_feats.clear()  # the feature hooks hold these dicts
        self._teacher_feats.clear()
        self._capturing = True
        try:
            out = original(*args, **kwargs)
        finally:
            self._capturing = False
        if out is None:
            return out  # the step was skipped by the module
        task = out if isinstance(out, torch.Tensor) else out["loss"]
        self._teacher_target = self.options.teacher_module
        if "output" not in self._student and len(self._children) == 1:
            ((name, call),) = self._children.items()
            self._student = call
            self._teacher_target = self.options.teacher_module or (name if _has_submodule(self.teacher, name) else "")
        if "output" not in self._student:
            where = self.options.student_module or "the LightningModule's forward"
            called = f" (it called {', '.join(f'`self.{n}`' for n in self._children)})" if self._children else ""
            raise RuntimeError(
                f"KnowledgeDistillation: training_step never called {where}{called}, so there are no student "
                "logits. Name the submodule that returns them in DistillationOptions(student_module=...)."
            )
        student = _first_tensor(self._student["output"], "student")
        self._student_logits = student
        self._capturing = True  # teacher feature hooks record during the teacher's forward
        try:
            teacher = self._teacher_logits(trainer)
        finally:
            self._capturing = False
        # Metrics are written to the loggers every `log_every_n_steps` only: log (and compute agreement) then.
        log_now = _logs_this_step(trainer)
        if isinstance(teacher, tuple):
            values, indices, log_partition = teacher
            if not self._checked_shapes:
                self._check_shapes(student, values, topk=True)
            kd = topk_kd_loss(student, values.float(), indices, self.temperature, log_partition)
            agree = agreement(student, indices[..., 0]) if log_now else None
        else:
            if not self._checked_shapes:
                self._check_shapes(student, teacher, topk=False)
            kd = kd_loss(student, teacher, self.temperature)
            agree = agreement(student, teacher) if log_now else None
        alpha = self._alpha(trainer)
        total = alpha * kd + (1.0 - alpha) * task
        if log_now:
            assert agree is not None
            pl_module.log("distill/kd_loss", kd.detach(), on_step=True, on_epoch=False)
            pl_module.log("distill/task_loss", task.detach(), on_step=True, on_epoch=False)
            pl_module.log("distill/agreement", agree, on_step=True, on_epoch=False)
            pl_module.log("distill/alpha", alpha, on_step=True, on_epoch=False)
        if self.features:
            projections = getattr(pl_module, _PROJECTIONS)
            hints = [
                feature_loss(self._student_feats[name], self._teacher_feats[name], projections[f"hint{i}"])
                for i, name in enumerate(self.features)
            ]
            hint = torch.stack(hints).sum()
            total = total + self.options.feature_weight * hint
            if log_now:
                pl_module.log("distill/feature_loss", hint.detach(), on_step=True, on_epoch=False)
        if self.cache is not None and log_now:
            pl_module.log("distill/cache_hit_rate", self._hits / max(1, self._hits + self._misses), on_step=True)
        self._student = {}
        if isinstance(out, torch.Tensor):
            return total
        return {**out, "loss": total}

    def _check_shapes(self, student: torch.Tensor, teacher: torch.Tensor, *, topk: bool) -> None:
        same = student.shape[:-1] == teacher.shape[:-1] if topk else student.shape == teacher.shape
        if not same:
            raise ValueError(
                f"KnowledgeDistillation: the teacher's output has shape {tuple(teacher.shape)}"
                f"{' (top-k)' if topk else ''}, the student's {tuple(student.shape)}. Teacher and student must predict "
                "the same classes at the same positions; name the layers that do in "
                "DistillationOptions(student_module=..., teacher_module=...)."
            )
        self._checked_shapes = True

    # -- cache and checkpoints --
    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.cache is None or self.cache_url is None:
            return
        new = self.cache.take_new()
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, new)
            for rank_entries in gathered:
                for key, values, indices, log_partition in rank_entries:
                    self.cache.put([key], values[None], indices[None], log_partition[None], record=False)
            added = sum(len(g) for g in gathered)
        else:
            added = len(new)
        self._complete = True
        if added and trainer.is_global_zero:
            self.cache.save(self.cache_url)
        trainer.strategy.barrier()

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        state = checkpoint.get("state_dict")
        prefix = _PROJECTIONS + "."
        if isinstance(state, dict):
            moved = {k: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}
            if moved:
                checkpoint[_CHECKPOINT_KEY] = {"projections": moved}

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for name, (original, own) in self._originals.items():
            if own:
                setattr(pl_module, name, original)
            else:
                delattr(pl_module, name)
        self._originals.clear()
        if _PROJECTIONS in pl_module._modules:
            del pl_module._modules[_PROJECTIONS]
        self.teacher = None


@contextmanager
def _root_gathered(teacher: nn.Module, target: nn.Module) -> Iterator[None]:
    """The teacher's root parameters gathered while one of its submodules is called directly (the student's step
    called ``self.model(...)``): sharded at stage 3, the teacher's root unit (its own parameters outside every
    inner unit: a tied embedding, a final norm) is gathered only around the root's own call."""
    from torch.distributed.fsdp import FSDPModule

    if target is teacher or not isinstance(teacher, FSDPModule):
        yield
        return
    teacher.unshard()
    try:
        yield
    finally:
        teacher.reshard()
