"""Patches that only the patching thread sees: what tracing changes in torch while it runs.

Note: [tracing patches are the tracing thread's]
``torch.fx`` traces by replacing ``nn.Module.__call__`` and ``nn.Module.__getattr__`` (and the
functions registered with ``torch.fx.wrap``) for the whole process, and convbn's tracers add
``torch.jit.isinstance``, ``torch.autograd.Function.apply`` (and each Function's
``forward``), and ``_BatchNorm.forward`` for a BatchNorm body's trace. Done with plain
``setattr``, another thread calling a model meanwhile would run the tracer's wrappers (a
``NameError``: its modules are not in the traced model), and two traces at once would each
restore what the other had patched in (``nn.Module.__call__`` left patched for good).

Here a patch is a *dispatcher* installed in the attribute's place -- once, however many
threads patch it, counted and under a lock, the original put back by the last one out --
which serves the calling thread's innermost patch where it has one, and the original
everywhere else. :func:`fx_patches_scoped` routes ``torch.fx``'s own patching through the
same dispatchers for the tracing thread.
"""
from __future__ import annotations

import builtins
import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Tuple

from ..._compat import FxPatcher, fx_trace_globals, fx_tracing_flag, set_fx_tracing_flag

__all__ = ["scoped_attr", "scoped_item", "fx_patches_scoped", "thread_view_attr", "thread_view_item", "original_item",
           "static_attr"]

_ABSENT = object()
_LOCK = threading.RLock()
_LOCAL = threading.local()
# key -> [owner, name, dispatcher, original, users]
_INSTALLED: Dict[Tuple[int, str], List[Any]] = {}


def _stacks() -> Dict[Tuple[int, str], List[Any]]:
    stacks = getattr(_LOCAL, "stacks", None)
    if stacks is None:
        stacks = _LOCAL.stacks = {}
    return stacks


def _current(key: Tuple[int, str], original: Any) -> Any:
    stack = _stacks().get(key)
    return stack[-1] if stack else original


class _ThreadAttr:
    """A class attribute serving this thread's patch, or the original (a descriptor: methods,
    ``staticmethod`` and ``classmethod`` entries bind as the entry they stand for would)."""

    def __init__(self, owner: type, name: str, key: Tuple[int, str], original: Any) -> None:
        self.owner, self.name, self.key, self.original = owner, name, key, original

    def _raw(self) -> Any:
        raw = _current(self.key, self.original)
        if raw is _ABSENT:  # inherited: what the class would find without the patch
            for base in self.owner.__mro__[1:]:
                if self.name in base.__dict__:
                    return base.__dict__[self.name]
            raise AttributeError(self.name)
        return raw

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        raw = self._raw()
        get = getattr(type(raw), "__get__", None)
        return get(raw, obj, objtype if objtype is not None else type(obj)) if get is not None else raw


def _dict_dispatcher(d: Dict[str, Any], name: str, key: Tuple[int, str], original: Any) -> Callable[..., Any]:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        fn = _current(key, original)
        if fn is _ABSENT:
            fn = getattr(builtins, name)
        return fn(*args, **kwargs)

    dispatch.__name__ = name
    dispatch.__wrapped__ = getattr(builtins, name) if original is _ABSENT else original  # type: ignore[attr-defined]
    return dispatch


@contextlib.contextmanager
def _scoped(key: Tuple[int, str], install: Callable[[], List[Any]], new: Any) -> Iterator[None]:
    with _LOCK:
        entry = _INSTALLED.get(key)
        if entry is None:
            entry = _INSTALLED[key] = install()
        entry[4] += 1
    stack = _stacks().setdefault(key, [])
    stack.append(new)
    try:
        yield
    finally:
        for i in range(len(stack) - 1, -1, -1):  # this block's entry (blocks may end out of order)
            if stack[i] is new:
                del stack[i]
                break
        if not stack:
            _stacks().pop(key, None)
        with _LOCK:
            entry[4] -= 1
            if entry[4] == 0:
                del _INSTALLED[key]
                _restore(entry)


def _restore(entry: List[Any]) -> None:
    owner, name, _, original, _ = entry
    if isinstance(owner, dict):
        if original is _ABSENT:
            owner.pop(name, None)
        else:
            owner[name] = original
    elif original is _ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, original)


@contextlib.contextmanager
def scoped_attr(owner: type, name: str, new: Any) -> Iterator[None]:
    """``owner.name`` is ``new`` (a class ``__dict__`` entry: a function, ``staticmethod`` or
    ``classmethod``) for this thread during the block; other threads see the original."""
    key = (id(owner), name)

    def install() -> List[Any]:
        original = owner.__dict__.get(name, _ABSENT)
        dispatcher = _ThreadAttr(owner, name, key, original)
        setattr(owner, name, dispatcher)
        return [owner, name, dispatcher, original, 0]

    with _scoped(key, install, new):
        yield


@contextlib.contextmanager
def scoped_item(d: Dict[str, Any], name: str, new: Callable[..., Any]) -> Iterator[None]:
    """``d[name]`` (a module's globals) calls ``new`` for this thread during the block; other
    threads' calls go to the original (a builtin where ``d`` has no such name)."""
    key = (id(d), name)

    def install() -> List[Any]:
        original = d.get(name, _ABSENT)
        dispatcher = _dict_dispatcher(d, name, key, original)
        d[name] = dispatcher
        return [d, name, dispatcher, original, 0]

    with _scoped(key, install, new):
        yield


def thread_view_attr(owner: type, name: str) -> Any:
    """What ``getattr(owner, name)`` is for this thread."""
    return getattr(owner, name)


def thread_view_item(d: Dict[str, Any], name: str) -> Any:
    """What ``d[name]`` calls for this thread (``None`` where it has none)."""
    key = (id(d), name)
    entry = _INSTALLED.get(key)
    if entry is None or d.get(name) is not entry[2]:
        return d.get(name)
    value = _current(key, entry[3])
    return None if value is _ABSENT else value


def original_item(d: Dict[str, Any], name: str) -> Any:
    """``d[name]`` as it is without anyone's patch."""
    value = d[name]
    entry = _INSTALLED.get((id(d), name))
    return entry[3] if entry is not None and value is entry[2] else value


def static_attr(cls: type, name: str, default: Any = None) -> Any:
    """``inspect.getattr_static(cls, name)`` without anyone's patch: the class ``__dict__``
    entry (a function, ``staticmethod`` ...) the class has or inherits."""
    for base in cls.__mro__:
        value = base.__dict__.get(name, _ABSENT)
        if isinstance(value, _ThreadAttr):
            value = value.original
        if value is not _ABSENT:
            return value
    return default


class _ScopedPatcher(FxPatcher):  # type: ignore[misc, valid-type]
    """``torch.fx``'s patcher, with every patch the tracing thread's own (Note above)."""

    def __init__(self) -> None:
        super().__init__()
        self.exits = contextlib.ExitStack()

    def patch(self, frame_dict: Dict[str, Any], name: str, new_fn: Callable[..., Any],
              deduplicate: bool = True) -> None:
        new_fn.__fx_already_patched = deduplicate  # type: ignore[attr-defined]
        if getattr(thread_view_item(frame_dict, name), "__fx_already_patched", False):
            return
        self.exits.enter_context(scoped_item(frame_dict, name, new_fn))

    def patch_method(self, cls: type, name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        new_fn.__fx_already_patched = deduplicate  # type: ignore[attr-defined]
        if getattr(thread_view_attr(cls, name), "__fx_already_patched", False):
            return
        self.exits.enter_context(scoped_attr(cls, name, new_fn))

    def revert_all_patches(self) -> List[Any]:
        return []

    def reapply_all_patches(self) -> List[Any]:
        return []

    def __exit__(self, *exc: Any) -> None:
        self.exits.close()
        self.visited.clear()


@contextlib.contextmanager
def _new_patcher() -> Iterator[Any]:
    with _ScopedPatcher() as patcher:
        yield patcher


#: convbn traces running in this process, and torch.fx's "tracing" flag before the first began
_TRACES = {"count": 0, "flag": False}
_TRACES_LOCK = threading.Lock()


@contextlib.contextmanager
def fx_patches_scoped() -> Iterator[None]:
    """``torch.fx`` traces in this thread patch ``nn.Module.__call__`` and the rest for this
    thread only (Note: [tracing patches are the tracing thread's]).

    torch.fx's module-global "tracing" flag is saved and restored by each trace; two traces in
    two threads that overlap would leave it set for good (the second saved the first's True),
    and every later ``torch.compile`` call in the process would refuse to run. The flag is put
    back to what it was before the first of overlapping convbn traces began when the last ends.
    """
    with _TRACES_LOCK:
        if _TRACES["count"] == 0:
            _TRACES["flag"] = fx_tracing_flag()
        _TRACES["count"] += 1
    try:
        with scoped_item(fx_trace_globals(), "_new_patcher", _new_patcher):
            yield
    finally:
        with _TRACES_LOCK:
            _TRACES["count"] -= 1
            if _TRACES["count"] == 0:
                set_fx_tracing_flag(_TRACES["flag"])
