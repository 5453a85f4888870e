"""Data set loaders: standard train/test splits, per-channel normalisation, optional augmentation.

``load_dataset(name)`` returns a :class:`DatasetBundle` for one of

- ``"digits"``: scikit-learn's 8x8 digits (embedded in scikit-learn, never downloads; the
  default for offline runs). Fixed stratified 75/25 train/test split (``random_state=0``),
  normalised with the training set's own mean and std.
- ``"fashion-mnist"``: the IDX files of the Debian package ``dataset-fashion-mnist``
  (``/usr/share/datasets/fashion-mnist``, overridable by ``$FEDFIOT_FMNIST_DIR``) or of a
  user ``root``; else torchvision's download.
- ``"cifar10"``, ``"svhn"``: torchvision's data sets (downloaded when ``download=True``).
- ``"cinic10"``: the standard ``root/{train,valid,test}/<class>/*.png`` layout read with
  torchvision's ``ImageFolder`` (train = ``train``, test = ``test``; ``valid`` is unused).

Downloads go to ``root`` or, when it is None, to ``$FEDFIOT_DATA_DIR/<name>`` (default
``~/.cache/fedfiot_flwr/data/<name>``). A missing data set raises one
:class:`DatasetUnavailableError` that says how to get it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gzip
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from fedfiot_flwr.data.arrays import ArrayImageDataset, crop_flip_augmentation
from fedfiot_flwr.extras import require

if TYPE_CHECKING:
    from torchvision import datasets as tvd
    from torchvision.transforms import v2
else:  # every loader here reads or builds torchvision data sets and transforms
    tvd = require("torchvision.datasets", "torchvision", "data", "fedfiot_flwr.data's data sets")
    v2 = require("torchvision.transforms.v2", "torchvision", "data", "fedfiot_flwr.data's data sets")

# Standard per-channel statistics of the training sets, on pixels scaled to [0, 1].
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
SVHN_MEAN = (0.4377, 0.4438, 0.4728)
SVHN_STD = (0.1980, 0.2010, 0.1970)
CINIC10_MEAN = (0.47889522, 0.47227842, 0.43047404)
CINIC10_STD = (0.24205776, 0.23828046, 0.25874835)
FASHION_MNIST_MEAN = (0.2860,)
FASHION_MNIST_STD = (0.3530,)

DEBIAN_FMNIST_DIR = "/usr/share/datasets/fashion-mnist"
FMNIST_DIR_ENV = "FEDFIOT_FMNIST_DIR"
DATA_DIR_ENV = "FEDFIOT_DATA_DIR"
CINIC10_URL = "https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz"

DATASET_NAMES = ("digits", "fashion-mnist", "cifar10", "svhn", "cinic10")
_ALIASES = {
    "fashion_mnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "fmnist": "fashion-mnist",
    "cifar-10": "cifar10",
    "cifar_10": "cifar10",
    "cinic-10": "cinic10",
    "cinic_10": "cinic10",
}


class DatasetUnavailableError(FileNotFoundError):
    """A data set is neither on disk nor downloadable; the message says how to get it."""


@dataclass(frozen=True, eq=False)
class DatasetBundle:
    """A data set with its standard train/test split.

    Attributes
    ----------
    name : str
        Canonical name (one of :data:`DATASET_NAMES`).
    train : Dataset
        Training set; items are ``(float tensor C x H x W, int label)``, normalised, and
        augmented when the bundle was loaded with ``augment=True``.
    test : Dataset
        The full test set, normalised, never augmented.
    train_targets : np.ndarray
        ``int64`` labels of ``train`` in index order (what partitioners need).
    num_classes : int
    input_shape : tuple[int, int, int]
        ``(C, H, W)`` of one example.
    train_eval : Dataset
        The same examples as ``train`` in the same order but never augmented: use it for
        the server validation set, client Fisher estimates and training-set accuracy.
        Defaults to ``train``.
    test_targets : np.ndarray or None
        ``int64`` labels of ``test``.
    classes : tuple[str, ...]
        Class names in label order.
    augmented : bool
        Whether ``train`` applies the random crop + flip augmentation.
    """

    name: str
    train: Dataset
    test: Dataset
    train_targets: np.ndarray
    num_classes: int
    input_shape: tuple[int, int, int]
    train_eval: Dataset | None = None
    test_targets: np.ndarray | None = None
    classes: tuple[str, ...] = field(default=())
    augmented: bool = False

    def __post_init__(self) -> None:
        if self.train_eval is None:
            object.__setattr__(self, "train_eval", self.train)
        if len(self.train_targets) != len(self.train):  # type: ignore[arg-type]
            raise ValueError(
                f"{self.name}: {len(self.train_targets)} train targets for "
                f"{len(self.train)} training examples"  # type: ignore[arg-type]
            )


def default_data_root() -> Path:
    """Directory for downloaded data sets: ``$FEDFIOT_DATA_DIR`` or ``~/.cache/fedfiot_flwr/data``."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedfiot_flwr" / "data"


def canonical_name(name: str) -> str:
    """Map a data set name or alias (``"fmnist"``, ``"CIFAR-10"``...) to its canonical name."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DATASET_NAMES:
        raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    return key


def load_dataset(
    name: str, root: str | os.PathLike[str] | None = None, download: bool = True, augment: bool = False
) -> DatasetBundle:
    """Load a data set with its standard train/test split and per-channel normalisation.

    Results are cached per process (Flower ClientApps call this once per message), so
    repeated calls with the same arguments return the same bundle object.

    Parameters
    ----------
    name : str
        ``"digits"``, ``"fashion-mnist"``, ``"cifar10"``, ``"svhn"`` or ``"cinic10"``
        (aliases such as ``"fmnist"`` and ``"cifar-10"`` are accepted).
    root : str or PathLike, optional
        Where the data set lies or is downloaded to. For CINIC-10 the directory holding
        ``train/``, ``valid/`` and ``test/``; for Fashion-MNIST a directory with the four
        IDX files (``.gz`` or not). Default: ``$FEDFIOT_DATA_DIR/<name>``.
    download : bool
        Allow downloading when the files are missing (ignored for ``digits``).
    augment : bool
        Random 32x32 crop with 4-pixel zero padding and horizontal flip on the training
        set of 32x32 RGB data sets (CIFAR-10, SVHN, CINIC-10), as in the paper. Ignored
        (``bundle.augmented`` is False) for the grey-scale data sets, which the paper
        does not augment.

    Returns
    -------
    DatasetBundle

    Raises
    ------
    ValueError
        Unknown ``name``.
    DatasetUnavailableError
        The files are missing and cannot be downloaded; the message says how to get them.
    """
    key = canonical_name(name)
    root_key = None if root is None else str(Path(root).expanduser().resolve())
    # The environment variables are part of the cache key: they change where files are found.
    env_key = (os.environ.get(FMNIST_DIR_ENV), os.environ.get(DATA_DIR_ENV))
    return _load_cached(key, root_key, bool(download), bool(augment), env_key)


def clear_dataset_cache() -> None:
    """Forget the bundles cached by :func:`load_dataset` (e.g. after files changed on disk)."""
    _load_cached.cache_clear()


@functools.lru_cache(maxsize=16)
def _load_cached(
    name: str, root: str | None, download: bool, augment: bool, env_key: tuple[str | None, str | None]
) -> DatasetBundle:
    if augment:  # share the pixels of the cached plain bundle
        return _with_augmentation(_load_cached(name, root, download, False, env_key))
    loader = {
        "digits": _load_digits,
        "fashion-mnist": _load_fashion_mnist,
        "cifar10": _load_cifar10,
        "svhn": _load_svhn,
        "cinic10": _load_cinic10,
    }[name]
    return loader(Path(root) if root is not None else None, download)


def _with_augmentation(bundle: DatasetBundle) -> DatasetBundle:
    """Same bundle with crop + flip on ``train``; only 32x32 RGB data sets are augmented."""
    if bundle.input_shape != (3, 32, 32):
        return bundle
    plain = bundle.train_eval
    if isinstance(plain, ArrayImageDataset):
        train: Dataset = plain.with_transform(crop_flip_augmentation(32))
    elif isinstance(plain, tvd.ImageFolder):  # same file list, another transform
        train = copy.copy(plain)
        train.transform = _cinic_transform(augment=True)
    else:
        raise TypeError(f"{bundle.name}: cannot augment a {type(plain).__name__}")
    return dataclasses.replace(bundle, train=train, augmented=True)


def _bundle_from_arrays(
    name: str, train: ArrayImageDataset, test: ArrayImageDataset, classes: tuple[str, ...]
) -> DatasetBundle:
    return DatasetBundle(
        name=name,
        train=train,
        test=test,
        train_targets=train.targets,
        num_classes=len(classes),
        input_shape=tuple(int(d) for d in train.images.shape[1:]),  # type: ignore[arg-type]
        train_eval=train,
        test_targets=test.targets,
        classes=classes,
    )


# ----------------------------------------------------------------------------- digits


def _load_digits(root: Path | None, download: bool) -> DatasetBundle:
    load_digits = require("sklearn.datasets", "scikit-learn", "data", "the digits data set").load_digits
    train_test_split = require("sklearn.model_selection", "scikit-learn", "data", "the digits data set").train_test_split

    digits = load_digits()
    images = digits.images.astype(np.uint8)  # integers 0..16
    labels = digits.target.astype(np.int64)
    idx_train, idx_test = train_test_split(
        np.arange(len(labels)), test_size=0.25, random_state=0, stratify=labels
    )
    scaled = images[idx_train].astype(np.float64) / 16.0
    mean, std = (float(scaled.mean()),), (float(scaled.std()),)
    to_tensor = lambda idx: torch.from_numpy(images[idx][:, None].copy())  # noqa: E731
    train = ArrayImageDataset(to_tensor(idx_train), labels[idx_train], mean, std, scale=16.0)
    test = ArrayImageDataset(to_tensor(idx_test), labels[idx_test], mean, std, scale=16.0)
    return _bundle_from_arrays("digits", train, test, tuple(str(i) for i in range(10)))


# ----------------------------------------------------------------------- Fashion-MNIST

_FMNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an unsigned-byte IDX file (``.gz`` or plain) into a ``uint8`` array.

    Raises
    ------
    ValueError
        The file is not an unsigned-byte IDX file or its size does not match its header.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{path}: too short for an IDX file")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {data[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} but holds {arr.size} bytes")
    return arr.reshape(shape)


def _find_idx_dir(candidates: list[Path]) -> dict[str, Path] | None:
    """First candidate directory holding all four IDX files (``.gz`` preferred)."""
    for directory in candidates:
        found = {}
        for key, stem in _FMNIST_FILES.items():
            for fname in (stem + ".gz", stem):
                if (directory / fname).is_file():
                    found[key] = directory / fname
                    break
        if len(found) == len(_FMNIST_FILES):
            return found
    return None


def _load_fashion_mnist(root: Path | None, download: bool) -> DatasetBundle:
    system_dir = Path(os.environ.get(FMNIST_DIR_ENV, DEBIAN_FMNIST_DIR))
    candidates = [system_dir]
    if root is not None:
        candidates = [root, root / "FashionMNIST" / "raw", system_dir]
    files = _find_idx_dir(candidates)
    if files is not None:
        tr_x, tr_y = read_idx(files["train_images"]), read_idx(files["train_labels"])
        te_x, te_y = read_idx(files["test_images"]), read_idx(files["test_labels"])
    else:
        target = root if root is not None else default_data_root() / "fashion-mnist"
        try:
            tv_train = tvd.FashionMNIST(str(target), train=True, download=download)
            tv_test = tvd.FashionMNIST(str(target), train=False, download=download)
        except (RuntimeError, OSError) as err:
            raise DatasetUnavailableError(
                f"Fashion-MNIST not found: looked for the IDX files in "
                f"{', '.join(str(c) for c in candidates)} and under {target} "
                f"(torchvision layout), and {'the download failed' if download else 'download=False'}"
                f" ({err}). Get it with `sudo apt-get install dataset-fashion-mnist` (Debian/"
                f"Ubuntu; or set ${FMNIST_DIR_ENV} to a directory with the four IDX files), or "
                f"run load_dataset('fashion-mnist', download=True) with internet access."
            ) from err
        tr_x, tr_y = tv_train.data.numpy(), tv_train.targets.numpy()
        te_x, te_y = tv_test.data.numpy(), tv_test.targets.numpy()
    for what, x, y in (("train", tr_x, tr_y), ("test", te_x, te_y)):
        if x.ndim != 3 or len(x) != len(y):
            raise ValueError(f"Fashion-MNIST {what}: images {x.shape} do not match labels {y.shape}")
    train = ArrayImageDataset(
        torch.from_numpy(tr_x[:, None].copy()), tr_y.astype(np.int64), FASHION_MNIST_MEAN, FASHION_MNIST_STD
    )
    test = ArrayImageDataset(
        torch.from_numpy(te_x[:, None].copy()), te_y.astype(np.int64), FASHION_MNIST_MEAN, FASHION_MNIST_STD
    )
    return _bundle_from_arrays("fashion-mnist", train, test, FASHION_MNIST_CLASSES)


# ---------------------------------------------------------------------- CIFAR-10, SVHN


def _unavailable(what: str, where: Path, download: bool, err: Exception, how: str) -> DatasetUnavailableError:
    attempt = "the download failed" if download else "download=False"
    return DatasetUnavailableError(f"{what} not found under {where} and {attempt} ({err}). {how}")


def _load_cifar10(root: Path | None, download: bool) -> DatasetBundle:
    where = root if root is not None else default_data_root() / "cifar10"
    try:
        tv_train = tvd.CIFAR10(str(where), train=True, download=download)
        tv_test = tvd.CIFAR10(str(where), train=False, download=download)
    except (RuntimeError, OSError) as err:
        raise _unavailable(
            "CIFAR-10",
            where,
            download,
            err,
            "Run load_dataset('cifar10', root=..., download=True) with internet access, or "
            f"extract https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz into {where} "
            "(it must contain cifar-10-batches-py/).",
        ) from err

    def arrays(ds: tvd.CIFAR10) -> tuple[torch.Tensor, np.ndarray]:
        return torch.from_numpy(np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2))), np.asarray(ds.targets)

    train = ArrayImageDataset(*arrays(tv_train), CIFAR10_MEAN, CIFAR10_STD)
    test = ArrayImageDataset(*arrays(tv_test), CIFAR10_MEAN, CIFAR10_STD)
    return _bundle_from_arrays("cifar10", train, test, tuple(tv_train.classes))


def _load_svhn(root: Path | None, download: bool) -> DatasetBundle:
    where = root if root is not None else default_data_root() / "svhn"
    try:
        tv_train = tvd.SVHN(str(where), split="train", download=download)
        tv_test = tvd.SVHN(str(where), split="test", download=download)
    except (RuntimeError, OSError) as err:
        raise _unavailable(
            "SVHN",
            where,
            download,
            err,
            "Run load_dataset('svhn', root=..., download=True) with internet access, or put "
            "http://ufldl.stanford.edu/housenumbers/train_32x32.mat and test_32x32.mat "
            f"into {where}.",
        ) from err
    # torchvision already maps SVHN's label 10 (digit 0) to 0 and stores (N, 3, 32, 32).
    train = ArrayImageDataset(torch.from_numpy(tv_train.data), tv_train.labels, SVHN_MEAN, SVHN_STD)
    test = ArrayImageDataset(torch.from_numpy(tv_test.data), tv_test.labels, SVHN_MEAN, SVHN_STD)
    return _bundle_from_arrays("svhn", train, test, tuple(str(i) for i in range(10)))


# ---------------------------------------------------------------------------- CINIC-10


def _cinic_transform(augment: bool) -> v2.Compose:
    steps: list[v2.Transform] = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    if augment:
        steps += list(crop_flip_augmentation(32).transforms)
    steps += [v2.Normalize(CINIC10_MEAN, CINIC10_STD), v2.ToPureTensor()]
    return v2.Compose(steps)


def _load_cinic10(root: Path | None, download: bool) -> DatasetBundle:
    where = root if root is not None else default_data_root() / "cinic10"
    how = (
        f"Download {CINIC10_URL} (about 1.7 GB; see https://github.com/BayesWatch/cinic-10) "
        f"and extract it so that {where}/train/<class>/*.png and {where}/test/<class>/*.png "
        "exist, or call load_dataset('cinic10', root=..., download=True) with internet access."
    )
    if not ((where / "train").is_dir() and (where / "test").is_dir()) and download:
        from torchvision.datasets.utils import download_and_extract_archive

        try:
            download_and_extract_archive(CINIC10_URL, download_root=str(where), remove_finished=True)
        except (RuntimeError, OSError) as err:
            raise _unavailable("CINIC-10", where, True, err, how) from err
    if not ((where / "train").is_dir() and (where / "test").is_dir()):
        raise DatasetUnavailableError(f"CINIC-10 not found: {where}/train and {where}/test must exist. {how}")
    train = tvd.ImageFolder(str(where / "train"), transform=_cinic_transform(False))
    test = tvd.ImageFolder(str(where / "test"), transform=_cinic_transform(False))
    if train.classes != test.classes:
        raise ValueError(f"CINIC-10 under {where}: train classes {train.classes} != test classes {test.classes}")
    if not train.samples:
        raise DatasetUnavailableError(f"CINIC-10 under {where}: no images in train/. {how}")
    probe = train[0][0]
    return DatasetBundle(
        name="cinic10",
        train=train,
        test=test,
        train_targets=np.asarray(train.targets, dtype=np.int64),
        num_classes=len(train.classes),
        input_shape=(int(probe.shape[0]), int(probe.shape[1]), int(probe.shape[2])),
        train_eval=train,
        test_targets=np.asarray(test.targets, dtype=np.int64),
        classes=tuple(train.classes),
    )
