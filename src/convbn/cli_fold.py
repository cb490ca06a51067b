"""``convbn fold SPEC ...``: fold a model's BatchNorms for inference, check it, optionally save it.

Builds the model (a benchmark spec or ``module:callable``, see :mod:`convbn.cli_explain`;
``--checkpoint`` loads trained weights into it), puts it in eval mode, runs
:func:`convbn.fold` with the numerical check on a random input and prints the
per-BatchNorm report. Saving:

* ``--save-onnx PATH``: ONNX (opset ``--onnx-opset``), one self-contained file (the weights
  go to a data file beside it, named in the output, only past protobuf's 2 GiB limit),
  checked in ONNX Runtime at batch 1 and 7 when it is installed (:mod:`convbn.deploy`);
* ``--save-export PATH``: a ``torch.export`` program (``.pt2``);
* ``--dynamic-axes batch,spatial``: which dimensions of both exports stay dynamic: ``batch``
  (the default), ``spatial`` (every dimension after the channels: a signal's length, height
  and width), both, or ``none``. Dynamic spatial dimensions are also checked at a second
  input size (each spatial size plus its largest power-of-two factor: 400 -> 416, 64 -> 128);
* ``--save-script PATH``: TorchScript (``torch.jit.script``, falling back to ``torch.jit.trace``);
* ``--save-state PATH``: the folded model's ``state_dict``. It has no BatchNorm entries
  (they are folded into the conv weights and biases), so it loads into ``convbn.fold(model)``
  of the same model, not into the model itself: keep the original checkpoint for training.

Example:
    $ convbn fold monai:resnet18 --checkpoint last.ckpt --save-onnx resnet18.onnx
    $ convbn fold mynets:audio_net --input-shape 2x1x400 --dynamic-axes batch,spatial --save-onnx audio.onnx
"""
from __future__ import annotations

import argparse
import warnings
from typing import List, Tuple

import torch

from .cli import Command, output_path, positive_int
from .cli_model import add_model_arguments, load_model, model_input

__all__ = ["add_arguments", "run", "COMMAND", "dynamic_axes", "other_size", "check_inputs"]

#: The batch sizes an ONNX or torch.export file is checked at after saving.
CHECK_BATCHES = (1, 7)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``convbn fold``."""
    from .deploy import DEFAULT_OPSET

    add_model_arguments(parser)
    parser.add_argument("--save-onnx", type=output_path, default=None, metavar="PATH",
                        help="save the folded model as one self-contained ONNX file (needs convbn[onnx])")
    parser.add_argument("--onnx-opset", type=positive_int, default=DEFAULT_OPSET, help="ONNX opset of --save-onnx")
    parser.add_argument("--save-export", type=output_path, default=None, metavar="PATH",
                        help="save the folded model as a torch.export program (.pt2)")
    parser.add_argument("--dynamic-axes", type=dynamic_axes, default="batch", metavar="AXES",
                        help="dimensions of --save-onnx / --save-export left dynamic: batch, spatial (every "
                             "dimension after the channels), batch,spatial, or none")
    parser.add_argument("--save-script", type=output_path, default=None, metavar="PATH",
                        help="save the folded model as TorchScript (script, else trace)")
    parser.add_argument("--save-state", type=output_path, default=None, metavar="PATH",
                        help="torch.save the folded model's state_dict (loads into convbn.fold(model), not into model)")


def dynamic_axes(text: str) -> Tuple[str, ...]:
    """``batch``, ``spatial``, ``batch,spatial`` or ``none``: the dimensions an export leaves dynamic."""
    from .deploy import dynamic_axes_arg

    try:
        return dynamic_axes_arg(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def other_size(size: int) -> int:
    """A second size for a dynamic spatial dimension: ``size`` plus its largest power-of-two factor.

    The model's own divisibility (a U-Net's downsampling) still holds: 64 -> 128, 400 -> 416, 28 -> 32.
    """
    return size + (size & -size)


def check_inputs(x: torch.Tensor, axes: Tuple[str, ...]) -> Tuple[List[torch.Tensor], str]:
    """The inputs an export is checked at, and their description for the output line."""
    spatial = tuple(x.shape[2:])
    batches = CHECK_BATCHES if "batch" in axes else (x.shape[0],)
    inputs = [torch.randn(b, *x.shape[1:], device=x.device) for b in batches]
    said = f"batch {', '.join(map(str, batches))}"
    if "spatial" in axes:
        other = tuple(other_size(s) for s in spatial)
        inputs.append(torch.randn(batches[0], x.shape[1], *other, device=x.device))
        said += f" and size {'x'.join(map(str, other))}"
    return inputs, said


def run(args: argparse.Namespace) -> int:
    """Fold, check, report and save; returns the exit code."""
    from . import deploy
    from .passes.fold.api import fold

    if args.save_onnx:
        deploy.require_onnx_export("--save-onnx")  # before folding and checking, not after
    model, default = load_model(args.spec, args.checkpoint)
    model = model.to(args.device).eval()
    x = model_input(args, model, default)
    folded = fold(model, example_inputs=x, check=True)
    print(f"{args.spec}, input {'x'.join(map(str, x.shape))}")
    print(folded.convbn_report)
    with torch.no_grad():
        diff = (folded(x) - model(x)).abs().max().item()
    print(f"max |folded - original| on a random input: {diff:.2e}")
    axes = args.dynamic_axes
    dynamic = f"dynamic {' and '.join(axes)}" if axes else "static shapes"
    if args.save_onnx:
        files = deploy.save_onnx(folded, x, args.save_onnx, opset=args.onnx_opset, dynamic_axes=axes)
        inputs, said = check_inputs(x, axes)
        try:
            errors = deploy.check_onnx(args.save_onnx, folded, inputs)
            checked = f"; ONNX Runtime at {said}: max relative error {max(errors):.1e}"
        except ImportError:
            checked = " (onnxruntime not installed: not checked)"
        where = "" if len(files) == 1 else (f" and its weights to {', '.join(files[1:])} (past protobuf's 2 GiB "
                                            "limit for one file: ship them together)")
        print(f"ONNX (opset {args.onnx_opset}, {dynamic}) written to {args.save_onnx}{where}{checked}")
    if args.save_export:
        program = deploy.save_export(folded, x, args.save_export, dynamic_axes=axes)
        inputs, said = check_inputs(x, axes)
        errors = deploy.check_program(program, folded, inputs)
        print(f"torch.export program ({dynamic}) written to {args.save_export}; at {said}: "
              f"max relative error {max(errors):.1e}")
    if args.save_script:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's tracer warnings: explained by the fallback note
            try:
                scripted = torch.jit.script(folded)
                how = "torch.jit.script"
            except Exception:  # noqa: BLE001 - not scriptable: trace instead, and say so
                scripted = torch.jit.trace(folded, (x,), check_trace=False)
                how = "torch.jit.trace (script failed)"
        scripted.save(args.save_script)
        print(f"TorchScript ({how}) written to {args.save_script}")
    if args.save_state:
        torch.save(folded.state_dict(), args.save_state)
        print(f"state_dict of the folded model written to {args.save_state} (no BatchNorm entries: it loads into "
              "convbn.fold(model), not into the original model)")
    return 0


COMMAND = Command(
    name="fold",
    help="fold BatchNorm into neighbouring layers for inference; report, check, save ONNX/export/TorchScript/state",
    add_arguments=add_arguments,
    run=run,
)
