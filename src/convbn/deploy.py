"""Saving a folded model for deployment: ``torch.export`` and ONNX, with dynamic dimensions.

Both exports trace the model once on an example input. ``dynamic_axes`` says which
dimensions stay free, so one file serves every size along them:

* ``"batch"`` (the default): dimension 0, as ``torch.export.Dim("batch", min=1)``;
* ``"spatial"``: every dimension after the batch and the channels (the length of a 1-d
  signal or sequence; height and width; depth), each as ``torch.export.Dim.DYNAMIC``, so the
  export fails, naming the line, where the model's code fixes one (a ``Linear`` over
  flattened features, a reshape to a constant size) instead of writing a file that only
  runs at the example's size.

A dimension left static runs only at the example's size. ``torch.export`` specialises a
size of 1 to the constant 1, so a batch-1 example is repeated to 2 first, and a dynamic
spatial dimension needs an example size of at least 2.

ONNX uses torch's default exporter (``torch.onnx.export(..., dynamo=True)``, built on
``torch.export``), which needs the ``onnxscript`` package. :func:`save_onnx` writes one
self-contained ``.onnx`` file, weights included; only past :data:`SINGLE_FILE_BYTES` of
weights (protobuf caps a file at 2 GiB) do the weights go to a data file beside it, which
:func:`save_onnx` returns and which must travel with the ``.onnx`` file. Opset 18 is the
exporter's native opset (no version conversion) and ONNX Runtime has run it since 1.14.
ONNX Runtime does not fold BatchNorm after a ConvTranspose itself; a model folded by
:func:`convbn.fold` has none left.

Example:
    >>> folded = convbn.fold(model.eval(), example_inputs=x)            # doctest: +SKIP
    >>> save_onnx(folded, x, "model.onnx", dynamic_axes=("batch", "spatial"))  # doctest: +SKIP
    ['model.onnx']
    >>> check_onnx("model.onnx", folded, [x[:1], torch.randn(7, 3, 48, 80)])  # doctest: +SKIP
"""
from __future__ import annotations

import io
import contextlib
import os
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .extras import require

__all__ = ["DEFAULT_OPSET", "DYNAMIC_AXES", "SINGLE_FILE_BYTES", "dynamic_axes_arg", "dynamic_shapes",
           "example_batch", "export_program", "save_export", "save_onnx", "onnx_files", "check_onnx",
           "check_program", "require_onnx_export"]

#: The ONNX opset :func:`save_onnx` writes unless told otherwise.
DEFAULT_OPSET = 18

#: The kinds of dimension an export can leave dynamic (``dynamic_axes``).
DYNAMIC_AXES = ("batch", "spatial")

#: Weights up to this many bytes are stored inside the ``.onnx`` file; past it, in a data file
#: beside it. Protobuf caps a file at 2 GiB; this leaves room for the graph (torch's exporter
#: moves weights out past the same size).
SINGLE_FILE_BYTES = 1536 * 1024 * 1024

AxesArg = Union[str, Sequence[str], None]


def dynamic_axes_arg(axes: AxesArg) -> Tuple[str, ...]:
    """``axes`` checked and in order: a subset of :data:`DYNAMIC_AXES`.

    Args:
        axes: ``"batch"``, ``"spatial"``, a comma-separated string of them (``"batch,spatial"``),
            a sequence of them, or ``None`` / ``""`` / ``"none"`` / ``()`` for every dimension static.

    Raises:
        ValueError: a word that is not one of :data:`DYNAMIC_AXES`.
    """
    if axes is None:
        words: List[Any] = []
    elif isinstance(axes, str):
        words = [w.strip() for w in axes.split(",") if w.strip() and w.strip() != "none"]
    elif isinstance(axes, (list, tuple, set, frozenset)):
        words = list(axes)
    else:
        raise TypeError(f"dynamic_axes must be a string or a sequence of strings, but got {type(axes).__name__}")
    unknown = [w for w in words if w not in DYNAMIC_AXES]
    if unknown:
        raise ValueError(f"dynamic_axes takes {' and/or '.join(map(repr, DYNAMIC_AXES))} (or none), but got "
                         f"{', '.join(map(repr, unknown))}")
    return tuple(a for a in DYNAMIC_AXES if a in words)


def example_batch(x: Tensor, dynamic_axes: AxesArg = "batch") -> Tensor:
    """``x`` ready for an export with ``dynamic_axes``: a batch of 1 repeated to 2 when the batch is dynamic.

    Raises:
        ValueError: ``x`` has no batch dimension, or a dynamic spatial dimension has size 1 or
            ``x`` has no spatial dimension.
    """
    axes = dynamic_axes_arg(dynamic_axes)
    if x.dim() == 0:
        raise ValueError("an export needs an input with a batch dimension, but got a 0-d tensor")
    if "spatial" in axes:
        if x.dim() < 3:
            raise ValueError(f"dynamic spatial dimensions need an input (batch, channels, *spatial), but got shape "
                             f"{tuple(x.shape)}")
        if min(x.shape[2:]) < 2:
            raise ValueError(f"dynamic spatial dimensions need an example with every spatial size at least 2 "
                             f"(torch.export fixes a size of 1), but got shape {tuple(x.shape)}")
    if "batch" not in axes or x.shape[0] >= 2:
        return x
    return x.expand(2, *x.shape[1:]).clone()


def dynamic_shapes(x: Tensor, dynamic_axes: AxesArg = "batch") -> Optional[Tuple[Dict[int, Any], ...]]:
    """``dynamic_shapes`` for ``torch.export`` / ``torch.onnx.export`` of a model taking ``x``.

    Returns:
        ``({0: Dim("batch", min=1), 2: Dim.DYNAMIC, ...},)`` as ``dynamic_axes`` asks, or ``None``
        when every dimension is static.
    """
    axes = dynamic_axes_arg(dynamic_axes)
    dims: Dict[int, Any] = {}
    if "batch" in axes:
        dims[0] = torch.export.Dim("batch", min=1)
    if "spatial" in axes:
        free = getattr(torch.export.Dim, "DYNAMIC", None)
        if free is None:
            raise ValueError(f"dynamic spatial dimensions need torch.export.Dim.DYNAMIC (torch>=2.6); this is "
                             f"torch {torch.__version__}")
        dims.update({i: free for i in range(2, x.dim())})
    return (dims,) if dims else None


def _export_error(what: str, axes: Tuple[str, ...], exc: Exception) -> ValueError:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    bullets = [ln.strip()[2:].split(". ")[0].rstrip(".") for ln in lines[1:] if ln.strip().startswith("- ")]
    first = "; ".join([lines[0].strip(), *bullets[:3]])  # torch.export's bullets say which size was fixed
    dynamic = f" with dynamic {' and '.join(axes)} dimensions" if axes else ""
    hint = f"; the model's code may fix the {' or '.join(f'{a} size' for a in axes)}" if axes else ""
    return ValueError(f"{what}{dynamic} failed ({type(exc).__name__}: {first}){hint}")


def export_program(model: nn.Module, x: Tensor, dynamic_axes: AxesArg = "batch") -> "torch.export.ExportedProgram":
    """``torch.export.export`` of ``model`` on ``x`` with the dimensions ``dynamic_axes`` names dynamic.

    Args:
        model: the model, in eval mode.
        x: an example input.
        dynamic_axes: ``"batch"`` (default), ``("batch", "spatial")``, ... (see :func:`dynamic_axes_arg`).

    Raises:
        ValueError: the model's code fixes a size asked to be dynamic (the export's message says where).
    """
    axes = dynamic_axes_arg(dynamic_axes)
    x = example_batch(x, axes)
    try:
        return torch.export.export(model, (x,), dynamic_shapes=dynamic_shapes(x, axes))
    except Exception as exc:  # noqa: BLE001 - torch.export's constraint errors come in many types
        raise _export_error("torch.export", axes, exc) from exc


def save_export(model: nn.Module, x: Tensor, path: str,
                dynamic_axes: AxesArg = "batch") -> "torch.export.ExportedProgram":
    """Export ``model`` (:func:`export_program`) and ``torch.export.save`` it to ``path``."""
    program = export_program(model, x, dynamic_axes)
    torch.export.save(program, path)
    return program


def _weight_bytes(program: Any) -> int:
    """The bytes of an ``ONNXProgram``'s initializers (the weights a ``.onnx`` file would hold)."""
    return sum(v.const_value.nbytes for v in program.model.graph.initializers.values() if v.const_value is not None)


def onnx_files(path: str) -> List[str]:
    """The files an ONNX model needs: ``path`` and each external data file its weights name, in order.

    Raises:
        ImportError: ``onnx`` is not installed.
    """
    onnx = require("onnx", "reading an ONNX file", "onnx")
    model = onnx.load(path, load_external_data=False)
    files = [path]
    for graph in _graphs(model.graph):
        for tensor in graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            location = {e.key: e.value for e in tensor.external_data}.get("location")
            data = os.path.join(os.path.dirname(path), location) if location else None
            if data and data not in files:
                files.append(data)
    return files


def _graphs(graph: Any) -> List[Any]:
    """``graph`` and its subgraphs (``If`` / ``Loop`` bodies), depth first."""
    found = [graph]
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                found.extend(_graphs(sub))
    return found


def require_onnx_export(needed_by: str = "ONNX export") -> None:
    """Raise one ImportError line naming ``convbn[onnx]`` when torch's ONNX exporter cannot run
    (it needs the packages ``onnxscript`` and ``onnx``), so a command can fail before its work.

    Raises:
        ImportError: ``"ONNX export needs onnxscript: pip install 'convbn[onnx]'"``.
    """
    for module in ("onnxscript", "onnx"):
        require(module, needed_by, "onnx")


def save_onnx(model: nn.Module, x: Tensor, path: str, opset: int = DEFAULT_OPSET,
              dynamic_axes: AxesArg = "batch") -> List[str]:
    """Write ``model`` as ONNX to ``path``: input ``input``, output ``output``; returns the files written.

    The file is self-contained (weights inside) unless the weights pass :data:`SINGLE_FILE_BYTES`;
    then they go to a data file beside it, the second path returned, which must be shipped
    with it (ONNX Runtime looks for it next to the ``.onnx`` file).

    Args:
        model: the model, in eval mode (a folded one: no BatchNorm left to run).
        x: an example input.
        path: the ``.onnx`` file.
        opset: the ONNX opset (default :data:`DEFAULT_OPSET`).
        dynamic_axes: the dimensions left dynamic: ``"batch"`` (default), ``("batch", "spatial")``,
            ``"batch,spatial"``, ``None`` for none (see :func:`dynamic_axes_arg`).

    Returns:
        ``[path]``, or ``[path, data_file]`` for weights past :data:`SINGLE_FILE_BYTES`.

    Raises:
        ImportError: ``onnxscript`` or ``onnx`` (torch's ONNX exporter needs them) is not installed.
        ValueError: a bad ``dynamic_axes``, or the export failed (the exporter's first line).

    Example:
        >>> net = nn.Sequential(nn.Conv1d(2, 4, 5), nn.ReLU()).eval()           # doctest: +SKIP
        >>> save_onnx(net, torch.randn(2, 2, 400), "net.onnx", dynamic_axes="batch,spatial")  # doctest: +SKIP
        ['net.onnx']
    """
    axes = dynamic_axes_arg(dynamic_axes)
    require_onnx_export()
    program = export_program(model, x, axes)  # its errors name the size the model's code fixes
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), warnings.catch_warnings():  # the exporter prints its progress
            warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations inside the exporter
            onnx_program = torch.onnx.export(program, (example_batch(x, axes),), dynamo=True, opset_version=opset,
                                             input_names=["input"], output_names=["output"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - the exporter raises many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"ONNX export failed ({type(exc).__name__}: {first})") from exc
    onnx_program.save(path, external_data=_weight_bytes(onnx_program) > SINGLE_FILE_BYTES)
    return onnx_files(path)


def _outputs(out: Any) -> List[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _outputs(o)]
    return []


def _relative(got: Sequence[Tensor], want: Sequence[Tensor]) -> float:
    if len(got) != len(want):
        raise ValueError(f"the export returns {len(got)} tensors, the model {len(want)}")
    worst = 0.0
    for g, w in zip(got, want):
        if tuple(g.shape) != tuple(w.shape):
            raise ValueError(f"the export returns shape {tuple(g.shape)}, the model {tuple(w.shape)}")
        scale = w.abs().max().item() or 1.0
        worst = max(worst, (g.double() - w.double()).abs().max().item() / scale)
    return worst


def check_onnx(path: str, model: nn.Module, inputs: Sequence[Tensor]) -> List[float]:
    """Run the ONNX file in ONNX Runtime on each input; the max error relative to ``model``'s largest output.

    Returns:
        One figure per input: max |onnxruntime - model| / max |model|.

    Raises:
        ImportError: ``onnxruntime`` is not installed.
        ValueError: the outputs differ in count or shape.
    """
    ort = require("onnxruntime", "checking an ONNX file", "onnx")
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    errors = []
    with torch.no_grad():
        for x in inputs:
            got = [torch.from_numpy(a) for a in session.run(None, {name: x.detach().cpu().numpy()})]
            errors.append(_relative(got, [t.cpu() for t in _outputs(model(x))]))
    return errors


def check_program(program: "torch.export.ExportedProgram", model: nn.Module, inputs: Sequence[Tensor]) -> List[float]:
    """Like :func:`check_onnx` for a ``torch.export`` program (``program.module()``)."""
    module = program.module()
    with torch.no_grad():
        return [_relative(_outputs(module(x)), _outputs(model(x))) for x in inputs]
