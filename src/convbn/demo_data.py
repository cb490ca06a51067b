"""The demo's data: MNIST IDX files, or scikit-learn's bundled handwritten digits at 28x28.

``--mnist-dir DIR`` reads the four MNIST IDX files (``train-images-idx3-ubyte`` etc., raw
or ``.gz``); without it, scikit-learn's 1797 bundled 8x8 ``load_digits`` images (real
handwritten digits, no download) are upscaled to 28x28 with bilinear interpolation. Both
are normalised with the MNIST constants.

Example:
    >>> data = load_digits_28(seed=1)  # doctest: +SKIP
    >>> data.train_x.shape[1:]  # doctest: +SKIP
    torch.Size([1, 28, 28])
"""
from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from convbn.extras import require

if TYPE_CHECKING:
    import numpy as np

__all__ = ["MNIST_MEAN", "MNIST_STD", "IDX_DTYPES", "Dataset", "read_idx", "load_mnist", "load_digits_28"]

#: Normalisation constants of the MNIST training set (as in the PyTorch examples).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081

#: The IDX type byte -> the numpy dtype of its values (big-endian where multi-byte).
IDX_DTYPES = {
    0x08: "u1",
    0x09: "i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def _numpy(needed_by: str) -> Any:
    return require("numpy", needed_by, "demo")


@dataclass
class Dataset:
    """Normalised images ``(N, 1, 28, 28)`` float32 and labels ``(N,)`` int64, train and test."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    source: str

    def limit(self, n: Optional[int]) -> "Dataset":
        """The first ``n`` train and first ``n`` test samples (all when ``n`` is ``None``)."""
        if n is None:
            return self
        if n < 2:
            raise ValueError(f"--limit must be at least 2 (BatchNorm needs 2 samples), but got {n}")
        return Dataset(self.train_x[:n], self.train_y[:n], self.test_x[:n], self.test_y[:n], self.source + f" (first {n})")


def _open(path: str) -> Any:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (the MNIST format), raw or gzip-compressed.

    Layout: two zero bytes, a type byte (0x08 = uint8 ...), the number of dimensions, then
    one big-endian ``uint32`` per dimension, then the data in C order.

    Args:
        path: the file (``.gz`` is decompressed).

    Returns:
        The array, e.g. ``(60000, 28, 28)`` ``uint8`` images or ``(60000,)`` labels.

    Raises:
        ValueError: not an IDX file, an unknown type byte, or a truncated file.

    Example:
        >>> read_idx("MNIST/raw/train-labels-idx1-ubyte").shape  # doctest: +SKIP
        (60000,)
    """
    np = _numpy("reading MNIST IDX files")
    with _open(path) as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (it must start with two zero bytes)")
    type_code, ndim = data[2], data[3]
    if type_code not in IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX type byte 0x{type_code:02x}; expected one of {sorted(IDX_DTYPES)}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(IDX_DTYPES[type_code])
    count = int(np.prod(shape)) if shape else 1
    if len(data) - header < count * dtype.itemsize:
        raise ValueError(f"{path}: expected {count} values of shape {shape}, but the file is truncated")
    return np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find(directory: str, stem: str) -> str:
    """``train-images-idx3-ubyte`` with or without ``.gz``, also the ``train-images.idx3-ubyte`` spelling."""
    dotted = stem.replace("-idx", ".idx")
    for name in (stem, stem + ".gz", dotted, dotted + ".gz"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"no {stem}[.gz] in {directory}; --mnist-dir must hold the four MNIST IDX files "
        f"(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte)"
    )


def _normalise(images: Tensor) -> Tensor:
    return ((images - MNIST_MEAN) / MNIST_STD).unsqueeze(1).contiguous()


def load_mnist(directory: str) -> Dataset:
    """MNIST from the IDX files in ``directory`` (raw or ``.gz``), scaled to [0, 1] and normalised.

    Raises:
        FileNotFoundError: a file is missing (the message lists the four expected names).
        ValueError: image/label counts differ or images are not 28x28.
    """
    np = _numpy("the demo's MNIST data")
    parts = []
    for prefix in ("train", "t10k"):
        images = read_idx(_find(directory, f"{prefix}-images-idx3-ubyte"))
        labels = read_idx(_find(directory, f"{prefix}-labels-idx1-ubyte"))
        if images.ndim != 3 or images.shape[1:] != (28, 28):
            raise ValueError(f"{prefix} images must have shape (N, 28, 28), but got {images.shape}")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"{prefix}: {images.shape[0]} images but labels of shape {labels.shape}")
        parts.append(_normalise(torch.from_numpy(images.astype(np.float32) / 255.0)))
        parts.append(torch.from_numpy(labels.astype(np.int64)))
    return Dataset(*parts, source=f"MNIST ({directory})")


def load_digits_28(seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's bundled handwritten digits (1797 8x8 images), upscaled to 28x28.

    Pixel values 0..16 are scaled to [0, 1], resized with bilinear interpolation and
    normalised with the MNIST constants; a seeded permutation splits train/test.

    Raises:
        ImportError: scikit-learn is not installed (``pip install 'convbn[demo]'``).
    """
    np = _numpy("the demo's built-in data")
    datasets = require("sklearn.datasets", "the demo's built-in data", "demo", " (or pass --mnist-dir DIR)")
    digits = datasets.load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False).squeeze(1)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(len(labels) * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    x = _normalise(images)
    return Dataset(x[train], labels[train], x[test], labels[test], source="scikit-learn digits, 8x8 -> 28x28")


