"""Conformance matrix: model families this project did not write x every strategy, plugin and callback.

    python -m benchmarks.conformance [--families F ...] [--cells C ...] [--merge] [--render]

Each *family* is a LightningModule written the way its users write one (Hugging Face: ``training_step`` returns
``self.model(input_ids, labels=...).loss``; torchvision/timm: ``F.cross_entropy(self.model(x), y)``; Lightning's
demo Transformer subclassed only to skip its WikiText download), built from a config (no weights downloaded),
trained on the bundled data (Shakespeare characters, Fashion-MNIST). Each *cell* switches one technique on
through Trainer arguments alone, runs ``STEPS`` optimizer steps on 2 CPU ranks (gloo), and is classified:

* ``ok``: the loss is finite and falls (mean of the last 3 steps below the first step's), the replicated tensors
  are bit-identical on both ranks (each rank's own view, compared before any gather; sharded tensors are not
  replicas and are not compared), and the technique measurably acted (the evidence column);
* ``refused``: the fit raised from this package's code at setup, before the first step, with a message;
* ``FAILED``: anything else (a framework error, a loss that does not fall, replicas that differ, a technique
  that did nothing).

The results go to ``results/conformance.json`` and the README's matrix is rendered from it; the fast subset in
``tests/test_conformance.py`` runs the same cells through the same function.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import LightningTransformer
from torch import nn

from lightning_bigtrain.functional.materialize import has_meta_tensors
from lightning_bigtrain.functional.sharding import is_replica, local_view

STEPS = 8
VOCAB = 96  # the Shakespeare datamodule's fixed character vocabulary
BLOCK = 32


# ------------------------------------------------------------------------------------------------ families
class _Wrapper(L.LightningModule):
    """What both family wrappers share: ``self.model``'s forward, the loss logged in training (``train_loss``) and
    validation (``val_loss``), AdamW. Subclasses give ``_loss(batch)``."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LanguageModel(_Wrapper):
    """How Hugging Face and plain-PyTorch users write a language-model LightningModule.

    ``style``: ``"causal"`` (HF ``...ForCausalLM``: ``self.model(input_ids=x, labels=x).loss``), ``"mlm"``
    (HF masked LM: every sixth position masked, ``labels`` -100 elsewhere), ``"seq2seq"`` (HF T5:
    ``self.model(input_ids=x, labels=y).loss``), ``"logits"`` (``self(x)`` returns logits; cross entropy on ``y``).
    """

    def __init__(self, model: nn.Module, style: str, lr: float = 3e-3) -> None:
        super().__init__(model, lr)
        self.style = style

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if self.style == "causal":
            return self.model(input_ids=x, labels=x).loss
        if self.style == "mlm":
            masked = (torch.arange(x.shape[1], device=x.device) % 6) == (self.global_step % 6)
            labels = torch.where(masked, x, torch.full_like(x, -100))
            return self.model(input_ids=torch.where(masked, torch.full_like(x, VOCAB - 1), x), labels=labels).loss
        if self.style == "seq2seq":
            return self.model(input_ids=x, labels=y).loss
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class ImageClassifier(_Wrapper):
    """How torchvision/timm users write a classifier: ``F.cross_entropy(self(x), y)``. Fashion-MNIST's 28x28 grey
    images are resized to 32x32 and repeated to the model's input channels."""

    def __init__(self, model: nn.Module, channels: int = 3, lr: float = 2e-3) -> None:
        super().__init__(model, lr)
        self.channels = channels

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).expand(-1, self.channels, -1, -1)
        return F.cross_entropy(self(x), y)


class DemoTransformer(LightningTransformer):
    """Lightning's demo as is (SGD 0.1, ``forward(inputs, target)``), minus its WikiText download."""

    def __init__(self, vocab_size: int = VOCAB) -> None:
        super().__init__(vocab_size=vocab_size)

    def prepare_data(self) -> None:
        pass


def _demo_transformer() -> L.LightningModule:
    return DemoTransformer()


def _hf_gpt2() -> L.LightningModule:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return LanguageModel(GPT2LMHeadModel(cfg), "causal")


def _hf_bert() -> L.LightningModule:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=BLOCK, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)  # fmt: skip
    return LanguageModel(BertForMaskedLM(cfg), "mlm")


def _hf_llama() -> L.LightningModule:
    from transformers import LlamaConfig, LlamaForCausalLM

    # RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention (4 query heads share 2 key/value heads).
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=BLOCK,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    return LanguageModel(LlamaForCausalLM(cfg), "causal")


def _hf_t5() -> L.LightningModule:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    return LanguageModel(T5ForConditionalGeneration(cfg), "seq2seq")


def _nn_transformer() -> L.LightningModule:
    class EncoderLM(nn.Module):
        """A causal language model on ``nn.TransformerEncoder``, as a PyTorch tutorial writes it."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 64)
            self.pos = nn.Parameter(torch.zeros(1, BLOCK, 64))
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(64)
            self.head = nn.Linear(64, VOCAB)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
            h = self.encoder(self.embed(x) + self.pos[:, :t], mask=mask, is_causal=True)
            return self.head(self.norm(h))

    return LanguageModel(EncoderLM(), "logits")


def _timm_convnext() -> L.LightningModule:
    from timm.models.convnext import ConvNeXt

    return ImageClassifier(ConvNeXt(in_chans=1, num_classes=10, depths=(1, 1, 2, 1), dims=(16, 32, 64, 128)), 1)


def _timm_vit() -> L.LightningModule:
    from timm.models.vision_transformer import VisionTransformer

    vit = VisionTransformer(img_size=32, patch_size=8, in_chans=1, num_classes=10, embed_dim=64, depth=2,
                            num_heads=4, mlp_ratio=2.0)  # fmt: skip
    return ImageClassifier(vit, 1)


def _tv_resnet18() -> L.LightningModule:
    from torchvision.models import resnet18

    return ImageClassifier(resnet18(num_classes=10))


def _tv_mobilenet() -> L.LightningModule:
    from torchvision.models import mobilenet_v3_small

    return ImageClassifier(mobilenet_v3_small(num_classes=10))


def _tv_vit() -> L.LightningModule:
    from torchvision.models import VisionTransformer

    return ImageClassifier(VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64,
                                             mlp_dim=128, num_classes=10))  # fmt: skip


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], L.LightningModule]
    data: str  # "text" or "images"
    requires: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("hf_gpt2", _hf_gpt2, "text", ("transformers",)),
        Family("hf_bert", _hf_bert, "text", ("transformers",)),
        Family("hf_llama", _hf_llama, "text", ("transformers",)),
        Family("hf_t5", _hf_t5, "text", ("transformers",)),
        Family("nn_transformer", _nn_transformer, "text"),
        Family("lightning_demo_transformer", _demo_transformer, "text"),
        Family("timm_convnext", _timm_convnext, "images", ("timm",)),
        Family("timm_vit", _timm_vit, "images", ("timm",)),
        Family("tv_resnet18", _tv_resnet18, "images"),
        Family("tv_mobilenet_v3", _tv_mobilenet, "images"),
        Family("tv_vit", _tv_vit, "images"),
    )
}


def _data(kind: str) -> L.LightningDataModule:
    from lightning_bigtrain.data import FashionMNISTDataModule, ShakespeareDataModule

    if kind == "text":
        return ShakespeareDataModule(block_size=BLOCK, batch_size=8, subset=8 * STEPS * 2)
    return FashionMNISTDataModule(batch_size=16, subset=16 * STEPS * 2)


def _build(family: Family, seed: int) -> L.LightningModule:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return family.build()


# --------------------------------------------------------------------------------------------------- cells
@dataclass(frozen=True)
class Cell:
    name: str
    kwargs: Callable[[Family], dict[str, Any]]
    evidence: str  # what "the technique acted" means for this cell
    meta: bool = False  # the model built under `trainer.init_module(empty_init=True)` (on the meta device)


def _zero(stage: int, engine: str = "torch") -> Callable[[Family], dict[str, Any]]:
    def kwargs(family: Family) -> dict[str, Any]:
        from lightning_bigtrain.strategies import DeepSpeedOptions, DeepSpeedZeroStrategy, ZeroStrategy

        if engine == "deepspeed":
            options = DeepSpeedOptions(reduce_bucket_size=20_000, allgather_bucket_size=20_000,
                                       param_persistence_threshold=0 if stage == 3 else None)  # fmt: skip
            return {"strategy": DeepSpeedZeroStrategy(stage=stage, deepspeed=options)}
        return {"strategy": ZeroStrategy(stage=stage, min_wrap_params=10_000)}

    return kwargs


def _compressed(family: Family) -> dict[str, Any]:
    from lightning_bigtrain.compression import PowerSGD
    from lightning_bigtrain.strategies import CompressedDDPStrategy

    return {"strategy": CompressedDDPStrategy(PowerSGD(rank=4))}


def _onebit_adam(family: Family) -> dict[str, Any]:
    from lightning_bigtrain.compression import OneBitAdam
    from lightning_bigtrain.strategies import CompressedDDPStrategy

    return {"strategy": CompressedDDPStrategy(OneBitAdam())}


def _auto_compression(family: Family) -> dict[str, Any]:
    """``compression="auto"`` with 2-step trials, so that the choice falls within the cell's 8 steps."""
    from lightning_bigtrain.compression import AutoCompression
    from lightning_bigtrain.strategies import CompressedDDPStrategy

    return {"strategy": CompressedDDPStrategy(AutoCompression(trial_steps=2))}


def _zero2_compressed(family: Family) -> dict[str, Any]:
    """ZeRO-2 with the gradients reduce-scattered compressed (PowerSGD, error feedback per rank)."""
    from lightning_bigtrain.compression import PowerSGD
    from lightning_bigtrain.strategies import ZeroStrategy

    return {"strategy": ZeroStrategy(stage=2, min_wrap_params=10_000, compression=PowerSGD(rank=4))}


def _tensor_parallel(sequence: bool) -> Callable[[Family], dict[str, Any]]:
    def kwargs(family: Family) -> dict[str, Any]:
        from lightning_bigtrain.strategies import ZeroStrategy

        return {"strategy": ZeroStrategy(stage=3, tensor_parallel=2, sequence_parallel=sequence)}

    return kwargs


def _zero3_checkpointed(family: Family) -> dict[str, Any]:
    """ZeRO-3 with the repeated blocks' activations checkpointed (recomputed in backward)."""
    from lightning_bigtrain.strategies import ZeroStrategy

    strategy = ZeroStrategy(stage=3, min_wrap_params=10_000, activation_checkpointing=True)
    return {"strategy": strategy, "callbacks": [_Recomputed()]}


def _zero2_bf16_mixed(family: Family) -> dict[str, Any]:
    """ZeRO-2 under Lightning's ``precision="bf16-mixed"``: 16-bit replicas and gradient buckets, fp32 masters."""
    from lightning_bigtrain.strategies import ZeroStrategy

    return {"strategy": ZeroStrategy(stage=2, min_wrap_params=10_000), "precision": "bf16-mixed",
            "callbacks": [_ParamDtypes()]}  # fmt: skip


def _ema_zero2_bf16_mixed(family: Family) -> dict[str, Any]:
    """Lightning's ``EMAWeightAveraging`` under ZeRO-2 in ``bf16-mixed``: the average is of the fp32 masters."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from lightning_bigtrain.strategies import ZeroStrategy

    return {"strategy": ZeroStrategy(stage=2, min_wrap_params=10_000), "precision": "bf16-mixed",
            "callbacks": [EMAWeightAveraging(decay=_EMA_DECAY), _MastersEMA(_EMA_DECAY)]}  # fmt: skip


_EMA_DECAY = 0.7


def _zero3_bf16_mixed(family: Family) -> dict[str, Any]:
    """ZeRO-3 under ``precision="bf16-mixed"``: FSDP2 gathers bf16 parameters (normalization layers' in fp32)."""
    from lightning_bigtrain.strategies import ZeroStrategy

    return {"strategy": ZeroStrategy(stage=3, min_wrap_params=10_000), "precision": "bf16-mixed",
            "callbacks": [_ComputeDtypes()]}  # fmt: skip


def _deepspeed3_bf16_mixed(family: Family) -> dict[str, Any]:
    """DeepSpeed's stage 3 under ``precision="bf16-mixed"``: bf16 parameters, autocast in forward."""
    return {**_zero(3, "deepspeed")(family), "precision": "bf16-mixed", "callbacks": [_ComputeDtypes()]}


def _pipeline(family: Family) -> dict[str, Any]:
    from lightning_bigtrain.strategies import ZeroStrategy

    return {"strategy": ZeroStrategy(pipeline_parallel=2)}


def _bf16(family: Family) -> dict[str, Any]:
    from lightning_bigtrain.plugins import BF16Precision

    return {"strategy": "ddp", "plugins": [BF16Precision("kahan")]}


def _fusion(family: Family) -> dict[str, Any]:
    from lightning_bigtrain.callbacks import OperatorFusion

    return {"strategy": "ddp", "callbacks": [OperatorFusion(compile="regional")]}


def _kd(family: Family) -> dict[str, Any]:
    from lightning_bigtrain.callbacks import KnowledgeDistillation

    return {"strategy": "ddp", "callbacks": [KnowledgeDistillation(_build(family, 1234), temperature=2.0)]}


def _kd_zero3(family: Family) -> dict[str, Any]:
    """Distillation with the student and the teacher sharded (ZeRO-3): the teacher's root unit gathered around the
    call of its submodule when the student's step calls one."""
    from lightning_bigtrain.strategies import ZeroStrategy

    return {**_kd(family), "strategy": ZeroStrategy(stage=3, min_wrap_params=10_000)}


#: Black and white of the Fashion-MNIST datamodule's standardised images.
_FMNIST_RANGE = ((0 - 0.2860) / 0.3530, (1 - 0.2860) / 0.3530)


def _augment(family: Family) -> dict[str, Any]:
    """Images: RandAugment, MixUp and CutMix with the loss mixed (the module's training_step unchanged, one
    forward); text: token masking."""
    from lightning_bigtrain.callbacks import BatchAugmentation

    if family.data == "text":
        return {"strategy": "ddp", "callbacks": [BatchAugmentation(token_mask=0.1, mask_token=VOCAB - 1)]}
    augment = BatchAugmentation(rand_augment=2, mixup=0.2, cutmix=1.0, value_range=_FMNIST_RANGE)
    return {"strategy": "ddp", "callbacks": [augment]}


def _magnitude(family: Family) -> dict[str, Any]:
    from lightning_bigtrain.callbacks import MagnitudePruning, PruningSchedule

    schedule = PruningSchedule(start=1, end=4, frequency=1)
    return {"strategy": "ddp", "callbacks": [MagnitudePruning(0.5, schedule=schedule, plot=False)]}


def _nm(family: Family) -> dict[str, Any]:
    from lightning_bigtrain.callbacks import MagnitudePruning, PruningSchedule

    return {"strategy": "ddp",
            "callbacks": [MagnitudePruning(pattern="2:4", schedule=PruningSchedule(start=2), plot=False)]}  # fmt: skip


def _structured(family: Family) -> dict[str, Any]:
    from lightning_bigtrain.callbacks import PruningSchedule, StructuredPruning

    return {"strategy": "ddp",
            "callbacks": [StructuredPruning(0.5, schedule=PruningSchedule(start=1, end=3, frequency=1))]}  # fmt: skip


def _everything(family: Family) -> dict[str, Any]:
    """ZeRO-2 + pure bf16 + regional compile + distillation + gradual magnitude pruning on one run."""
    from lightning_bigtrain.callbacks import KnowledgeDistillation, MagnitudePruning, OperatorFusion, PruningSchedule
    from lightning_bigtrain.plugins import BF16Precision
    from lightning_bigtrain.strategies import ZeroStrategy

    return {
        "strategy": ZeroStrategy(stage=2, min_wrap_params=10_000),
        "plugins": [BF16Precision("kahan")],
        "callbacks": [
            KnowledgeDistillation(_build(family, 1234)),
            MagnitudePruning(0.5, schedule=PruningSchedule(start=1, end=4, frequency=1), plot=False),
            OperatorFusion(compile="regional"),
        ],
    }


_META = (
    "built on meta (init_module(empty_init=True)), sharded, then materialized: nothing left unwritten or unreplayed, "
    "each starting tensor as the eager build's (exact where deterministic, the same spread where drawn); parameters "
    "per rank <= 0.75 of replicated"
)

CELLS: dict[str, Cell] = {
    c.name: c
    for c in (
        Cell("ddp", lambda f: {"strategy": "ddp"}, "replicas identical"),
        Cell("zero1", _zero(1), "optimizer state per rank <= 0.75 of replicated"),
        Cell("zero2", _zero(2), "optimizer state and gradients per rank <= 0.75 of replicated"),
        Cell("zero3", _zero(3), "parameters per rank <= 0.75 of replicated"),
        Cell("deepspeed2", _zero(2, "deepspeed"), "optimizer state per rank <= 0.75 of replicated"),
        Cell("deepspeed3", _zero(3, "deepspeed"), "parameters per rank <= 0.75 of replicated"),
        Cell("powersgd", _compressed, "bytes sent < dense all-reduce bytes"),
        Cell("bf16", _bf16, "parameters stored in bf16"),
        Cell("fusion", _fusion, "graphs compiled (compile='regional'), no eager fallback"),
        Cell("kd", _kd, "distill/kd_loss logged"),
        Cell("kd_zero3", _kd_zero3, "distill/kd_loss logged; parameters per rank <= 0.75 of replicated"),
        Cell("augment", _augment, "every training batch augmented; the loss on a clean batch falls"),
        Cell("magnitude", _magnitude, "weight sparsity >= 0.45"),
        Cell("nm_2_4", _nm, "2:4 pattern on the pruned weights"),
        Cell("structured", _structured, "parameters removed"),
        Cell("all", _everything, "ZeRO-2 shards + bf16 + graphs + kd_loss + sparsity"),
        Cell("onebit_adam", _onebit_adam, "bytes sent < dense all-reduce bytes"),
        Cell("auto", _auto_compression, "a compressor chosen after the trials; bytes sent < dense"),
        Cell("zero2_powersgd", _zero2_compressed, "as zero2, and bytes sent < dense reduce-scatter bytes"),
        Cell("tp2", _tensor_parallel(False), "blocks split: parameters per rank <= 0.75 of replicated"),
        Cell("tp2_sp", _tensor_parallel(True), "as tp2, with the blocks' norms sequence-parallel"),
        Cell("pp2", _pipeline, "two stages: parameters per rank <= 0.75 of replicated"),
        Cell(
            "zero3_ac",
            _zero3_checkpointed,
            "blocks checkpointed: a layer inside the first runs twice per training step (forward, recompute); "
            "parameters per rank <= 0.75 of replicated",
        ),
        Cell(
            "zero2_bf16",
            _zero2_bf16_mixed,
            "bf16 replicas in the step (fp32 masters); optimizer state and gradients per rank <= 0.75 of replicated",
        ),
        Cell(
            "ema_zero2_bf16",
            _ema_zero2_bf16_mixed,
            "the module ends holding the average in fp32, within 1e-6 of an EMA of the fp32 masters kept by hand",
        ),
        Cell("zero3_bf16", _zero3_bf16_mixed, "layers compute in bf16; parameters per rank <= 0.75 of replicated"),
        Cell(
            "deepspeed3_bf16",
            _deepspeed3_bf16_mixed,
            "layers compute in bf16; parameters per rank <= 0.75 of replicated",
        ),
        Cell("zero3_meta", _zero(3), _META, meta=True),
        Cell("deepspeed3_meta", _zero(3, "deepspeed"), _META, meta=True),
        Cell("tp2_meta", _tensor_parallel(False), _META, meta=True),
        Cell("pp2_meta", _pipeline, _META, meta=True),
    )
}


# ---------------------------------------------------------------------------------------------- measuring
class _Losses(L.Callback):
    """Losses per step; the model-state bytes of this rank at the first optimizer step after the first (gradients
    and optimizer state exist then)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.state: dict[str, int] | None = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.state is None and trainer.global_step >= 1:
            self.state = _state_bytes(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


class _Recomputed(L.Callback):
    """Calls per training step of the first layer with parameters inside the first checkpointed block: 2 when its
    activations were recomputed in backward, 1 otherwise."""

    def __init__(self) -> None:
        self.calls = 0
        self.steps = 0
        self.block: str | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        names = getattr(trainer.strategy, "checkpointed_blocks", [])
        if not names:
            return
        self.block = names[0]
        block = pl_module.get_submodule(names[0])
        leaf = next(m for m in block.modules() if next(m.parameters(recurse=False), None) is not None)

        def count(*_: Any) -> None:
            if pl_module.training:
                self.calls += 1

        leaf.register_forward_pre_hook(count)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps += 1


class _ParamDtypes(L.Callback):
    """The dtypes of the module's parameters during a training step (ZeRO-1/2 under ``-mixed`` swaps in 16-bit
    replicas)."""

    def __init__(self) -> None:
        self.dtypes: set[str] = set()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.dtypes.update(str(local_view(p).dtype) for p in pl_module.parameters())


class _MastersEMA(L.Callback):
    """The exponential moving average ``EMAWeightAveraging(decay)`` should hold, kept by hand after each step from
    the fp32 masters of ZeRO-1/2 (gathered whole; a parameter without one, from itself), in the module's parameter
    order."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.average: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        flats = trainer.strategy._flat_optimizers()  # type: ignore[attr-defined]
        masters = {id(p): m for o in flats for p, m in o.whole_masters()}  # collective: every rank
        now = [masters.get(id(p), p).detach().float() for p in pl_module.parameters()]
        if not self.average:
            self.average = [t.clone() for t in now]
        else:
            for a, t in zip(self.average, now, strict=True):
                a.lerp_(t, 1 - self.decay)


class _ComputeDtypes(L.Callback):
    """The dtypes of the outputs of the module's linear and convolution layers in training steps."""

    def __init__(self) -> None:
        self.dtypes: set[str] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def record(module: nn.Module, args: Any, out: Any) -> None:
            if pl_module.training and isinstance(out, torch.Tensor):
                self.dtypes.add(str(out.dtype))

        for m in pl_module.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)) or type(m).__name__ == "Conv1D":  # HF GPT-2's
                m.register_forward_hook(record)


class _StartWeights(L.Callback):
    """Every parameter and buffer whole at the start of training (sharded ones gathered, DeepSpeed's stage-3
    partitions too)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = _whole_weights(pl_module)


def _whole_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` whole, on the CPU: DTensors gathered, DeepSpeed's stage-3
    partitions gathered (a collective: call it on every rank)."""
    params = [p for p in module.parameters() if hasattr(p, "ds_tensor")]
    gathered: Any = contextlib.nullcontext()
    if params:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered:
        return {n: _whole(t) for n, t in module.state_dict(keep_vars=True).items()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().cpu().clone()


def _start_mismatch(reference: nn.Module, weights: dict[str, torch.Tensor], stage_blocks: str | None) -> list[str]:
    """The tensors whose starting value is not as the eager build's: exactly equal where that one is deterministic
    (integers, constants), finite with a standard deviation within a factor of 1.5 where drawn (each submodule is
    materialized under its own seed: the same distribution, not the same draws). Under a pipeline, the blocks of
    the cut container (``stage_blocks``) other stages hold are not here."""
    wrong = []
    for name, a in reference.state_dict().items():
        b = weights.get(name)
        if b is None and stage_blocks is not None and name.startswith(f"{stage_blocks}."):
            continue
        if b is None or b.shape != a.shape or b.dtype != a.dtype:
            wrong.append(f"{name}: missing or reshaped")
        elif not a.is_floating_point() or a.numel() < 2 or bool((a == a.reshape(-1)[0]).all()):
            if not torch.equal(a, b):
                wrong.append(f"{name}: not equal")
        elif not bool(torch.isfinite(b).all()):
            wrong.append(f"{name}: not finite")
        elif a.numel() >= 64 and not 1 / 1.5 < float(b.float().std() / a.float().std()) < 1.5:
            wrong.append(f"{name}: std {float(b.float().std()):.3g} against {float(a.float().std()):.3g}")
    return wrong[:8]


def _replica_digest(model: nn.Module, stage_blocks: str | None = None) -> tuple[str, int]:
    """A digest of each replicated parameter as this rank holds it (no gather), and how many were hashed. Under a
    pipeline each rank holds its own stage's blocks (``stage_blocks``, the container cut): only what is outside it
    is a replica."""
    h = hashlib.sha256()
    n = 0
    for name, p in model.named_parameters():
        if stage_blocks is not None and name.startswith(f"{stage_blocks}."):
            continue
        if is_replica(p):
            h.update(name.encode())
            h.update(local_view(p).detach().float().cpu().numpy().tobytes())
            n += 1
    return h.hexdigest(), n


def _state_bytes(trainer: L.Trainer, model: nn.Module) -> dict[str, int]:
    from lightning_bigtrain.functional.memory import model_state_bytes

    own = getattr(trainer.strategy, "model_state_bytes", None)
    if callable(own):
        return dict(own())
    return model_state_bytes(model, trainer.optimizers[0] if trainer.optimizers else None)


def _ours(tb: traceback.StackSummary) -> bool:
    return bool(tb) and f"{os.sep}lightning_bigtrain{os.sep}" in tb[-1].filename


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


class _Diverge(L.Callback):
    """Test-only: perturbs one replicated weight on rank 1 at the end, so that the replica check must fail."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1:
            p = next(p for p in pl_module.parameters() if is_replica(p))
            with torch.no_grad():
                local_view(p).view(-1)[0] += 1e-3


def _clean_loss(module: L.LightningModule, batch: Any) -> float:
    """The module's own training loss on a clean batch, without a gradient, ``self.log`` muted: how an augment cell
    shows that the model learned (the losses of augmented batches are too noisy over 8 steps). On a copy (no side
    effect on the run), dropout off, batch norm on the batch's statistics (its running ones are meaningless after a
    few steps)."""
    import copy

    probe = copy.deepcopy(module)
    probe.eval()
    for m in probe.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()
    probe.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    step = type(probe).training_step  # the class's, not a callback's wrapper on the instance
    with torch.no_grad():
        return float(step(probe, batch, 0))


def run_cell(rank: int, family_name: str, cell_name: str, workdir: str, diverge: bool = False) -> dict[str, Any]:
    """Run one cell on this rank (called on every rank by ``tests.helpers.distributed.run_on_ranks``)."""
    import warnings

    family, cell = FAMILIES[family_name], CELLS[cell_name]
    torch._dynamo.reset()  # the rank processes are reused: earlier cells' compiled code must not count here
    L.seed_everything(0, verbose=False)
    losses = _Losses()
    out: dict[str, Any] = {"family": family_name, "cell": cell_name}
    graphs_before = _dynamo_graphs()
    caught: list[str] = []
    try:
        model = _build(family, 0)
        numel = sum(p.numel() for p in model.parameters())
        data = _data(family.data)
        probe = None
        if cell_name == "augment":  # this rank's first training batch, clean
            data.setup()
            probe = next(iter(torch.utils.data.DataLoader(data._splits["train"], batch_size=data.batch_size)))
            out["clean_loss_before"] = _clean_loss(model, probe)
        planned = _planned(model, cell_name)
        kwargs = cell.kwargs(family)
        kwargs.setdefault("callbacks", []).append(losses)
        if diverge:
            kwargs["callbacks"].append(_Diverge())
        if cell.meta:
            kwargs["callbacks"].append(start := _StartWeights())
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, limit_val_batches=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, default_root_dir=workdir, **kwargs)  # fmt: skip
        if cell.meta:  # the eager build stays as the reference for the starting weights
            reference = model
            with trainer.init_module(empty_init=True):
                model = _build(family, 0)
            out["built_on_meta"] = has_meta_tensors(model)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.fit(model, datamodule=data)
        caught = [f"{w.category.__name__}: {w.message}" for w in seen
                  if "lightning_bigtrain" in w.category.__module__]  # fmt: skip
    except Exception as err:
        tb = traceback.extract_tb(err.__traceback__)
        # Refused: this package's message before the first optimizer step (at setup, or at the first batch where
        # the refusal needs the batch's shapes: pipeline parallelism); nothing was trained.
        out.update(status="refused" if (_ours(tb) and not losses.losses) else "FAILED",
                   error=f"{type(err).__name__}: {err}"[:600], where=f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "",
                   traceback="".join(traceback.format_exception(err))[-3000:] if not _ours(tb) else "")  # fmt: skip
        return out
    module = trainer.lightning_module
    if probe is not None:
        out["clean_loss_after"] = _clean_loss(module, probe)
    cut = getattr(trainer.strategy, "pipeline_plan", None)
    digest, compared = _replica_digest(module, cut.container if cut is not None else None)
    state = losses.state or _state_bytes(trainer, module)
    params_now = sum(local_view(p).numel() for p in module.parameters() if is_replica(p))
    out.update(
        losses=losses.losses,
        numel=numel,
        digest=digest,
        replicas_compared=compared,
        state_bytes=state,
        warnings=caught[:5],
        evidence=_evidence(cell_name, trainer, module, numel, state, _dynamo_graphs() - graphs_before, params_now),
    )
    if cell.meta:
        done = getattr(trainer.strategy, "materialized", None)
        split = getattr(trainer.strategy, "tensor_parallel_plan", None)
        if split is not None and split.swapped_attention:  # compared as the strategy holds them: q/k/v apart
            from lightning_bigtrain.functional.attention import swap_multihead_attention_

            swap_multihead_attention_(reference, split.swapped_attention)
        out["evidence"].update(
            built_on_meta=out["built_on_meta"],
            unwritten=None if done is None else [n for n, _ in done.unwritten] + done.not_replayed,
            start_mismatch=_start_mismatch(reference, start.weights, cut.container if cut is not None else None),
        )
        out["evidence"]["acted"] = bool(
            out["evidence"]["acted"] and out["built_on_meta"] and done is not None and not done.unwritten
            and not done.not_replayed and not out["evidence"]["start_mismatch"]
        )  # fmt: skip
    if planned is not None:
        # The planner's prediction for this model and strategy against what this rank holds.
        out["evidence"]["plan"] = {k: [planned[k], state.get(k, 0)] for k in ("params", "grads", "optimizer")}
        out["evidence"]["plan_exact"] = all(a == b for a, b in out["evidence"]["plan"].values())
    return out


def _optimizer_name(model: L.LightningModule) -> str:
    """The planner's name for the optimizer the module's ``configure_optimizers`` builds."""
    optimizer = model.configure_optimizers()
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd" if optimizer.defaults.get("momentum", 0) else "sgd-nomomentum"
    return {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam"}.get(type(optimizer), "adamw")


def _planned(model: L.LightningModule, cell: str) -> dict[str, int] | None:
    """``plan(model, devices=2, optimizer=<the module's>)``'s model states for the cell's strategy (DDP and ZeRO on
    the torch engine)."""
    if cell not in ("ddp", "zero1", "zero2", "zero3", "tp2", "pp2"):
        return None
    from lightning_bigtrain.planning import plan

    planned = plan(model, devices=2, accelerator="cpu", compression=False, optimizer=_optimizer_name(model))
    try:
        row = planned[{"tp2": "zero3_tp2", "pp2": "zero3_pp2"}.get(cell, cell)]
    except KeyError:  # no such row for this model (nothing to split, no blocks to cut): the note says why
        return None
    return {"params": int(row.params_bytes), "grads": int(row.grads_bytes), "optimizer": int(row.optimizer_bytes)}


def _sparsity(trainer: L.Trainer, module: nn.Module) -> tuple[float, bool]:
    """Fraction of zeros over the weights the pruning callback chose, and whether each follows 2:4 along its input
    dimension (Hugging Face's Conv1D stores that dimension first)."""
    from lightning_bigtrain.callbacks import MagnitudePruning

    callback = next(c for c in trainer.callbacks if isinstance(c, MagnitudePruning))  # type: ignore[attr-defined]
    named = dict(module.named_parameters(remove_duplicate=False))
    zeros = total = 0
    nm_ok = bool(callback.names)
    for name in callback.names:
        w = local_view(named[name]).detach()
        w = w.t() if name in callback._transposed else w
        zeros, total = zeros + int((w == 0).sum()), total + w.numel()
        if w.shape[-1] % 4 == 0:
            nm_ok = nm_ok and bool(((w.reshape(-1, 4) == 0).sum(-1) >= 2).all())
    return zeros / max(1, total), nm_ok


def _evidence(cell: str, trainer: L.Trainer, module: nn.Module, numel: int, state: dict[str, int], graphs: int,
              params_now: int) -> dict[str, Any]:  # fmt: skip
    ev: dict[str, Any] = {}
    full = 4 * numel  # fp32 bytes of one copy of the parameters
    if cell in ("zero1", "zero2", "deepspeed2", "all", "zero2_powersgd", "zero2_bf16"):
        # Per-rank optimizer state over an Adam state of the whole model (2 fp32 copies); SGD without momentum
        # (Lightning's demo) has none, so its shard is empty too.
        # Under bf16-mixed the shard holds the fp32 masters too, against DDP's fp32 parameters and Adam state.
        ev["optimizer_fraction"] = state.get("optimizer", 0) / ((3 if cell == "zero2_bf16" else 2) * full)
        ev["acted"] = ev["optimizer_fraction"] <= 0.75
    if cell in ("zero2", "deepspeed2", "zero2_powersgd", "zero2_bf16"):
        ev["grads_fraction"] = state.get("grads", 0) / full
        ev["acted"] = ev["acted"] and ev["grads_fraction"] <= 0.75
    if cell in ("zero3", "deepspeed3", "tp2", "tp2_sp", "pp2", "zero3_meta", "deepspeed3_meta", "tp2_meta", "pp2_meta",
                "kd_zero3", "zero3_ac", "zero3_bf16", "deepspeed3_bf16"):  # fmt: skip
        ev["params_fraction"] = state.get("params", 0) / full
        ev["acted"] = ev["params_fraction"] <= 0.75
    if cell in ("tp2", "tp2_sp", "tp2_meta"):
        split = trainer.strategy.tensor_parallel_plan  # type: ignore[attr-defined]
        ev["splits"] = len(split.splits)
        ev["acted"] = ev["acted"] and bool(split.splits)
        if cell == "tp2_sp":
            ev["sequence_parallel_norms"] = len(split.norms) if split.sequence_dim is not None else 0
            ev["acted"] = ev["acted"] and split.sequence_dim is not None
    if cell in ("pp2", "pp2_meta"):
        cut = trainer.strategy.pipeline_plan  # type: ignore[attr-defined]
        ev["stages"] = [list(cut.blocks(s)) for s in range(cut.stages)]
        ev["acted"] = ev["acted"] and cut.stages == 2
    if cell in ("powersgd", "onebit_adam", "auto", "zero2_powersgd"):
        engine = trainer.strategy.compression_engine  # type: ignore[attr-defined]
        ev["sent_over_dense"] = engine.sent_bytes / max(1, engine.dense_bytes)
        ev["acted"] = ev.get("acted", True) and ev["sent_over_dense"] < 1.0
    if cell == "auto":
        choice = engine.compressor.choice
        ev["choice"] = None if choice is None else repr(choice)
        ev["acted"] = ev["acted"] and choice is not None
    if cell in ("bf16", "all"):
        dtypes = {str(local_view(p).dtype) for p in module.parameters()}
        ev["param_dtypes"] = sorted(dtypes)
        ev["acted"] = ev.get("acted", True) and dtypes == {"torch.bfloat16"}
    if cell in ("fusion", "all"):
        ev["graphs"] = graphs
        ev["acted"] = ev.get("acted", True) and graphs > 0
    if cell in ("kd", "all", "kd_zero3"):
        ev["kd_loss"] = float(trainer.callback_metrics.get("distill/kd_loss", float("nan")))
        ev["acted"] = ev.get("acted", True) and math.isfinite(ev["kd_loss"])
    if cell == "augment":
        from lightning_bigtrain.callbacks import BatchAugmentation

        augment = next(c for c in trainer.callbacks if isinstance(c, BatchAugmentation))  # type: ignore[attr-defined]
        ev["augmented_batches"] = augment.augmented_batches
        ev["acted"] = augment.augmented_batches >= STEPS
    if cell in ("magnitude", "nm_2_4", "all"):
        sparsity, nm = _sparsity(trainer, module)
        ev["sparsity"] = round(sparsity, 3)
        ev["acted"] = ev.get("acted", True) and (nm if cell == "nm_2_4" else sparsity >= 0.45)
    if cell == "structured":
        ev["params_before"], ev["params_after"] = numel, params_now
        ev["removed"] = round(1 - params_now / numel, 3)
        ev["acted"] = params_now < numel
    if cell == "zero3_ac":
        recomputed = next(c for c in trainer.callbacks if isinstance(c, _Recomputed))  # type: ignore[attr-defined]
        ev["checkpointed_blocks"] = len(trainer.strategy.checkpointed_blocks)  # type: ignore[attr-defined]
        ev["calls_per_step"] = recomputed.calls / max(1, recomputed.steps)
        ev["acted"] = ev["acted"] and ev["checkpointed_blocks"] > 0 and ev["calls_per_step"] == 2
    if cell == "zero2_bf16":
        seen = next(c for c in trainer.callbacks if isinstance(c, _ParamDtypes))  # type: ignore[attr-defined]
        ev["param_dtypes_in_step"] = sorted(seen.dtypes)
        ev["acted"] = ev["acted"] and "torch.bfloat16" in seen.dtypes
    if cell == "ema_zero2_bf16":
        ema = next(c for c in trainer.callbacks if isinstance(c, _MastersEMA))  # type: ignore[attr-defined]
        held = [local_view(p).detach() for p in module.parameters()]
        ev["param_dtypes"] = sorted({str(p.dtype) for p in held})
        ev["ema_gap"] = max(((p.float() - a).abs().max().item() for p, a in zip(held, ema.average, strict=True)),
                            default=float("inf"))  # fmt: skip
        ev["acted"] = bool(ema.average) and ev["param_dtypes"] == ["torch.float32"] and ev["ema_gap"] <= 1e-6
    if cell in ("zero3_bf16", "deepspeed3_bf16"):
        seen = next(c for c in trainer.callbacks if isinstance(c, _ComputeDtypes))  # type: ignore[attr-defined]
        ev["compute_dtypes"] = sorted(seen.dtypes)
        ev["acted"] = ev["acted"] and "torch.bfloat16" in seen.dtypes
    if cell == "ddp":
        ev["acted"] = True
    return ev


def classify(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of the matrix from both ranks' results."""
    first = results[0]
    row = {k: first.get(k) for k in ("family", "cell", "status", "error", "where", "traceback")}
    if "status" in first:
        return row
    problems = []
    losses = first["losses"]
    if len(losses) < STEPS or not all(math.isfinite(v) for v in losses):
        problems.append(f"losses not finite or missing: {losses}")
    elif "clean_loss_before" in first:  # augmented batches: judged on a clean batch before and after
        before, after = first["clean_loss_before"], first["clean_loss_after"]
        first["evidence"]["clean_loss"] = [round(before, 4), round(after, 4)]
        if not after < before:
            problems.append(f"the loss on a clean batch did not fall: {before:.4f} -> {after:.4f}")
    elif sum(losses[-3:]) / 3 >= losses[0]:
        problems.append(f"loss did not fall below the first step's: {[round(v, 3) for v in losses]}")
    if len({r["digest"] for r in results}) != 1:
        problems.append("replicated tensors differ between ranks")
    status = "FAILED" if problems else "ok"
    if not first["evidence"].get("acted"):
        said = [w for w in first["warnings"] if w.startswith("NoEffectWarning")]
        if not problems and said:  # trained, without the technique, and this package said why
            status, problems = "warned", [said[0]]
        else:
            status = "FAILED"
            problems.append(f"technique did not act: {first['evidence']}")
    row.update(status=status, error="; ".join(problems), evidence=first["evidence"],
               loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
               replicas_compared=first["replicas_compared"], warnings=first["warnings"])  # fmt: skip
    return row


def run(family: str, cell: str, workdir: str, diverge: bool = False) -> dict[str, Any]:
    from tests.helpers.distributed import run_on_ranks

    try:
        return classify(run_on_ranks(run_cell, family, cell, workdir, diverge, init_process_group=False))
    except RuntimeError as err:  # a rank died or raised outside the fit
        return {"family": family, "cell": cell, "status": "FAILED", "error": str(err)[-600:]}


# ------------------------------------------------------------------------------------------------- README
README = Path(__file__).resolve().parents[1] / "README.md"
_BEGIN, _END = "<!-- conformance:begin -->", "<!-- conformance:end -->"
_MARK = {"ok": "ok", "refused": "refused", "warned": "warned", "FAILED": "**FAILED**"}


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Cells per status: ``ok``, ``refused``, ``warned``, ``FAILED``."""
    return {status: sum(r["status"] == status for r in rows) for status in _MARK}


def render(results: dict[str, Any]) -> str:
    rows = results["rows"]
    families = list(dict.fromkeys(r["family"] for r in rows))
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    at = {(r["family"], r["cell"]): r for r in rows}
    ok, refused, warned, failed = counts(rows).values()
    from collections import Counter

    runs = Counter(
        (r.get("commit") or results.get("commit", "?"), r.get("command") or results["command"]) for r in rows
    )
    where = "; ".join(f"commit `{c}`, `{cmd}`: {n} cells" for (c, cmd), n in runs.items())
    lines = [_BEGIN, f"Measured {results['machine']['time'][:10]} ({where}; `benchmarks/results/conformance.json`): "
             f"{ok} ok, {refused} refused with a message, {warned} trained without the technique with a warning "
             f"saying why, {failed} failed, of {len(rows)} cells.", "",
             "| family | " + " | ".join(cells) + " |", "|---" * (len(cells) + 1) + "|"]  # fmt: skip
    for f in families:
        lines.append(
            f"| {f} | " + " | ".join(_MARK[at[(f, c)]["status"]] if (f, c) in at else "-" for c in cells) + " |"
        )
    planned = [r for r in rows if "plan_exact" in (r.get("evidence") or {})]
    if planned:
        exact = [r for r in planned if r["evidence"]["plan_exact"]]
        lines.append("")
        missed = ", ".join(f"{r['family']} x {r['cell']}" for r in planned if r not in exact)
        lines.append(
            f"Planner: `plan(model, devices=2)` predicted the parameter, gradient and optimizer bytes each rank held "
            f"exactly in {len(exact)} of {len(planned)} DDP, ZeRO, tp2 and pp2 cells"
            + (f": not in {missed}." if missed else ".")
        )
    notes = [r for r in rows if r["status"] != "ok"]
    if notes:
        lines.append("")
        for r in notes:
            lines.append(f"- {r['family']} x {r['cell']} ({r['status']}): {str(r.get('error', ''))[:240]}")
    lines.append(_END)
    return "\n".join(lines)


def render_readme(results_path: Path, readme: Path = README) -> bool:
    """Re-render the ``conformance`` block from ``results_path`` wherever it stands in README.md and docs/*.md
    (:func:`benchmarks.figures.write`; ``readme`` is kept for callers, the docs are found by the registry).
    True when every doc that should hold the block has it."""
    from benchmarks.figures import rewrite_block

    return rewrite_block("conformance", results_path.parent)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from benchmarks.common import RESULTS_DIR, git_commit, print_table, write_results

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render", action="store_true", help="only re-render the README block from the results")
    parser.add_argument("--merge", action="store_true", help="keep the other cells' rows from the results file")
    args = parser.parse_args(argv)
    if args.render:
        render_readme(args.results_dir / "conformance.json")
        return 0
    commit = git_commit()
    command = " ".join(["python -m benchmarks.conformance", *(argv if argv is not None else sys.argv[1:])])
    import json

    previous = args.results_dir / "conformance.json"
    kept: list[dict[str, Any]] = []
    if args.merge and previous.exists():
        old = json.loads(previous.read_text())
        kept = [{"commit": old.get("commit"), "command": old.get("command"), **r} for r in old["rows"]]
    rows: list[dict[str, Any]] = []
    for family in args.families:
        for cell in args.cells:
            with tempfile.TemporaryDirectory() as tmp:
                row = {"commit": commit, "command": command, **run(family, cell, tmp)}
            print(f"{family} x {cell}: {row['status']} {row.get('error') or row.get('evidence')}", flush=True)
            rows.append(row)
            done = {(r["family"], r["cell"]): r for r in [*kept, *rows]}  # re-run cells replace kept ones
            order = [(f, c) for f in FAMILIES for c in CELLS if (f, c) in done]
            table = [done[k] for k in order]
            ok = sum(r["status"] == "ok" for r in table)
            write_results("conformance", {"commit": commit, "command": command, "rows": table},
                          f"{ok}/{len(table)} cells ok", args.results_dir)  # fmt: skip
    print_table(rows, ["family", "cell", "status", "error"])  # write_results re-rendered the docs' block
    return 0


if __name__ == "__main__":
    sys.exit(main())
