"""``convbn`` command line: one argparse subcommand per registered :class:`Command`.

Each subcommand lives in its own module, which defines a module-level ``COMMAND`` (a
:class:`Command`); :data:`COMMAND_MODULES` lists those modules. Adding a subcommand (for
example ``bench``) is one line there, and the module is only imported when the parser
is built.

Example:
    $ python -m convbn demo --epochs 1 --limit 512
    $ convbn demo --help
"""
from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

__all__ = ["Command", "COMMAND_MODULES", "load_commands", "build_parser", "main"]


@dataclass(frozen=True)
class Command:
    """A ``convbn`` subcommand.

    Attributes:
        name: the subcommand as typed (``"demo"``).
        help: one line for ``convbn --help``.
        add_arguments: adds the subcommand's options to its (sub)parser.
        run: runs it with the parsed arguments; returns the process exit code.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    #: hand options the subparser does not know to ``run`` as ``args.extra`` (a command
    #: that dispatches to modes with their own parsers, like ``bench``)
    passthrough: bool = False


#: Modules defining a module-level ``COMMAND: Command``, in the order ``--help`` lists them.
COMMAND_MODULES: List[str] = ["convbn.demo", "convbn.bench.command"]


def load_commands(modules: Optional[Sequence[str]] = None) -> List[Command]:
    """Import each module of ``modules`` (default :data:`COMMAND_MODULES`) and collect its ``COMMAND``.

    Raises:
        TypeError: a module has no ``COMMAND`` or it is not a :class:`Command`.
        ValueError: two commands share a name.
    """
    commands: List[Command] = []
    for name in COMMAND_MODULES if modules is None else modules:
        module = importlib.import_module(name)
        command = getattr(module, "COMMAND", None)
        if not isinstance(command, Command):
            raise TypeError(f"module {name} must define COMMAND = convbn.cli.Command(...), but got {type(command).__name__}")
        if any(c.name == command.name for c in commands):
            raise ValueError(f"two convbn subcommands are named {command.name!r}; rename one in {name}")
        commands.append(command)
    return commands


def build_parser(commands: Optional[Sequence[Command]] = None) -> argparse.ArgumentParser:
    """The ``convbn`` parser with one subparser per command (``args.command_obj`` is the chosen one)."""
    parser = argparse.ArgumentParser(
        prog="convbn",
        description="Fused Convolution + BatchNorm (+ activation) for PyTorch: demos and measurements.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in load_commands() if commands is None else commands:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(command_obj=command)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``convbn`` / ``python -m convbn``.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit code of the subcommand.

    Example:
        >>> main(["demo", "--epochs", "1", "--limit", "256"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(None if argv is None else list(argv))
    if extra and not args.command_obj.passthrough:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return int(args.command_obj.run(args))
