"""``convbn`` command line: one argparse subcommand per registered :class:`Command`.

Each subcommand lives in its own module, which defines a module-level ``COMMAND`` (a
:class:`Command`); :data:`COMMAND_MODULES` lists those modules, imported only when the
parser is built.

Errors: every bad option or input ends the command with ONE line on stderr,
``convbn SUBCOMMAND: error: ...`` naming the value and what is allowed, and exit status 2
(``--debug`` re-raises to show the traceback). Output paths are checked while parsing,
before any work starts. Warnings print as one line ``convbn: warning: ...``; torch's own
log lines (``torch.compile`` recompiles and fallbacks) are kept below ERROR unless ``--debug``.

Example:
    $ convbn --version
    $ convbn demo --help
    $ convbn bench --inference --help
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

__all__ = [
    "Command",
    "add_renamed_option",
    "COMMAND_MODULES",
    "load_commands",
    "build_parser",
    "main",
    "positive_int",
    "non_negative_int",
    "batch_size",
    "positive_float",
    "fraction",
    "device_arg",
    "existing_dir",
    "output_path",
    "input_shape",
    "memory_size",
    "existing_file",
]

AddArguments = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    """A ``convbn`` subcommand.

    Attributes:
        name: the subcommand as typed (``"demo"``).
        help: one line for ``convbn --help``.
        add_arguments: adds the subcommand's options to its (sub)parser.
        run: runs it with the parsed arguments; returns the process exit code.
        select: for a command with modes (``bench``): given the subcommand's own arguments,
            returns the ``add_arguments`` of the chosen mode, so that ``--help`` and the
            parser show that mode's real options.
    """

    name: str
    help: str
    add_arguments: AddArguments
    run: Callable[[argparse.Namespace], int]
    select: Optional[Callable[[Sequence[str]], AddArguments]] = None


#: Modules defining a module-level ``COMMAND: Command``, in the order ``--help`` lists them.
COMMAND_MODULES: List[str] = ["convbn.demo", "convbn.bench.command", "convbn.cli_explain", "convbn.cli_fold"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default; keeps the descriptions' line breaks.

    An option whose help already names its default (``--model``: ``None`` stands for
    ``mnist``) keeps its own wording rather than gaining a second "(default: None)".
    """

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        if action.help and "(default:" in action.help:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error: ``PROG: error: MESSAGE (see PROG --help)``, exit status 2.

    Options are never abbreviated (``allow_abbrev=False``): ``--input-shap`` is an error, not
    ``--input-shape``, so a typo cannot silently pick an option and a new option cannot change
    what an old command line means.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> "NoReturn":  # type: ignore[name-defined]  # noqa: F821
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        """argparse's ``parse_args``; an unknown option is reported by the subcommand that got it,
        with its usage and the closest option it has (``--input-shap``: did you mean ``--input-shape``?)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            target = self._chosen_subparser(parsed) or self
            target.error(f"unrecognized arguments: {' '.join(extras)}{_suggestion(target, extras)}")
        return parsed

    def _chosen_subparser(self, parsed: argparse.Namespace) -> Optional[argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None) or "")
        return None


def _suggestion(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``"; did you mean --input-shape?"`` for the first unknown option close to one of ``parser``'s."""
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def add_progress_arguments(parser: argparse.ArgumentParser, what: str = "a line per stage") -> None:
    """``--progress`` (print progress on stderr even when it is not a terminal) and
    ``--quiet`` / ``--no-progress`` (none); neither: progress where stderr is a terminal."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--progress", dest="progress", action="store_const", const=True, default=None,
                       help=f"show progress ({what}) on stderr even when it is not a terminal "
                            "(default: only on a terminal)")
    group.add_argument("--quiet", "--no-progress", dest="progress", action="store_const", const=False,
                       default=argparse.SUPPRESS, help="no progress output")


class _RenamedOption(argparse.Action):
    """An option's old spelling: stores into the new option's destination, with a warning."""

    def __init__(self, option_strings: Any, dest: str, new: str = "", append: bool = False, **kwargs: Any) -> None:
        self.new = new
        self.append = append
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        from .functional.deprecation import warn_renamed

        warn_renamed(str(option_string), self.new)
        if self.append:  # a repeatable option: add to the new option's list (a copy, never its default)
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


def add_renamed_option(parser: argparse.ArgumentParser, old: str, new: str, append: bool = False,
                       **kwargs: Any) -> None:
    """Accept ``old``, hidden from ``--help``, as the option ``new`` (already added; ``kwargs``:
    its ``type``, ``dest``; ``append``: ``new`` is repeatable) for one release, warning that it
    is deprecated."""
    parser.add_argument(old, action=_RenamedOption, new=new, append=append, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS, **kwargs)


# --------------------------------------------------------------------------- option types
# Each raises argparse.ArgumentTypeError, which argparse reports as
# "argument --flag: MESSAGE" on one line.


def _int_at_least(low: int, message: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``; ``message`` is what the error says it must be."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, but got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{message}, but got {value}")
        return value
    return parse


#: An integer >= 1.
positive_int = _int_at_least(1, "must be a positive integer")
#: An integer >= 0.
non_negative_int = _int_at_least(0, "must be 0 or more")
#: A training batch size: an integer >= 2 (BatchNorm needs 2 samples per channel).
batch_size = _int_at_least(2, "must be at least 2 (BatchNorm in training needs 2 samples)")


def positive_float(text: str) -> float:
    """A number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, but got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, but got {value}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], but got {value}")
    return value


def device_arg(text: str) -> str:
    """A torch device that exists here: ``cpu``, ``cuda``, ``cuda:N`` (when CUDA is available), ``mps`` ..."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} asked for, but CUDA is not available on this machine; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s) (0..{torch.cuda.device_count() - 1})"
            )
    elif device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise argparse.ArgumentTypeError(f"{text!r} asked for, but MPS is not available on this machine; use cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"device type {device.type!r} is not supported here; use cpu or cuda")
    return text


def existing_dir(text: str) -> str:
    """A directory that exists."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def existing_file(text: str) -> str:
    """A file that exists and can be read."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file")
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable")
    return text


def memory_size(text: str) -> str:
    """A memory size such as ``16GiB`` or ``512MiB`` (:func:`convbn.memory.parse_memory`); kept as written."""
    from .memory.budget import parse_memory

    try:
        parse_memory(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def output_path(text: str) -> str:
    """A file path that can be written (its directory exists and is writable); ``-`` is stdout."""
    if text == "-":
        return text
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {parent!r} is not writable")
    return text


def input_shape(text: str) -> tuple:
    """``1x3x224x224`` or ``1,3,224,224``: the full input shape, batch included, positive ints."""
    parts = text.replace(",", "x").split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 2x3x224x224, but got {text!r}") from None
    if len(shape) < 2 or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"expected at least 2 positive sizes like 2x3x224x224, but got {text!r}")
    return shape


# --------------------------------------------------------------------------- parser


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


def _version() -> str:
    from . import __version__

    return __version__


def build_parser(commands: Optional[Sequence[Command]] = None, argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The ``convbn`` parser with one subparser per command (``args.command_obj`` is the chosen one).

    Args:
        commands: the commands (default: :func:`load_commands`).
        argv: the arguments about to be parsed; a command with modes adds the options of
            the mode they choose.
    """
    parser = ArgumentParser(
        prog="convbn",
        description="Fused Convolution + BatchNorm (+ activation) for PyTorch: demo, benchmarks, explain, fold.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"convbn {_version()}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    sub.required = True
    argv = list(argv)
    for command in load_commands() if commands is None else commands:
        p = sub.add_parser(command.name, help=command.help, description=command.help, formatter_class=HelpFormatter)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
        add = command.add_arguments
        if command.select is not None and command.name in argv:
            add = command.select(argv[argv.index(command.name) + 1 :])
        add(p)
        p.set_defaults(command_obj=command)
    return parser


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, KeyError):
        text = f"KeyError {text}"
    return text


def _format_warning(message: Any, category: Any, filename: str, lineno: int, line: Optional[str] = None) -> str:
    return f"convbn: warning: {' '.join(str(message).split())} ({category.__name__})\n"


#: Errors reported as one line with exit status 2 (bad options, specs, files, missing packages).
USER_ERRORS = (ValueError, TypeError, OSError, ImportError, argparse.ArgumentTypeError)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``convbn`` / ``python -m convbn``.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit code of the subcommand; 2 for a bad option or input (one line on stderr).

    Example:
        >>> main(["demo", "--epochs", "1", "--limit", "256", "--no-plot"])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv=argv)
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    previous = warnings.formatwarning
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    if not debug:
        warnings.formatwarning = _format_warning  # type: ignore[assignment]
        # torch.compile / checkpoint log lines (recompiles, graph breaks, fallbacks) are not the
        # command's output; --debug shows them
        torch_logger.setLevel(logging.ERROR)
    try:
        return int(args.command_obj.run(args))
    except USER_ERRORS as exc:
        if debug:
            raise
        print(f"convbn {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"convbn {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = previous  # type: ignore[assignment]
        torch_logger.setLevel(level)
