"""``convbn explain SPEC --input-shape ...``: what :func:`convbn.convert` would do to a model.

``SPEC`` is a benchmark model spec (``mnist``, ``monai:resnet18``,
``'monai:resnet50(spatial_dims=2)'``, ``efficientnet:b0`` ... see
:mod:`convbn.bench.models`) or ``module:callable`` naming a function or class of the
user's that returns an ``nn.Module`` (``mypkg.nets:build_net``). The per-layer report lists
each fused pair with its strategy, kept bytes and recomputed MACs, and each BatchNorm
left alone with the reason.

Example:
    $ convbn explain mnist --input-shape 64x1x28x28
    $ convbn explain mypkg.nets:build_net --input-shape 8x3x224x224 --budget 0.5
    $ convbn explain mnist --memory 16GiB    # the largest batch eager and convbn train in 16 GiB
"""
from __future__ import annotations

import argparse
import importlib
from typing import Optional, Tuple

import torch
from torch import nn

from .cli import Command, device_arg, fraction, input_shape

__all__ = ["load_model", "add_arguments", "run", "COMMAND"]


def load_model(spec: str) -> Tuple[nn.Module, Optional[Tuple[int, ...]]]:
    """The model named by ``spec`` and its default input shape without batch (``None`` if unknown).

    ``module:callable`` (a module that is not one of the spec sources ``mnist``, ``monai``,
    ``efficientnet``, ``torchvision``, ``timm``; a colon; a name) imports the module and
    calls the callable with no arguments; anything else is a
    :func:`convbn.bench.models.build_model` spec.

    Raises:
        ValueError: the module has no such callable, or it did not return an ``nn.Module``.
        ImportError: the module does not import.
    """
    head, sep, name = spec.partition(":")
    from .bench.models import SOURCES

    if sep and head not in SOURCES and name.isidentifier():
        try:
            module = importlib.import_module(head)
        except ImportError as exc:
            raise ImportError(f"cannot import module {head!r} of {spec!r}: {exc}") from exc
        factory = getattr(module, name, None)
        if not callable(factory):
            raise ValueError(f"{head!r} has no callable {name!r} (spec {spec!r} must be module:callable)")
        model = factory()
        if not isinstance(model, nn.Module):
            raise ValueError(f"{spec!r} returned {type(model).__name__}, expected an nn.Module")
        return model, None
    from .bench.models import build_model

    model, shape = build_model(spec)
    return model, tuple(shape)


def resolve_shape(spec: str, given: Optional[Tuple[int, ...]], default: Optional[Tuple[int, ...]], batch: int) -> Tuple[int, ...]:
    """``--input-shape`` if given, else ``(batch, *default)``; an error when neither is known."""
    if given is not None:
        return tuple(given)
    if default is None:
        raise ValueError(f"{spec!r} has no known input shape; pass --input-shape, e.g. 8x3x224x224")
    return (batch,) + tuple(default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``convbn explain``."""
    parser.add_argument("spec", metavar="SPEC", help="model spec (mnist, monai:resnet18, ...) or module:callable")
    parser.add_argument("--input-shape", type=input_shape, default=None, metavar="NxCxHxW",
                        help="full input shape with batch (default: the spec's own shape with --batch-size)")
    parser.add_argument("--batch-size", type=int, default=2, help="batch for the spec's default shape")
    parser.add_argument("--strategy", choices=("auto", "recompute_bn", "recompute_conv"), default="auto",
                        help="convert strategy to explain")
    parser.add_argument("--budget", type=fraction, default=None, metavar="X",
                        help="with --strategy auto: target saved activation bytes as a fraction in (0, 1] of eager")
    parser.add_argument("--peak-budget", type=fraction, default=None, metavar="X",
                        help="with --strategy auto: the training step's peak memory allowed, a fraction in (0, 1] "
                             "of eager's")
    parser.add_argument("--memory", type=str, default=None, metavar="SIZE",
                        help="also report the largest batch that trains within SIZE (e.g. 16GiB, 512MiB), eager "
                             "and converted (convbn.max_batch; runs real steps at the batches it tries)")
    parser.add_argument("--no-chain", action="store_true", help="do not chain consecutive layers (tutorial's method)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="torch device")


def run(args: argparse.Namespace) -> int:
    """Print the report of :func:`convbn.explain`; returns the exit code."""
    from .passes.convert import explain

    for flag, value in (("--budget", args.budget), ("--peak-budget", args.peak_budget)):
        if value is not None and args.strategy != "auto":
            raise ValueError(f"{flag} is used by --strategy auto only, but got --strategy {args.strategy}")
    if args.memory is not None:
        from .memory.budget import parse_memory

        parse_memory(args.memory)  # a readable size, before any model is built
        if args.strategy != "auto":
            raise ValueError(f"--memory plans with --strategy auto only, but got --strategy {args.strategy}")
    model, default = load_model(args.spec)
    shape = resolve_shape(args.spec, args.input_shape, default, args.batch_size)
    model = model.to(args.device).train()
    x = torch.randn(*shape, device=args.device)
    report = explain(model, x, strategy=args.strategy, memory_budget=args.budget, peak_budget=args.peak_budget,
                     chain=not args.no_chain)
    print(f"{args.spec}, input {'x'.join(map(str, shape))}")
    print(report)
    if args.memory is not None:
        from .batch_fit import max_batch

        fit = max_batch(model, x, args.memory, chain=not args.no_chain)
        print(fit)
    return 0


COMMAND = Command(
    name="explain",
    help="per-layer report of what convbn.convert would do: strategy, kept bytes, recompute MACs, skipped BNs",
    add_arguments=add_arguments,
    run=run,
)
