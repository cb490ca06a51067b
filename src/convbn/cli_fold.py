"""``convbn fold SPEC ...``: fold a model's BatchNorms for inference, check it, optionally save it.

Builds the model (a benchmark spec or ``module:callable``, see :mod:`convbn.cli_explain`),
puts it in eval mode, runs :func:`convbn.fold` with the numerical check on a random input
and prints the per-BatchNorm report. ``--save-state PATH`` writes the folded model's
``state_dict`` (``torch.save``), ``--save-script PATH`` a TorchScript module
(``torch.jit.script``, falling back to ``torch.jit.trace``) and ``--save-export PATH`` a
``torch.export`` program (``.pt2``).

Example:
    $ convbn fold monai:resnet18 --batch-size 1 --save-script resnet18-folded.pt
"""
from __future__ import annotations

import argparse
import warnings

import torch

from .cli import Command, device_arg, output_path, input_shape
from .cli_explain import load_model, resolve_shape

__all__ = ["add_arguments", "run", "COMMAND"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``convbn fold``."""
    parser.add_argument("spec", metavar="SPEC", help="model spec (mnist, monai:resnet18, ...) or module:callable")
    parser.add_argument("--input-shape", type=input_shape, default=None, metavar="NxCxHxW",
                        help="full input shape with batch (default: the spec's own shape with --batch-size)")
    parser.add_argument("--batch-size", type=int, default=2, help="batch for the spec's default shape")
    parser.add_argument("--device", type=device_arg, default="cpu", help="torch device")
    parser.add_argument("--save-state", type=output_path, default=None, metavar="PATH",
                        help="torch.save the folded model's state_dict")
    parser.add_argument("--save-script", type=output_path, default=None, metavar="PATH",
                        help="save the folded model as TorchScript (script, else trace)")
    parser.add_argument("--save-export", type=output_path, default=None, metavar="PATH",
                        help="save the folded model as a torch.export program (.pt2)")


def run(args: argparse.Namespace) -> int:
    """Fold, check, report and save; returns the exit code."""
    from .passes.fold import fold

    model, default = load_model(args.spec)
    shape = resolve_shape(args.spec, args.input_shape, default, args.batch_size)
    model = model.to(args.device).eval()
    x = torch.randn(*shape, device=args.device)
    folded = fold(model, example_inputs=x, check=True)
    print(f"{args.spec}, input {'x'.join(map(str, shape))}")
    print(folded.fold_report)
    with torch.no_grad():
        diff = (folded(x) - model(x)).abs().max().item()
    print(f"max |folded - original| on a random input: {diff:.2e}")
    if args.save_state:
        torch.save(folded.state_dict(), args.save_state)
        print(f"state_dict written to {args.save_state}")
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
    if args.save_export:
        program = torch.export.export(folded, (x,))
        torch.export.save(program, args.save_export)
        print(f"torch.export program written to {args.save_export}")
    return 0


COMMAND = Command(
    name="fold",
    help="fold BatchNorm into neighbouring layers for inference; report, check, save state/TorchScript/export",
    add_arguments=add_arguments,
    run=run,
)
