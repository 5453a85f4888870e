"""Loaders: each real on-disk format, written small by the test, read without network."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image

import torchvision.datasets.cifar as tv_cifar
import torchvision.datasets.mnist as tv_mnist
import torchvision.datasets.svhn as tv_svhn
import torchvision.datasets.utils as tv_utils
from fedfiot_flwr.data import (
    DatasetBundle,
    DatasetUnavailableError,
    clear_dataset_cache,
    load_dataset,
    read_idx,
)
from fedfiot_flwr.data.loaders import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CINIC10_MEAN,
    CINIC10_STD,
    DEBIAN_FMNIST_DIR,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    SVHN_MEAN,
    SVHN_STD,
)

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh cache, no real download directory, no network for torchvision."""
    clear_dataset_cache()
    monkeypatch.setenv("FEDFIOT_DATA_DIR", str(tmp_path / "default-root"))

    def no_network(*args: object, **kwargs: object) -> None:
        raise OSError("network disabled in tests")

    for module in (tv_cifar, tv_mnist, tv_utils):
        monkeypatch.setattr(module, "download_and_extract_archive", no_network)
    monkeypatch.setattr(tv_svhn, "download_url", no_network)


def _normalised(pixel: int, mean: float, std: float, scale: float = 255.0) -> float:
    return (pixel / scale - mean) / std


# --------------------------------------------------------------------------- digits


def test_digits_split_normalisation_and_cache() -> None:
    bundle = load_dataset("digits")
    assert isinstance(bundle, DatasetBundle)
    assert (len(bundle.train), len(bundle.test)) == (1347, 450)
    assert bundle.input_shape == (1, 8, 8) and bundle.num_classes == 10
    assert bundle.train_targets.dtype == np.int64
    x, y = bundle.train[0]
    assert x.dtype == torch.float32 and x.shape == (1, 8, 8) and isinstance(y, int)
    xs = torch.stack([bundle.train[i][0] for i in range(len(bundle.train))])
    assert abs(xs.mean().item()) < 1e-4 and abs(xs.std(unbiased=False).item() - 1) < 1e-4
    # stratified: every class keeps its share in both splits (within one example)
    train_counts = np.bincount(bundle.train_targets, minlength=10)
    test_counts = np.bincount(bundle.test_targets, minlength=10)
    assert np.all(np.abs(train_counts / 3 - test_counts) <= 1.5)
    assert load_dataset("digits") is bundle  # cached per process
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(bundle.train, [5, 2, 9]), batch_size=3)
    xb, yb = next(iter(loader))  # batched __getitems__ path == item path
    torch.testing.assert_close(xb, torch.stack([bundle.train[i][0] for i in (5, 2, 9)]))
    assert yb.tolist() == [bundle.train[i][1] for i in (5, 2, 9)]
    assert load_dataset("digits", augment=True).augmented is False  # 8x8 grey: never augmented


def test_unknown_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown data set 'mnist'"):
        load_dataset("mnist")


# --------------------------------------------------------------------- Fashion-MNIST


def _write_idx_gz(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _write_fmnist(directory: Path, n_train: int = 30, n_test: int = 10) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    images = rng.integers(0, 256, size=(n_train + n_test, 28, 28), dtype=np.uint8)
    labels = np.arange(n_train + n_test, dtype=np.uint8) % 10
    _write_idx_gz(directory / "train-images-idx3-ubyte.gz", images[:n_train])
    _write_idx_gz(directory / "train-labels-idx1-ubyte.gz", labels[:n_train])
    _write_idx_gz(directory / "t10k-images-idx3-ubyte.gz", images[n_train:])
    _write_idx_gz(directory / "t10k-labels-idx1-ubyte.gz", labels[n_train:])
    return images, labels


def _check_fmnist(bundle: DatasetBundle, images: np.ndarray, labels: np.ndarray) -> None:
    assert (len(bundle.train), len(bundle.test)) == (30, 10)
    assert bundle.input_shape == (1, 28, 28) and bundle.num_classes == 10
    np.testing.assert_array_equal(bundle.train_targets, labels[:30])
    x, y = bundle.test[3]
    assert y == int(labels[33])
    expected = _normalised(int(images[33, 5, 7]), FASHION_MNIST_MEAN[0], FASHION_MNIST_STD[0])
    assert x[0, 5, 7].item() == pytest.approx(expected, abs=1e-5)


def test_fashion_mnist_idx_from_user_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDFIOT_FMNIST_DIR", str(tmp_path / "nowhere"))
    images, labels = _write_fmnist(tmp_path / "fm")
    _check_fmnist(load_dataset("fashion-mnist", root=tmp_path / "fm", download=False), images, labels)


def test_fashion_mnist_idx_from_env_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images, labels = _write_fmnist(tmp_path / "debian")
    monkeypatch.setenv("FEDFIOT_FMNIST_DIR", str(tmp_path / "debian"))
    _check_fmnist(load_dataset("fmnist", download=False), images, labels)


def test_fashion_mnist_falls_back_to_torchvision_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No IDX files anywhere: torchvision's download path runs (its fetch is faked offline)."""
    monkeypatch.setenv("FEDFIOT_FMNIST_DIR", str(tmp_path / "nowhere"))
    source = tmp_path / "served"
    images, labels = _write_fmnist(source)
    fetched: list[str] = []

    def fake_fetch(url: str, download_root: str, filename: str, md5: str | None = None) -> None:
        fetched.append(filename)
        raw = gzip.decompress((source / filename).read_bytes())
        Path(download_root).mkdir(parents=True, exist_ok=True)
        (Path(download_root) / filename.removesuffix(".gz")).write_bytes(raw)

    monkeypatch.setattr(tv_mnist, "download_and_extract_archive", fake_fetch)
    _check_fmnist(load_dataset("fashion-mnist", download=True), images, labels)
    assert len(fetched) == 4
    assert (tmp_path / "default-root" / "fashion-mnist" / "FashionMNIST" / "raw").is_dir()


def test_fashion_mnist_missing_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDFIOT_FMNIST_DIR", str(tmp_path / "nowhere"))
    for download in (False, True):  # True: the (disabled) network fails
        with pytest.raises(DatasetUnavailableError, match="apt-get install dataset-fashion-mnist"):
            load_dataset("fashion-mnist", root=tmp_path / "empty", download=download)


@pytest.mark.skipif(not Path(DEBIAN_FMNIST_DIR).is_dir(), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist_real_debian_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDFIOT_FMNIST_DIR", raising=False)
    bundle = load_dataset("fashion-mnist", download=False)
    assert (len(bundle.train), len(bundle.test)) == (60000, 10000)
    np.testing.assert_array_equal(np.bincount(bundle.test_targets), np.full(10, 1000))
    xs = torch.stack([bundle.train[i][0] for i in range(0, 60000, 30)])
    assert abs(xs.mean().item()) < 0.05 and abs(xs.std().item() - 1) < 0.05


def test_read_idx_rejects_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wb") as f:
        f.write(b"\x00\x00\x0d\x01" + struct.pack(">I", 3) + b"\x00" * 12)  # float32 IDX
    with pytest.raises(ValueError, match="not an unsigned-byte IDX"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(struct.pack(">HBB", 0, 8, 1) + struct.pack(">I", 5) + b"\x01\x02")
    with pytest.raises(ValueError, match="header says shape"):
        read_idx(short)


# -------------------------------------------------------------------------- CIFAR-10


def _write_cifar(root: Path, n_per_batch: int = 4, n_test: int = 6) -> dict[str, np.ndarray]:
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    rng = np.random.default_rng(1)
    written = {}
    for name, n in [*((f"data_batch_{i}", n_per_batch) for i in range(1, 6)), ("test_batch", n_test)]:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).tolist()
        with open(base / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": labels, "data": data, "filenames": []}, f, protocol=2)
        written[name] = data
        written[name + "_labels"] = np.asarray(labels)
    with open(base / "batches.meta", "wb") as f:
        pickle.dump({"label_names": CIFAR_CLASSES, "num_vis": 3072}, f, protocol=2)
    return written


def test_cifar10_pickled_batches_and_augmentation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Our files cannot match torchvision's MD5 sums; everything else is torchvision's real path.
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *args, **kwargs: True)
    written = _write_cifar(tmp_path / "c10")
    bundle = load_dataset("cifar10", root=tmp_path / "c10", download=False)
    assert (len(bundle.train), len(bundle.test)) == (20, 6)
    assert bundle.input_shape == (3, 32, 32) and bundle.classes == tuple(CIFAR_CLASSES)
    np.testing.assert_array_equal(bundle.train_targets[:4], written["data_batch_1_labels"])
    x, y = bundle.test[2]
    assert y == written["test_batch_labels"][2]
    # CIFAR rows are channel-major: R plane, G plane, B plane, each 32 x 32 row-major.
    row = written["test_batch"][2]
    for c in range(3):
        expected = _normalised(int(row[c * 1024 + 5 * 32 + 9]), CIFAR10_MEAN[c], CIFAR10_STD[c])
        assert x[c, 5, 9].item() == pytest.approx(expected, abs=1e-5)
    assert not bundle.augmented

    aug = load_dataset("cifar10", root=tmp_path / "c10", download=False, augment=True)
    assert aug.augmented and aug is not bundle
    assert aug.train_eval is bundle.train_eval  # the augmented bundle shares the pixels
    plain = aug.train_eval[0][0]
    torch.testing.assert_close(plain, bundle.train[0][0])
    torch.testing.assert_close(aug.test[0][0], bundle.test[0][0])  # test set never augmented
    torch.manual_seed(0)
    views = [aug.train[0][0] for _ in range(20)]
    assert all(v.shape == (3, 32, 32) for v in views)
    assert sum(not torch.equal(v, plain) for v in views) >= 10  # random crop/flip changes most views
    # every augmented view is a shifted (and maybe flipped) copy: its centre 24x24 patch lies
    # within the zero-padded original at some offset of at most 4 pixels
    black = torch.tensor([(0 - m) / s for m, s in zip(CIFAR10_MEAN, CIFAR10_STD, strict=True)]).view(3, 1, 1)
    padded = torch.nn.functional.pad(plain - black, (4, 4, 4, 4)) + black
    for v in views:
        found = any(
            torch.allclose(cand[:, dy : dy + 32, dx : dx + 32], v, atol=1e-5)
            for cand in (padded, padded.flip(-1))
            for dy in range(9)
            for dx in range(9)
        )
        assert found


def test_cifar10_missing_says_how_to_get_it(tmp_path: Path) -> None:
    for download in (False, True):
        with pytest.raises(DatasetUnavailableError, match=r"cifar-10-python\.tar\.gz"):
            load_dataset("cifar10", root=tmp_path / "none", download=download)


# ------------------------------------------------------------------------------ SVHN


def test_svhn_mat_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tv_svhn, "check_integrity", lambda *args, **kwargs: True)
    root = tmp_path / "svhn"
    root.mkdir()
    rng = np.random.default_rng(2)
    mats = {}
    for split, n in (("train", 12), ("test", 5)):
        x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)  # SVHN's H x W x C x N layout
        y = (np.arange(n) % 10 + 1).reshape(n, 1)  # labels 1..10, 10 meaning digit 0
        scipy.io.savemat(root / f"{split}_32x32.mat", {"X": x, "y": y})
        mats[split] = (x, y)
    bundle = load_dataset("svhn", root=root, download=False)
    assert (len(bundle.train), len(bundle.test)) == (12, 5)
    assert bundle.input_shape == (3, 32, 32)
    np.testing.assert_array_equal(bundle.train_targets, (np.arange(12) % 10 + 1) % 10)
    x, y = bundle.train[9]
    assert y == 0  # SVHN's label 10
    for c in range(3):
        expected = _normalised(int(mats["train"][0][4, 11, c, 9]), SVHN_MEAN[c], SVHN_STD[c])
        assert x[c, 4, 11].item() == pytest.approx(expected, abs=1e-5)


def test_svhn_missing_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnavailableError, match=r"ufldl\.stanford\.edu/housenumbers"):
        load_dataset("svhn", root=tmp_path / "none", download=True)


# -------------------------------------------------------------------------- CINIC-10


def _write_cinic(root: Path, per_class: int = 2) -> None:
    rng = np.random.default_rng(3)
    for split in ("train", "valid", "test"):
        for cls in CIFAR_CLASSES:
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(d / f"{split}-{cls}-{i}.png")


def test_cinic10_image_folder(tmp_path: Path) -> None:
    root = tmp_path / "cinic"
    _write_cinic(root)
    bundle = load_dataset("cinic-10", root=root, download=False, augment=True)
    assert (len(bundle.train), len(bundle.test)) == (20, 20)
    assert bundle.classes == tuple(CIFAR_CLASSES) and bundle.num_classes == 10
    assert bundle.input_shape == (3, 32, 32) and bundle.augmented
    np.testing.assert_array_equal(bundle.train_targets, np.repeat(np.arange(10), 2))
    x, y = bundle.test[7]
    assert type(x) is torch.Tensor and y == 3
    pixels = np.asarray(Image.open(root / "test" / "cat" / "test-cat-1.png"))
    for c in range(3):
        expected = _normalised(int(pixels[6, 2, c]), CINIC10_MEAN[c], CINIC10_STD[c])
        assert x[c, 6, 2].item() == pytest.approx(expected, abs=1e-5)
    torch.manual_seed(0)
    plain = bundle.train_eval[0][0]
    assert sum(not torch.equal(bundle.train[0][0], plain) for _ in range(10)) >= 5


def test_cinic10_missing_says_how_to_get_it(tmp_path: Path) -> None:
    for download in (False, True):
        with pytest.raises(DatasetUnavailableError, match=r"CINIC-10\.tar\.gz"):
            load_dataset("cinic10", root=tmp_path / "none", download=download)
