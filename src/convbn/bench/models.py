"""Model specs shared by all benchmarks: ``build_model("monai:resnet50(spatial_dims=2)")``.

A spec is ``[source:]name[(key=value, ...)]``; values are Python literals. Sources:

* ``mnist`` — :class:`MNISTNet`, the tutorial's MNIST network in plain ``torch.nn``;
* ``monai:NAME`` — ``monai.networks.nets.NAME`` (``resnet18``, ``resnet50``,
  ``DenseNet121``, ``UNet`` ... with 2-D / 3-D defaults below, overridable by kwargs);
* ``efficientnet:b0`` .. ``b7`` — ``efficientnet_pytorch.EfficientNet.from_name`` (no download);
* ``torchvision:NAME`` — ``torchvision.models.NAME(weights=None)``;
* ``timm:NAME`` — ``timm.create_model(NAME, pretrained=False)``;
* ``module:callable`` — any other ``module:name`` imports ``module`` (the current folder
  first, as ``python -m`` does) and calls ``name()``, which must return an ``nn.Module``;
  ``name`` may also be an ``nn.Module`` instance, used as it is. ``path/to/file.py:name``
  loads that file as a module (its folder first on ``sys.path``, as ``python file.py`` does).
  Its input shape is guessed from its first convolution or linear layer (its input
  channels; 224 per spatial dimension for 2-D, 64 for 3-D, 1024 for 1-D) and checked
  by :func:`check_input` before any work; ``--input-shape`` / ``--image-size`` override it.

``torchvision:`` and ``timm:`` work where torchvision imports: with a torchvision build
whose compiled operators match the installed torch. On a CPU-only torch whose torchvision
build lacks them (``operator torchvision::nms does not exist``), use ``module:callable``
with a function of your own that builds the model.

Every builder also returns the default input shape *without* the batch dimension.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import sys
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MNISTNet", "build_model", "check_spec", "parse_spec", "check_input", "guess_input_shape", "MODEL_DEFAULTS",
           "SOURCES"]

Shape = Tuple[int, ...]


class MNISTNet(nn.Module):
    """The tutorial's MNIST network (plain ``nn``): two Conv+BatchNorm+ReLU blocks
    1->32->64 (3x3), max-pool, dropout, fc 9216->128->10, log-softmax. Input ``(N, 1, 28, 28)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.bn2 = nn.BatchNorm2d(64)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(9216, 128)
        self.dropout2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


# Default kwargs and input shapes for MONAI networks (2-D ImageNet-like unless 3-D).
_RESNET_2D = dict(spatial_dims=2, n_input_channels=3, conv1_t_stride=2, num_classes=1000)
_DENSENET_2D = dict(spatial_dims=2, in_channels=3, out_channels=1000)
MODEL_DEFAULTS: Dict[str, Tuple[Dict[str, Any], Shape]] = {
    **{f"resnet{d}": (_RESNET_2D, (3, 224, 224)) for d in (10, 18, 34, 50, 101, 152, 200)},
    **{f"DenseNet{d}": (_DENSENET_2D, (3, 224, 224)) for d in (121, 169, 201, 264)},
    "UNet": (dict(spatial_dims=3, in_channels=1, out_channels=2, channels=(16, 32, 64, 128),
                  strides=(2, 2, 2), norm="batch"), (1, 64, 64, 64)),
}

_SPEC_RE = re.compile(r"^\s*(?:(?P<source>[A-Za-z_]\w*):)?(?P<name>[\w.\-]+)\s*(?:\((?P<kwargs>.*)\))?\s*$")


def parse_spec(spec: str) -> Tuple[str, str, Dict[str, Any]]:
    """``"monai:resnet50(spatial_dims=2)"`` -> ``("monai", "resnet50", {"spatial_dims": 2})``."""
    match = _SPEC_RE.match(spec)
    if match is None:
        raise ValueError(f"model spec must look like 'source:name(key=value, ...)', but got {spec!r}")
    kwargs: Dict[str, Any] = {}
    if match.group("kwargs"):
        call = ast.parse(f"f({match.group('kwargs')})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            raise ValueError(f"model spec arguments must be key=value pairs, but got {spec!r}")
        for kw in call.keywords:
            try:
                kwargs[kw.arg] = ast.literal_eval(kw.value)
            except ValueError as exc:
                raise ValueError(f"model spec value for {kw.arg!r} in {spec!r} must be a Python literal") from exc
    source = match.group("source") or ("mnist" if match.group("name") == "mnist" else "")
    return source, match.group("name"), kwargs


def _import(package: str, install: str) -> Any:
    """Import ``package``; an ImportError that says whether it is missing or installed but broken."""
    try:
        return importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - broken installs raise more than ImportError
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        top = package.split(".")[0]
        if importlib.util.find_spec(top) is None:
            raise ImportError(f"it needs the package '{top}', which is not installed; "
                              f"install it with `pip install {install}`") from exc
        raise ImportError(f"the package '{top}' is installed but fails to import: {detail}") from exc


def _monai(name: str, kwargs: Dict[str, Any]) -> Tuple[nn.Module, Shape]:
    nets = _import("monai.networks.nets", "monai")
    if not hasattr(nets, name):
        raise ValueError(f"monai.networks.nets has no network {name!r} (e.g. resnet18, resnet50, DenseNet121, UNet)")
    defaults, shape = MODEL_DEFAULTS.get(name, ({}, None))
    merged = {**defaults, **kwargs}
    if shape is None or merged.get("spatial_dims", 2) != defaults.get("spatial_dims", 2):
        dims = merged.get("spatial_dims", 2)
        channels = merged.get("in_channels", merged.get("n_input_channels", 1))
        shape = (channels,) + ((224,) * 2 if dims == 2 else (64,) * dims)
    else:
        channels = merged.get("in_channels", merged.get("n_input_channels", shape[0]))
        shape = (channels,) + tuple(shape[1:])
    return getattr(nets, name)(**merged), shape


def _efficientnet(name: str, kwargs: Dict[str, Any]) -> Tuple[nn.Module, Shape]:
    mod = _import("efficientnet_pytorch", "efficientnet_pytorch")
    full = name if name.startswith("efficientnet-") else f"efficientnet-{name}"
    model = mod.EfficientNet.from_name(full, **kwargs)
    size = mod.EfficientNet.get_image_size(full)
    return model, (kwargs.get("in_channels", 3), size, size)


def _torchvision(name: str, kwargs: Dict[str, Any]) -> Tuple[nn.Module, Shape]:
    models = _import("torchvision.models", "torchvision")
    return getattr(models, name)(**{"weights": None, **kwargs}), (3, 224, 224)


def _timm(name: str, kwargs: Dict[str, Any]) -> Tuple[nn.Module, Shape]:
    timm = _import("timm", "timm")
    model = timm.create_model(name, **{"pretrained": False, **kwargs})
    shape = tuple(model.default_cfg.get("input_size", (3, 224, 224)))
    return model, shape


_BUILDERS: Dict[str, Callable[[str, Dict[str, Any]], Tuple[nn.Module, Shape]]] = {
    "monai": _monai,
    "efficientnet": _efficientnet,
    "torchvision": _torchvision,
    "timm": _timm,
}

#: The spec sources: ``mnist`` and those before a colon.
SOURCES = ("mnist",) + tuple(sorted(_BUILDERS))

#: The spatial size :func:`guess_input_shape` gives each spatial dimension, by their count.
GUESSED_SIZE = {1: 1024, 2: 224, 3: 64}


def is_callable_spec(spec: str) -> bool:
    """``True`` for ``module:callable`` or ``path/file.py:callable`` (not a spec source, a colon, an identifier)."""
    head, sep, name = spec.rpartition(":")
    return bool(sep) and bool(head) and head not in SOURCES and name.isidentifier()


def _is_file(head: str) -> bool:
    return head.endswith(".py") or "/" in head or os.sep in head


def _load_file(head: str, spec: str) -> ModuleType:
    """``path/to/file.py`` as a module (named by its stem unless another module has that name)."""
    path = os.path.abspath(os.path.expanduser(head))
    if not os.path.isfile(path):
        raise ValueError(f"{spec!r}: no Python file {head!r} (looked for {path})")
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its own imports of its neighbours work, as with `python file.py`
    name = os.path.splitext(os.path.basename(path))[0]
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
        return loaded
    if loaded is not None or not name.isidentifier():
        name = f"convbn_user_model_{abs(hash(path))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{spec!r}: {head!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file may raise anything while importing
        del sys.modules[name]
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ImportError(f"cannot import {head!r} of {spec!r}: {detail}") from exc
    return module


def _load_module(head: str, spec: str) -> ModuleType:
    """The module of a ``module:callable`` spec (a dotted name, the current folder first, or a file path)."""
    if _is_file(head):
        return _load_file(head, spec)
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        # the installed `convbn` script does not put the current folder on sys.path; `python -m` does
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(head)
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything while importing
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ImportError(f"cannot import module {head!r} of {spec!r} (looked in {cwd} and sys.path): {detail}") from exc


def builders_in(module: ModuleType, limit: int = 8) -> List[str]:
    """Names in ``module`` that may build a model: its own public functions and ``nn.Module``
    classes, and the ``nn.Module`` instances it holds (at most ``limit``)."""
    names = []
    for key, value in vars(module).items():
        if key.startswith("_"):
            continue
        own = getattr(value, "__module__", None) == module.__name__
        if isinstance(value, nn.Module) or (own and (inspect.isfunction(value) or (
                inspect.isclass(value) and issubclass(value, nn.Module)))):
            names.append(key)
    return names[:limit]


def _candidates_text(module: ModuleType) -> str:
    names = builders_in(module)
    return f"; candidates in it: {', '.join(names)}" if names else ""


def _attribute(spec: str) -> Tuple[Any, ModuleType]:
    """The object a ``module:callable`` spec names, and its module (an error naming the candidates if absent)."""
    head, _, name = spec.rpartition(":")
    module = _load_module(head, spec)
    if not hasattr(module, name):
        raise ValueError(f"{head!r} has no {name!r} (spec {spec!r} must be module:callable, a function or class "
                         f"returning an nn.Module, or an nn.Module){_candidates_text(module)}")
    obj = getattr(module, name)
    if not isinstance(obj, nn.Module) and not callable(obj):
        raise ValueError(f"{spec!r} names an object of type {type(obj).__name__}, not a function or class returning "
                         f"an nn.Module, nor an nn.Module{_candidates_text(module)}")
    return obj, module


def _callable(spec: str) -> Tuple[nn.Module, Shape]:
    obj, _ = _attribute(spec)
    if isinstance(obj, nn.Module):
        model = obj  # an instance: used as it is
    else:
        try:
            model = obj()
        except Exception as exc:  # noqa: BLE001 - the user's builder may raise anything
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ValueError(f"building {spec} raised {type(exc).__name__}: {first} "
                             "(--debug shows the traceback)") from exc
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec!r} returned {type(model).__name__}, expected an nn.Module")
    shape = guess_input_shape(model)
    if shape is None:
        raise ValueError(f"{spec!r} has no convolution or linear layer, so convbn has nothing to fuse or fold in it")
    return model, shape


def _unknown(spec: str, source: str) -> ValueError:
    """The error for a spec that names no known source: a bare module name says the form is module:callable."""
    forms = (f"expected 'mnist', one of {sorted(_BUILDERS)} followed by ':NAME' (e.g. monai:resnet18), "
             "or module:callable (a function or class of yours that returns an nn.Module)")
    if source or not re.fullmatch(r"[A-Za-z_][\w.]*|.+\.py", spec.strip()):
        return ValueError(f"unknown model source {source!r} in spec {spec!r}; {forms}")
    head = spec.strip()
    try:
        module = _load_file(head, spec) if _is_file(head) else None
        if module is None:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            if importlib.util.find_spec(head.split(".")[0]) is not None:
                module = importlib.import_module(head)
    except Exception:  # noqa: BLE001 - not importable: say what a spec looks like
        module = None
    if module is None:
        return ValueError(f"unknown model {spec!r}: {forms}")
    names = builders_in(module)
    example = f"{head}:{names[0]}" if names else f"{head}:build"
    listed = f" (candidates: {', '.join(names)})" if names else ""
    return ValueError(f"{spec!r} is a module; a model spec is module:callable naming the function or class in it that "
                      f"builds the model, e.g. {example}{listed}")


def guess_input_shape(model: nn.Module) -> Optional[Shape]:
    """The input shape without batch that ``model``'s first convolution or linear layer takes.

    The first such module in ``model.modules()`` order gives the channels (``in_channels`` /
    ``in_features``) and the number of spatial dimensions; each spatial size is
    :data:`GUESSED_SIZE`. ``None`` when the model has neither.
    """
    for m in model.modules():
        if isinstance(m, (nn.modules.conv._ConvNd)):
            dims = len(m.kernel_size)
            return (m.in_channels,) + (GUESSED_SIZE.get(dims, 64),) * dims
        if isinstance(m, nn.Linear):
            return (m.in_features,)
    return None


def check_input(model: nn.Module, x: Tensor, spec: str, hint: str = "pass --input-shape") -> None:
    """Run ``model`` once on ``x`` (eval mode, no grad, modes restored); a one-line ValueError if it fails.

    Args:
        model: the model.
        x: the input the command is about to use.
        spec: the model's spec, for the message.
        hint: what the user can do, for the message.

    Raises:
        ValueError: the model raised on ``x`` (its first line and the shape are in the message).
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            model(x)
    except Exception as exc:  # noqa: BLE001 - any error of the model on this input is the user's to fix
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        shape = "x".join(map(str, x.shape))
        raise ValueError(f"{spec} does not accept an input of shape {shape} ({type(exc).__name__}: {first}); "
                         f"{hint}") from exc
    finally:
        for m, training in modes:
            m.training = training


def _parse(spec: str) -> Tuple[str, str, Dict[str, Any]]:
    """:func:`parse_spec`, with a spec that names no known source reported as :func:`_unknown` does."""
    try:
        source, name, kwargs = parse_spec(spec)
    except ValueError:
        if ":" not in spec:
            raise _unknown(spec, "") from None
        raise
    if source != "mnist" and source not in _BUILDERS:
        raise _unknown(spec, source)
    if source == "mnist" and kwargs:
        raise ValueError(f"'mnist' takes no arguments, but got {kwargs}")
    return source, name, kwargs


#: The module each spec source imports (and the package that installs it).
_SOURCE_MODULES = {
    "monai": ("monai.networks.nets", "monai"),
    "efficientnet": ("efficientnet_pytorch", "efficientnet_pytorch"),
    "torchvision": ("torchvision.models", "torchvision"),
    "timm": ("timm", "timm"),
}


def check_spec(spec: str) -> None:
    """The error :func:`build_model` would give for a malformed spec, a missing package, a missing
    module or callable, found without building the model (so a command can fail before any work).

    Raises:
        ValueError: malformed spec, unknown source, no such callable.
        ImportError: the package or module it needs does not import.
    """
    if is_callable_spec(spec):
        _attribute(spec)
        return
    source, _, _ = _parse(spec)
    if source in _SOURCE_MODULES:
        try:
            _import(*_SOURCE_MODULES[source])
        except ImportError as exc:
            raise ImportError(f"model spec {spec!r} could not be built: {exc}") from exc


def build_model(spec: str) -> Tuple[nn.Module, Shape]:
    """Build the model named by ``spec``; returns ``(model, input_shape_without_batch)``.

    The model is freshly initialised (no weights are downloaded) and in training mode.

    A ``module:callable`` spec's shape is :func:`guess_input_shape`'s.

    Raises:
        ValueError: malformed spec, unknown source/name, or the user's builder raised (the
            message gives its exception's type and first line).
        ImportError: the source's package does not import (the message names it and why).
    """
    if is_callable_spec(spec):
        return _callable(spec)
    source, name, kwargs = _parse(spec)
    if source == "mnist":
        return MNISTNet(), (1, 28, 28)
    try:
        return _BUILDERS[source](name, kwargs)
    except ImportError as exc:  # the spec named beside the package it needs
        raise ImportError(f"model spec {spec!r} could not be built: {exc}") from exc
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - the library's own error for arguments it cannot build
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"model spec {spec!r} could not be built: {type(exc).__name__}: {detail}") from exc
