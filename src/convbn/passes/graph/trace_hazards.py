"""Trace hazards, exactly: where ``torch.fx`` would record another computation than eager runs.

* ``isinstance`` on a proxy is a hazard only where its answer could differ from the real
  value's (Note: [an isinstance hazard only where the answer could differ]);
* a custom ``torch.autograd.Function`` stays one opaque call (Note: [autograd Functions stay whole]).

Used by :mod:`convbn.passes.tracing.trace` while tracing.
"""
from __future__ import annotations

import contextlib
import linecache
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx

from ..._compat import SingleLevelFunction, function_apply_impl, function_apply_wrapper, pytree
from .shape_capture import VALUE
from .thread_patch import scoped_attr, static_attr

__all__ = ["FunctionCall", "opaque_functions"]


# Note: [an isinstance hazard only where the answer could differ]
# ``isinstance(p, C)`` on a proxy ``p`` answers ``issubclass(type(p), C)``; eager asks the
# real value. For a value that is a tensor in eager (a module's input, an op's result) the
# two answers differ exactly when ``C`` is ``torch.Tensor`` or one of its bases: asking
# ``isinstance(x, dict)`` / ``(list, tuple)`` takes the same branch on both and is no
# hazard. The classes asked are read off the calling line (each ``isinstance(..., C)``
# call on it, ``C`` evaluated in the caller's frame: names, attributes and tuples only);
# where they cannot be read, or the proxy may stand for a non-tensor (a shape, a number,
# a tuple of pieces), any ``isinstance`` is a hazard, as before. In a trace with real inputs a
# piece of a tuple whose fake value is a tensor (``to_qkv(x).chunk(3, 1)``'s items, handed to
# einops' ``rearrange``, which asks ``isinstance(tensor, list)``) is known to be one.
_NON_TENSOR_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "tolist", "item", "split",
                                 "chunk", "unbind", "stride", "element_size", "is_contiguous", "__len__",
                                 "tensor_split", "keys", "values", "items"})


def _tensor_valued(node: fx.Node) -> bool:
    """Whether ``node`` surely stands for a tensor in eager (conservative)."""
    import builtins
    import operator

    if node.op in ("call_module", "get_attr"):
        return True
    if node.op == "placeholder":
        ann = node.type  # an input is a tensor unless annotated as a class that is not one
        return not isinstance(ann, type) or issubclass(ann, torch.Tensor)
    if node.op == "call_method":
        return str(node.target) not in _NON_TENSOR_METHODS
    if node.op == "call_function":
        target = node.target
        if target in (getattr, operator.getitem, len, torch.split, torch.chunk, torch.unbind, torch.tensor_split):
            return False
        return not (getattr(target, "__module__", None) == builtins.__name__ or isinstance(target, FunctionCall))
    return False


def _asked_classes(line: str, frame: Any) -> Optional[List[Any]]:
    """The classes of every ``isinstance(obj, C)`` call on ``line``, evaluated in ``frame``;
    ``None`` where one cannot be read."""
    import ast

    found: List[Any] = []
    start = 0
    while True:
        i = line.find("isinstance(", start)
        if i < 0:
            break
        depth, j = 0, i + len("isinstance")
        for j in range(i + len("isinstance"), len(line)):
            depth += {"(": 1, ")": -1}.get(line[j], 0)
            if depth == 0:
                break
        if depth != 0:
            return None  # the call continues on the next line
        try:
            call = ast.parse(line[i:j + 1], mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(call, ast.Call) or len(call.args) != 2:
            return None
        expr = call.args[1]
        if not all(isinstance(n, (ast.Name, ast.Attribute, ast.Tuple, ast.Load)) for n in ast.walk(expr)):
            return None
        try:
            value = eval(compile(ast.Expression(expr), "<isinstance>", "eval"), frame.f_globals, dict(frame.f_locals))
        except Exception:  # noqa: BLE001 - unreadable: a hazard
            return None
        found += list(value) if isinstance(value, tuple) else [value]
        start = j + 1
    return found or None


def _answer_could_differ(proxy: fx.Proxy, frame: Any) -> bool:
    """Whether ``isinstance`` on ``proxy`` at ``frame``'s line could answer otherwise than on
    the value it stands for in eager (Note: [an isinstance hazard only where the answer could differ])."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    if "is_tensor" in line or "issubclass" in line:
        return True
    classes = _asked_classes(line, frame)
    if classes is None or not (_tensor_valued(proxy.node) or isinstance(proxy.node.meta.get(VALUE), torch.Tensor)):
        return True
    for c in classes:
        if not isinstance(c, type):
            return True
        if issubclass(torch.Tensor, c) != issubclass(type(proxy), c):
            return True
    return False


# Note: [is_tensor on a traced tensor is True]
# ``torch.is_tensor(t)`` / ``isinstance(t, torch.Tensor)`` on a proxy answers False under
# ``torch.fx`` and the trace records the non-tensor branch (diffusers' ``UNet2DModel`` wraps
# ``timestep`` in a new tensor). Where the proxy surely stands for a tensor, the question is
# answered as eager answers it: a value computed by the graph, or an input of a trace with the
# real inputs whose value is a tensor (the shape guard then holds every call to tensors there).
# An input traced symbolically may be anything (``timestep: Union[Tensor, float, int]``): still
# a hazard.


def _surely_a_tensor(node: fx.Node) -> bool:
    if isinstance(node.meta.get(VALUE), torch.Tensor):  # the real value, where a shape trace knows it
        return True
    return node.op not in ("placeholder", "get_attr") and _tensor_valued(node)


def _asks_tensor_only(frame: Any) -> bool:
    """Whether the ``isinstance`` / ``is_tensor`` on ``frame``'s line asks about ``torch.Tensor`` alone."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return _asked_classes(line, frame) == [torch.Tensor]



class FunctionCall:
    """``cls.apply(...)`` of a custom ``torch.autograd.Function`` as one call in a traced graph.

    Note: [autograd Functions stay whole]
    ``torch.fx`` would run a Function's ``forward`` on proxies and record its ops, losing its
    hand-written ``backward`` (a regulariser drawing a random factor in backward computed
    other gradients). While tracing (:func:`opaque_functions`), ``Function.apply`` on proxies
    records one node calling this object instead; at call time it runs ``cls.apply`` for
    real. Patching ``apply`` alone misses a reference bound before the trace
    (``self.shake = ShakeDrop.apply`` in ``__init__``, ``fn = MyFn.apply`` at module level):
    that bound method calls the unpatched ``apply``, which calls the class's ``forward``. So
    every loaded Function subclass's ``forward`` is wrapped too for the trace: on proxies it
    records the same one call (the arguments ``apply`` passed it, ``ctx`` left out).
    """

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.__name__ = f"{cls.__name__}_apply"  # how fx names the call in generated code
        self.__module__ = cls.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.cls.apply(*args, **kwargs)

    def __reduce__(self) -> Tuple[Any, ...]:
        return (FunctionCall, (self.cls,))


def _first_proxy(tree: Any) -> Optional[fx.Proxy]:
    return next((a for a in pytree.tree_leaves(tree) if isinstance(a, fx.Proxy)), None)


def _opaque_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        proxy = _first_proxy((args, kwargs))
        if proxy is None:
            return original(cls, *args, **kwargs)
        return proxy.tracer.create_proxy("call_function", FunctionCall(cls), args, kwargs)

    return apply


def _opaque_forward(cls: type, forward: Callable[..., Any], takes_ctx: bool) -> Callable[..., Any]:
    def opaque(*args: Any, **kwargs: Any) -> Any:
        given = args[1:] if takes_ctx else args  # what ``apply`` was called with
        proxy = _first_proxy((given, kwargs))
        if proxy is None:
            return forward(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", FunctionCall(cls), tuple(given), kwargs)

    return opaque


def _skip_setup(setup: Callable[..., Any]) -> Callable[..., Any]:
    def setup_context(ctx: Any, inputs: Any, output: Any) -> Any:
        if _first_proxy((inputs, output)) is not None:  # the call was recorded whole: nothing to set up
            return None
        return setup(ctx, inputs, output)

    return setup_context


def _function_classes() -> List[type]:
    found: List[type] = []
    todo = list(torch.autograd.Function.__subclasses__())
    seen = set()
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        found.append(c)
        todo += c.__subclasses__()
    return found


@contextlib.contextmanager
def opaque_functions() -> Iterator[None]:
    """While tracing, every custom ``torch.autograd.Function`` called on proxies is recorded as
    one :class:`FunctionCall` (Note: [autograd Functions stay whole]); restored on exit."""
    base_setup = static_attr(SingleLevelFunction, "setup_context")
    apply = static_attr(torch.autograd.Function, "apply")
    with contextlib.ExitStack() as patches:  # Note: [tracing patches are the tracing thread's]
        patches.enter_context(scoped_attr(torch.autograd.Function, "apply",
                                                function_apply_wrapper(_opaque_apply(function_apply_impl(apply)))))
        for cls in _function_classes():
            fwd = static_attr(cls, "forward")
            if not isinstance(fwd, staticmethod):  # legacy (instance-method) Functions: left as they are
                continue
            setup = static_attr(cls, "setup_context")
            takes_ctx = setup is base_setup  # no setup_context: forward(ctx, *args)
            try:
                for name, new in (("forward", _opaque_forward(cls, fwd.__func__, takes_ctx)),
                                  ("setup_context", None if takes_ctx or not isinstance(setup, staticmethod)
                                   else _skip_setup(setup.__func__))):
                    if new is not None:
                        patches.enter_context(scoped_attr(cls, name, staticmethod(new)))
            except (TypeError, AttributeError):  # an immutable class: left as it is
                continue
        yield


