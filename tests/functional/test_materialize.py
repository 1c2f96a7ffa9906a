"""Materializing a module built on the meta device, in one process (the sharded case: tests/strategies/
test_meta_init_integration.py): each tensor initialized as the model would initialize it, whatever else is
materialized and in what order; what none initializes reported; tied weights kept tied."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import math

import pytest
import torch
from torch import nn

from lightning_bigtrain.functional.materialize import has_meta_tensors, materialize_, record_init

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def _pair(build):
    torch.manual_seed(0)
    eager = build()
    with torch.device("meta"):
        meta = build()
    torch.manual_seed(0)
    done = materialize_(meta, torch.device("cpu"))
    assert done.not_replayed == []
    return eager, meta, done.unwritten


def _build_torch_layers() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 8), nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
                         nn.LayerNorm(8), nn.Linear(8, 10), nn.BatchNorm1d(10))  # fmt: skip


def test_torch_layers_are_initialized_as_their_constructors_would():
    """Layers whose constructor initializes through ``reset_parameters`` (``_reset_parameters`` in attention): the
    same distributions as an eager build (each submodule under its own seed: not the same draws); zeros, ones and
    buffers exact."""
    eager, meta, left = _pair(_build_torch_layers)
    assert left == [] and not has_meta_tensors(meta)
    for (name, a), b in zip(eager.state_dict().items(), meta.state_dict().values(), strict=True):
        if a.is_floating_point() and a.numel() > 1 and a.std() > 0:
            assert torch.isfinite(b).all() and abs(b.std() / a.std() - 1) < 0.35, (name, a.std(), b.std())
        else:
            assert torch.equal(a, b), name


def test_the_values_do_not_depend_on_what_else_is_materialized_or_when():
    """Each submodule under a seed folded from the model's and its name: one unit at a time (DeepSpeed's stage 3), a
    pipeline stage's blocks alone, or the whole model at once give the same values."""
    with record_init(), torch.device("meta"):
        whole, parts = _build_torch_layers(), _build_torch_layers()
    materialize_(whole, torch.device("cpu"), seed=7)
    torch.manual_seed(123)  # (the stream's position does not matter)
    materialize_(parts, torch.device("cpu"), seed=7, within=parts[3])
    materialize_(parts, torch.device("cpu"), seed=7, within=parts[1])
    materialize_(parts, torch.device("cpu"), seed=7)
    for (name, a), b in zip(whole.state_dict().items(), parts.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


class _Written(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # no reset_parameters on this module
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)


def test_what_no_initializer_writes_is_reported_restorable_or_not():
    _, meta, left = _pair(_Written)
    assert sorted(left) == [("mask", False), ("scale", True)]
    assert torch.isfinite(meta.proj.weight).all()


def test_tied_weights_stay_tied():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    _, meta, left = _pair(Tied)
    assert left == [] and meta.head.weight is meta.emb.weight


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hugging_face_models_get_their_own_initialization(family):
    """``_init_weights`` per module, children first, as ``post_init``: the rotary frequencies and RMSNorm weights
    (no ``reset_parameters``), GPT-2's tied head and its residual projections scaled by 1/sqrt(2 n_layer)."""
    from benchmarks.conformance import _hf_gpt2, _hf_llama

    eager, meta, left = _pair(_hf_llama if family == "llama" else _hf_gpt2)
    assert left == []
    for name, b in eager.named_buffers():
        assert torch.equal(b, meta.get_buffer(name)), name
    params = dict(meta.named_parameters())
    for name, p in eager.named_parameters():
        q = params[name]
        if p.std() == 0:  # zeros and ones: norms and biases
            assert torch.equal(p, q), name
        else:
            assert torch.isfinite(q).all() and abs(q.std() / p.std() - 1) < 0.15, (name, p.std(), q.std())
    if family == "gpt2":
        assert meta.model.lm_head.weight is meta.model.transformer.wte.weight


def test_a_constructors_own_initialization_is_replayed():
    """Built under ``record_init``: the char-GPT's ``self.apply(self._init_weights)`` (normal 0.02, zero biases) and
    its residual projections rescaled after it, and an embedding's zeroed padding row, come back; without the record
    the layers get torch's defaults (the embeddings' std 1)."""
    from lightning_bigtrain.models import CharGPT

    def build():
        model = CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=32)
        model.pad = nn.Embedding(10, 32, padding_idx=0)
        return model

    torch.manual_seed(0)
    eager = build()
    with record_init(), torch.device("meta"):
        meta = build()
    with torch.device("meta"):
        unrecorded = build()
    assert materialize_(meta, torch.device("cpu")) == ([], [], [])
    materialize_(unrecorded, torch.device("cpu"))
    params = dict(meta.named_parameters())
    for name, p in eager.named_parameters():
        q = params[name]
        if p.std() == 0:
            assert torch.equal(p, q), name
        else:
            assert abs(q.std() / p.std() - 1) < 0.15, (name, p.std(), q.std())
    assert torch.equal(meta.pad.weight[0], torch.zeros(32))
    assert unrecorded.tok_emb.weight.std() > 0.5


def test_weights_loaded_on_meta_land_and_values_computed_there_too():
    """``load_state_dict`` of real weights into a module on meta (in ``configure_model``, before sharding) is a
    recorded copy: replayed, the weights land. A value computed on meta from recorded values is computed again. One
    computed from a meta tensor made before recording began cannot be: named, and ``reset_parameters()`` used
    instead."""
    loaded = nn.Linear(4, 4).state_dict()
    before = torch.ones(4, 4, device="meta")  # (made outside the recording: its value is unknown)
    with record_init(), torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        model[0].load_state_dict(loaded)
        with torch.no_grad():
            model[1].weight.copy_(torch.eye(4) * 2)
            model[2].weight.copy_(before * 2)
    done = materialize_(model, torch.device("cpu"))
    assert done == ([], ["2.weight"], [])
    assert torch.equal(model[0].weight, loaded["weight"]) and torch.equal(model[0].bias, loaded["bias"])
    assert torch.equal(model[1].weight, torch.eye(4) * 2)
    assert torch.isfinite(model[2].weight).all() and not torch.equal(model[2].weight, torch.full((4, 4), 2.0))


class _BuiltOutOfPlace(nn.Module):
    """Values a constructor builds out of place on meta, then wraps in a parameter or registers: the PyTorch
    tutorial's sinusoidal position table (written through strided slices), a layer scale, a class token, a position
    embedding drawn in place before it is wrapped, a relative-position index (torchvision's Swin: a view registered),
    a weight written through ``.data``, deep copies of a layer (``_get_clones``: their tensors set without
    registration), constants from ``torch.tensor(data)`` and ``new_tensor`` (built on meta through no operation),
    and a layout computed from tensors and read with ``.tolist()`` (torch refuses that on meta: no data)."""

    def __init__(self, d: int = 8, n: int = 12, layout: bool = True) -> None:
        super().__init__()
        position = torch.arange(n).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(n, 1, d)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)
        self.gamma = nn.Parameter(1e-6 * torch.ones(d))
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.empty(1, n, d).normal_(std=0.02))
        coords = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(3), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        relative[:, :, 0] += 2
        self.register_buffer("index", relative.sum(-1).flatten(), persistent=False)
        self.proj = nn.Linear(d, d)
        self.proj.weight.data.fill_(0.5)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale", self.proj.weight.new_tensor([2.0, 3.0]))
        # A layout computed from tensors (torchvision's RegNet):
        widths = (torch.arange(3) * 1.5 + 2).round().int().tolist() if layout else [2, 4, 5]
        self.heads = nn.ModuleList(nn.Linear(d, w) for w in widths)
        layer = nn.Module()
        layer.gamma = nn.Parameter(1e-3 * torch.ones(d))
        self.copies = nn.ModuleList([copy.deepcopy(layer) for _ in range(2)])  # (`_get_clones`)


def test_values_built_out_of_place_are_computed_again():
    """Recorded by the operations that made them, and by the module's registration hooks (``nn.Parameter(value)``
    is a new tensor on the same storage, which no operation shows): exact where the constructor is deterministic,
    the same distribution where it draws. Unrecorded, every one of them was uninitialized memory."""
    torch.manual_seed(0)
    eager = _BuiltOutOfPlace()
    with record_init(), torch.device("meta"):
        meta = _BuiltOutOfPlace()
    assert materialize_(meta, torch.device("cpu")) == ([], [], [])
    for name, a in itertools.chain(eager.named_parameters(), eager.named_buffers()):
        b = meta.get_parameter(name) if name in dict(meta.named_parameters()) else meta.get_buffer(name)
        if name == "pos":
            assert abs(b.std() / a.std() - 1) < 0.2 and not torch.equal(a, b), name
        elif name == "proj.bias" or name.startswith("heads."):  # (the Linears' own draws)
            assert b.abs().max() <= 8**-0.5 and not torch.equal(a, b), name
        else:
            assert torch.equal(a, b), name
    with torch.device("meta"), pytest.raises(NotImplementedError, match="meta"):
        _BuiltOutOfPlace()  # (unrecorded, torch cannot read the layout's values: built without it below)
    with torch.device("meta"):
        unrecorded = _BuiltOutOfPlace(layout=False)
    left = {name for name, _ in materialize_(unrecorded, torch.device("cpu")).unwritten}
    assert [h.out_features for h in meta.heads] == [2, 4, 5]
    assert left == {"pe", "gamma", "cls", "pos", "index", "copies.0.gamma", "copies.1.gamma", "mean", "scale"}


def test_what_the_constructor_leaves_empty_is_reported_apart():
    """``torch.empty`` with nothing written after (a cache a forward fills) is uninitialized in an eager build too:
    reported as such, not as a value the materialization lost (which a strategy refuses for a non-persistent
    buffer)."""

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("cache", torch.empty(4, 4), persistent=False)

    with record_init(), torch.device("meta"):
        meta = Cached()
    assert materialize_(meta, torch.device("cpu")) == ([], [], ["cache"])
    assert torch.isnan(meta.cache).all() and torch.isfinite(meta.proj.weight).all()


@pytest.mark.parametrize("family", ["vit", "swin", "convnext", "regnet"])
def test_torchvision_models_built_on_meta_come_back_whole(family):
    """Models we did not write: torchvision's ViT (class token, position embedding), Swin (relative-position
    index), ConvNeXt (layer scale), RegNet (its widths computed with tensors), built on meta and materialized:
    nothing unwritten, every deterministic tensor exact (the relative-position index indexes a bias table: garbage
    there was an out-of-range gather)."""
    import torchvision

    def build():
        if family == "vit":
            return torchvision.models.VisionTransformer(
                image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
            )
        if family == "swin":
            return torchvision.models.SwinTransformer(
                patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4], num_classes=10
            )
        if family == "regnet":  # (its layout computed from tensors, read with `.tolist()`)
            return torchvision.models.regnet_y_400mf(num_classes=10)
        return torchvision.models.ConvNeXt([torchvision.models.convnext.CNBlockConfig(16, 32, 2)], num_classes=10)

    torch.manual_seed(0)
    eager = build()
    with record_init(), torch.device("meta"):
        meta = build()
    assert materialize_(meta, torch.device("cpu")) == ([], [], [])
    for (name, a), b in zip(eager.state_dict().items(), meta.state_dict().values(), strict=True):
        if not a.is_floating_point() or a.unique().numel() == 1:
            assert torch.equal(a, b), name
        elif a.numel() > 64:
            assert abs(b.std() / a.std() - 1) < 0.3, (name, a.std(), b.std())
    x = torch.randn(2, 3, 32, 32)
    assert torch.isfinite(meta(x)).all()


def test_torch_transformer_and_truncated_normal_initializations_come_back():
    """``nn.Transformer`` re-initializes its layers' weights (Xavier) after building them, and its attention zeroes
    its output bias; the fallback ``reset_parameters`` of a layer whose bias alone has no record kept neither before.
    ``nn.init.trunc_normal_`` does nothing on a meta tensor (torch returns at once): the call itself is recorded."""

    def build():
        model = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64)
        model.proj = nn.Linear(32, 32)
        nn.init.trunc_normal_(model.proj.weight, std=0.02)
        return model

    torch.manual_seed(0)
    eager = build()
    with record_init(), torch.device("meta"):
        meta = build()
    assert materialize_(meta, torch.device("cpu")) == ([], [], [])
    weight = meta.encoder.layers[0].linear1.weight
    assert weight.abs().max() > 1 / 32**0.5  # Xavier's bound (0.35) is above kaiming's (1/sqrt(32))
    assert torch.equal(meta.encoder.layers[0].self_attn.out_proj.bias, torch.zeros(32))
    assert abs(meta.proj.weight.std() / eager.proj.weight.std() - 1) < 0.15  # (0.02; the Linear default: 0.1)


def test_a_modules_metrics_built_on_meta_come_back():
    """torchmetrics metrics keep their states as plain attributes and their defaults in a dict, and remember the
    device they were built on: left on meta, the first ``.to()`` (the strategy's) failed ("Cannot copy out of meta
    tensor"). Their states are computed from the record and their device set."""
    from lightning_bigtrain.models import FashionCNN

    with record_init(), torch.device("meta"):
        model = FashionCNN(channels=(8, 16))
    assert materialize_(model, torch.device("cpu")) == ([], [], [])
    model.to("cpu")
    model.val_acc.update(torch.randn(4, 10), torch.tensor([1, 2, 3, 4]))
    assert 0 <= float(model.val_acc.compute()) <= 1
    model.val_acc.reset()
    assert torch.equal(model.val_acc.tp, torch.zeros(10, dtype=torch.long)) and model.val_acc.device.type == "cpu"


class _Momentum(nn.Module):
    """A momentum (target) encoder started as a copy of the online one, both ways users write it (BYOL, MoCo)."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.target = copy.deepcopy(self.online)
        self.momentum = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        with torch.no_grad():
            for mine, theirs in zip(self.momentum.parameters(), self.online.parameters(), strict=True):
                mine.copy_(theirs)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32), 3, enable_nested_tensor=False)


def test_copies_start_equal_as_in_an_eager_build_whatever_is_materialized_first():
    """A value several tensors copy (a deep copy's source, a ``copy_``'s) is computed once: the momentum encoders
    start equal to the online one, and ``nn.TransformerEncoder``'s deep-copied layers equal to each other, as in an
    eager build (each had its own draw). Drawn under a seed of the copies' first name, so materializing the later
    copies first (a pipeline stage holding them, DeepSpeed's units in another order) gives the same values."""
    with record_init(), torch.device("meta"):
        whole, parts = _Momentum(), _Momentum()
    assert materialize_(whole, torch.device("cpu"), seed=3) == ([], [], [])
    for copied in (whole.target, whole.momentum):
        for a, b in zip(whole.online.parameters(), copied.parameters(), strict=True):
            assert torch.equal(a, b)
    layers = whole.encoder.layers
    assert torch.equal(layers[0].linear1.weight, layers[2].linear1.weight)
    assert not torch.equal(whole.online[0].weight, whole.encoder.layers[0].linear1.weight[:, :8])
    copied: dict = {}
    materialize_(parts, torch.device("cpu"), seed=3, within=parts.encoder.layers[2], copied=copied)
    materialize_(parts, torch.device("cpu"), seed=3, within=parts.momentum, copied=copied)
    materialize_(parts, torch.device("cpu"), seed=3, copied=copied)
    for (name, a), b in zip(whole.state_dict().items(), parts.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
