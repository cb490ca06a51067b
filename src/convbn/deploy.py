"""Saving a folded model for deployment: ``torch.export`` and ONNX with a dynamic batch dimension.

Both exports trace the model once on an example input; the batch dimension is marked
dynamic, so one file serves every batch size (a fixed batch would fail a guard, or give
wrong shapes, at any other). The example must have a batch of at least 2: ``torch.export``
specialises a size of 1 to the constant 1, so a batch-1 example is repeated to 2 first.

ONNX uses torch's default exporter (``torch.onnx.export(..., dynamo=True)``, built on
``torch.export``), which needs the ``onnxscript`` package. Opset 18 is its native opset
(no version conversion) and ONNX Runtime has run it since 1.14. ONNX Runtime does not fold
BatchNorm after a ConvTranspose itself; a model folded by :func:`convbn.fold` has none left.

Example:
    >>> folded = convbn.fold(model.eval(), example_inputs=x)            # doctest: +SKIP
    >>> save_onnx(folded, x, "model.onnx")                               # doctest: +SKIP
    >>> check_onnx("model.onnx", folded, [x[:1], torch.randn(7, *x.shape[1:])])  # doctest: +SKIP
"""
from __future__ import annotations

import io
import contextlib
import warnings
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn

from .extras import require

__all__ = ["DEFAULT_OPSET", "example_batch", "export_program", "save_export", "save_onnx", "check_onnx",
           "check_program", "require_onnx_export"]

#: The ONNX opset :func:`save_onnx` writes unless told otherwise.
DEFAULT_OPSET = 18


def example_batch(x: Tensor) -> Tensor:
    """``x`` with a batch of at least 2 (a batch of 1 repeated), for an export with a dynamic batch."""
    if x.dim() == 0:
        raise ValueError("an export needs an input with a batch dimension, but got a 0-d tensor")
    return x if x.shape[0] >= 2 else x.expand(2, *x.shape[1:]).clone()


def _dynamic_batch() -> Tuple[Dict[int, Any], ...]:
    """``dynamic_shapes`` for one input whose dimension 0, the batch, is dynamic."""
    return ({0: torch.export.Dim("batch", min=1)},)


def export_program(model: nn.Module, x: Tensor) -> "torch.export.ExportedProgram":
    """``torch.export.export`` of ``model`` on ``x`` with a dynamic batch dimension.

    Raises:
        ValueError: the model's code fixes the batch size (the export's message says where).
    """
    x = example_batch(x)
    try:
        return torch.export.export(model, (x,), dynamic_shapes=_dynamic_batch())
    except Exception as exc:  # noqa: BLE001 - torch.export's constraint errors come in many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"torch.export with a dynamic batch dimension failed ({type(exc).__name__}: {first}); "
                         "the model's code may fix the batch size") from exc


def save_export(model: nn.Module, x: Tensor, path: str) -> "torch.export.ExportedProgram":
    """Export ``model`` (dynamic batch, :func:`export_program`) and ``torch.export.save`` it to ``path``."""
    program = export_program(model, x)
    torch.export.save(program, path)
    return program


def require_onnx_export(needed_by: str = "ONNX export") -> None:
    """Raise one ImportError line naming ``convbn[onnx]`` when torch's ONNX exporter cannot run
    (it needs the packages ``onnxscript`` and ``onnx``), so a command can fail before its work.

    Raises:
        ImportError: ``"ONNX export needs onnxscript: pip install 'convbn[onnx]'"``.
    """
    for module in ("onnxscript", "onnx"):
        require(module, needed_by, "onnx")


def save_onnx(model: nn.Module, x: Tensor, path: str, opset: int = DEFAULT_OPSET) -> None:
    """Write ``model`` as ONNX to ``path``: input ``input``, output ``output``, the batch dimension dynamic.

    Args:
        model: the model, in eval mode (a folded one: no BatchNorm left to run).
        x: an example input.
        path: the ``.onnx`` file.
        opset: the ONNX opset (default :data:`DEFAULT_OPSET`).

    Raises:
        ImportError: ``onnxscript`` or ``onnx`` (torch's ONNX exporter needs them) is not installed.
        ValueError: the export failed (the exporter's first line).
    """
    require_onnx_export()
    x = example_batch(x)
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), warnings.catch_warnings():  # the exporter prints its progress
            warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations inside the exporter
            torch.onnx.export(model, (x,), path, dynamo=True, dynamic_shapes=_dynamic_batch(), opset_version=opset,
                              input_names=["input"], output_names=["output"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - the exporter raises many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"ONNX export failed ({type(exc).__name__}: {first})") from exc


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
