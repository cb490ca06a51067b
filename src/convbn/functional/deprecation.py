"""Old public names kept for one release: each use warns, naming the new name.

Every layer may import this (it sits in the lowest one), so an alias warns the same way
wherever it lives:

* :func:`warn_renamed` -- the warning itself (``FutureWarning``, shown by default; it
  points at the user's line);
* :func:`module_aliases` -- a module's ``__getattr__`` answering old names
  (``convbn.STRATEGIES``, ``from convbn import CONVERT_STRATEGIES``);
* :func:`renamed_kwargs` -- a function decorator taking an old keyword argument's name;
* :class:`RenamedAttribute` -- an instance attribute's old name (a module's
  ``fold_report``): a stand-in that forwards to the new attribute's value.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Dict, Tuple, TypeVar

__all__ = ["REMOVED_IN", "RenamedAttribute", "module_aliases", "renamed_kwargs", "warn_renamed"]

#: The release that removes the old names.
REMOVED_IN = "0.3"

F = TypeVar("F", bound=Callable[..., Any])


def warn_renamed(old: str, new: str, *, stacklevel: int = 2) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``.

    Args:
        old: the old spelling, as the user wrote it (``"convbn.STRATEGIES"``).
        new: what to write instead.
        stacklevel: as for :func:`warnings.warn`, counted from the caller of this function
            (``2``: the line that called the function calling ``warn_renamed``).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     warn_renamed("old_name", "new_name")
        >>> str(w[0].message)
        'old_name is deprecated and will be removed in convbn 0.3; use new_name instead'
    """
    warnings.warn(f"{old} is deprecated and will be removed in convbn {REMOVED_IN}; use {new} instead",
                  FutureWarning, stacklevel=stacklevel + 1)


def module_aliases(module: str, aliases: Dict[str, Tuple[Callable[[], Any], str]]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` (PEP 562) answering old names with a warning.

    Args:
        module: the module's ``__name__``.
        aliases: old name -> (a function returning the value, what to write instead).

    Returns:
        The ``__getattr__`` to assign in the module; other names raise ``AttributeError``.

    Example:
        >>> __getattr__ = module_aliases(__name__, {"OLD": (lambda: 1, "NEW")})
    """
    def __getattr__(name: str) -> Any:
        if name in aliases:
            value, new = aliases[name]
            warn_renamed(f"{module}.{name}", new, stacklevel=2)
            return value()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def renamed_kwargs(**renames: str) -> Callable[[F], F]:
    """Decorate a function so that each old keyword argument (``old="new"``) still works, warning.

    Passing both the old and the new name is a ``TypeError``.

    Example:
        >>> @renamed_kwargs(sample="example_inputs")
        ... def f(example_inputs=None):
        ...     return example_inputs
    """
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {old}= (deprecated) and {new}=; pass only {new}=")
                    warn_renamed(f"{fn.__name__}({old}=...)", f"{new}=", stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


class RenamedAttribute:
    """What an instance attribute's old name holds: the new attribute's value, behind a warning.

    Attribute reads, ``str``, ``repr``, ``==``, iteration, ``len`` and ``bool`` go to the
    value, each warning; ``isinstance`` sees the value's class; reads of underscored names
    or of names the value lacks (what TorchScript, ``copy`` and ``pickle`` probe on every
    attribute of a module) go to the value quietly.

    Args:
        value: the object the new name holds.
        old: the old spelling (``"model.fold_report"``).
        new: the new one.

    Example:
        >>> import warnings
        >>> alias = RenamedAttribute([1, 2], "obj.old", "obj.new")
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     len(alias), isinstance(alias, list)
        (2, True)
    """

    def __init__(self, value: Any, old: str, new: str) -> None:
        object.__setattr__(self, "_value", value)
        object.__setattr__(self, "_names", (old, new))

    def _get(self) -> Any:
        old, new = object.__getattribute__(self, "_names")
        warn_renamed(old, new, stacklevel=3)
        return object.__getattribute__(self, "_value")

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(alias, FoldReport) holds, quietly
        return type(object.__getattribute__(self, "_value"))

    def __getattr__(self, name: str) -> Any:
        value = object.__getattribute__(self, "_value")
        if name.startswith("_") or not hasattr(value, name):
            # introspection (TorchScript's type inference, copy, pickle), not a use of the old name
            return getattr(value, name)
        return getattr(self._get(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._get(), name, value)

    def __str__(self) -> str:
        return str(self._get())

    def __repr__(self) -> str:
        return repr(self._get())

    def __eq__(self, other: Any) -> bool:
        return bool(self._get() == other)

    def __hash__(self) -> int:
        return hash(object.__getattribute__(self, "_value"))

    def __iter__(self) -> Any:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __bool__(self) -> bool:
        return bool(self._get())

    def __deepcopy__(self, memo: Dict[int, Any]) -> "RenamedAttribute":  # a deep-copied model keeps the alias
        import copy

        old, new = object.__getattribute__(self, "_names")
        return RenamedAttribute(copy.deepcopy(object.__getattribute__(self, "_value"), memo), old, new)

    def __reduce__(self) -> Tuple[Any, ...]:  # a pickled model keeps the alias
        return (RenamedAttribute, (object.__getattribute__(self, "_value"), *object.__getattribute__(self, "_names")))
