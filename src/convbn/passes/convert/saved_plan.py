"""What ``convert`` decided with ``example_inputs``, as a value a checkpoint can carry.

Note: [a conversion made once]
With ``example_inputs``, most of ``convert``'s time is spent running the model: the check (one
training step eager, one converted) and the planner's measurements (one recorded step of
each). What they decide depends on the model's structure, its tensors' shapes and dtypes, the
inputs' shapes and dtypes and convert's options, never on the values of the weights: which
modules' rewrites matched eager (and so which were converted part by part), each chain's plan
(what each layer keeps, whether backward may drop, whether it runs as eager modules) and the
report's measured figures. :class:`ConvertPlan` holds exactly that, with a fingerprint of what
it depends on (:func:`plan_key`). ``convert(model, example_inputs=x, plan=p)`` with a ``p`` whose
fingerprint matches traces, matches and rewrites as always (cheap, and the result is the
user's own model objects), then takes each check's result and each chain's plan from ``p``
instead of running the model: the same conversion, without its steps. A fingerprint that does
not match is a warning saying so, and a conversion from scratch.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..._compat import pytree
from ...autograd.chain_plan import ChainPlan, LazyPlan
from ...nn.chain import FusedChain

__all__ = ["ConvertPlan", "plan_key", "chain_plans", "FIGURES", "as_plan", "figures_of", "plan_value", "replace_figures",
           "restore_shapes"]

#: the report's figures a plan carries (measured with ``example_inputs``)
FIGURES = ("eager_saved_bytes", "saved_bytes", "floor_saved_bytes", "target_saved_bytes", "predicted_peak_bytes",
           "predicted_peak_where", "eager_peak_bytes", "target_peak_bytes", "lowest_peak_bytes", "eager_fallback")

#: one layer's shapes as the example inputs gave them: (input shape, conv output shape, its dtype's name)
PlainShapes = Tuple[Optional[Tuple[int, ...]], Optional[Tuple[int, ...]], Optional[str]]
#: one chain's plan as plain values: (keep per layer, may_drop per layer, eager reason, shapes per layer
#: for the report's figures); ``None``: a chain the example inputs did not reach, planned on its own first call
PlainChain = Optional[Tuple[Tuple[bool, ...], Tuple[bool, ...], str, Tuple[PlainShapes, ...]]]


@dataclass(frozen=True)
class ConvertPlan:
    """What :func:`convbn.convert` decided with ``example_inputs``: which parts matched eager in
    its check, each chain's plan and the report's figures. They depend on the model's structure,
    its tensors' shapes and dtypes, the inputs' shapes and dtypes and the options, not on the
    weights' values; pass the plan back as ``convert(..., plan=...)`` to convert the same model
    again (after a resume from a checkpoint) without running it.

    Attributes:
        key: the fingerprint of what the decisions depend on (:func:`plan_key`).
        checks: ``(module name, why it differs)`` for every check run, in order (``""`` as the name:
            the model; ``""`` as the reason: it matched).
        chains: each chain's plan, in the converted model's order of chains.
        figures: the report's measured figures (:data:`FIGURES`).
        modes: ``(digest, answer)``: whether each traced module's graph depends on its mode
            (``train()`` / ``eval()``), by a digest of its class and its graph's code, so that
            converting again does not trace each module a second time to ask.

    Example:
        >>> fast = convbn.convert(net, example_inputs=x)                          # doctest: +SKIP
        >>> torch.save({"model": fast.state_dict(), "convbn_plan": fast.convbn_report.plan.as_dict()}, path)
        >>> again = convbn.convert(net, example_inputs=x, plan=torch.load(path)["convbn_plan"])  # no steps run
    """

    key: str
    checks: Tuple[Tuple[str, str], ...]
    chains: Tuple[PlainChain, ...]
    figures: Tuple[Tuple[str, Any], ...]
    modes: Tuple[Tuple[str, bool], ...] = ()

    def as_dict(self) -> Dict[str, Any]:
        """Plain values only (strings, numbers, booleans, lists, ``None``): for a checkpoint or a JSON file."""
        return {"format": "convbn.ConvertPlan/1", "key": self.key, "checks": [list(c) for c in self.checks],
                "chains": [None if c is None else [list(c[0]), list(c[1]), c[2], [_plain_shapes(l) for l in c[3]]]
                           for c in self.chains],
                "figures": [list(f) for f in self.figures], "modes": [list(m) for m in self.modes]}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> "ConvertPlan":
        """The plan :meth:`as_dict` wrote.

        Raises:
            ValueError: ``value`` is not such a dict.
        """
        if not isinstance(value, Mapping) or value.get("format") != "convbn.ConvertPlan/1":
            got = f"a dict with format={value.get('format')!r}" if isinstance(value, Mapping) else type(value).__name__
            raise ValueError(f"plan must be a convbn.ConvertPlan or the dict its as_dict() gives, but got {got}")
        return cls(str(value["key"]), tuple((str(n), str(why)) for n, why in value["checks"]),
                   tuple(None if c is None else (tuple(map(bool, c[0])), tuple(map(bool, c[1])), str(c[2]),
                                                 tuple(_read_shapes(l) for l in c[3])) for c in value["chains"]),
                   tuple((str(k), v) for k, v in value["figures"]),
                   tuple((str(k), bool(v)) for k, v in value.get("modes", ())))

    def check(self, name: str) -> Optional[str]:
        """Why the check of module ``name`` found a difference (``""``: it matched), or ``None``
        where it was not run."""
        return dict(self.checks).get(name)


def as_plan(value: Any) -> ConvertPlan:
    """``value`` as a :class:`ConvertPlan` (itself, or from its :meth:`~ConvertPlan.as_dict`).

    Raises:
        TypeError: neither.
    """
    if isinstance(value, ConvertPlan):
        return value
    if isinstance(value, Mapping):
        return ConvertPlan.from_dict(value)
    raise TypeError(f"plan must be a convbn.ConvertPlan (a converted model's convbn_report.plan) or the dict its "
                    f"as_dict() gives, but got {type(value).__name__}")


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"T{tuple(value.shape)}:{value.dtype}:{value.device.type}:{int(value.requires_grad)}"
    if isinstance(value, (int, float, bool, str, type(None))):
        return repr(value)
    return type(value).__qualname__


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """A digest of convbn's own source files: a plan made by other code is not reused."""
    root = pathlib.Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def plan_key(model: nn.Module, inputs: Tuple[Any, ...], options: Mapping[str, Any]) -> str:
    """The fingerprint a :class:`ConvertPlan` is valid for: every module's name, class and mode,
    every parameter's and buffer's name, shape, dtype, device and ``requires_grad``, the inputs'
    structure, shapes, dtypes and devices, convert's options, the torch version and convbn's own code."""
    parts: List[str] = [f"torch={torch.__version__}", f"convbn={_code_fingerprint()}"]
    parts += [f"{k}={options[k]!r}" for k in sorted(options)]
    parts += [f"m:{n}:{type(m).__module__}.{type(m).__qualname__}:{int(m.training)}" for n, m in model.named_modules()]
    parts += [f"p:{n}:{_describe(p)}" for n, p in model.named_parameters()]
    parts += [f"b:{n}:{_describe(b)}" for n, b in model.named_buffers()]
    leaves, spec = pytree.tree_flatten(inputs)
    parts += [f"i:{spec}"] + [f"i:{_describe(v)}" for v in leaves]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _plain_shapes(shapes: PlainShapes) -> List[Any]:
    return [None if s is None else list(s) for s in shapes[:2]] + [shapes[2]]


def _read_shapes(value: Sequence[Any]) -> PlainShapes:
    def shape(s: Any) -> Optional[Tuple[int, ...]]:
        return None if s is None else tuple(int(d) for d in s)

    return shape(value[0]), shape(value[1]), None if value[2] is None else str(value[2])


def chain_plans(chains: Sequence[FusedChain]) -> Tuple[PlainChain, ...]:
    """Each chain's plan as plain values (``None`` for one still planned on its first call)."""
    def shapes(c: FusedChain) -> Tuple[PlainShapes, ...]:
        return tuple((l.x_shape, l.y_shape, None if l.y_dtype is None else str(l.y_dtype).replace("torch.", ""))
                     for l in c.layers)

    return tuple(None if isinstance(c.plan, LazyPlan) else (tuple(c.plan.keep), tuple(c.plan.may_drop),
                                                             c.plan.eager_reason, shapes(c)) for c in chains)


def restore_shapes(chain: FusedChain, plain: PlainChain) -> None:
    """Give ``chain``'s layers the shapes the example inputs gave them (what the report's kept
    bytes and MACs read), as the run that made the plan recorded them."""
    if plain is None:
        return
    for l, (x, y, dtype) in zip(chain.layers, plain[3]):
        l.x_shape, l.y_shape = x, y
        l.y_dtype = None if dtype is None else getattr(torch, dtype)


def figures_of(report: Any) -> Tuple[Tuple[str, Any], ...]:
    """The report's :data:`FIGURES`."""
    return tuple((f, getattr(report, f)) for f in FIGURES)


def plan_value(plain: PlainChain) -> Optional[ChainPlan]:
    """The :class:`ChainPlan` of one plain chain plan (``None`` stays ``None``)."""
    return None if plain is None else ChainPlan(plain[0], plain[1], plain[2])


def replace_figures(report: Any, figures: Sequence[Tuple[str, Any]]) -> None:
    """Set the report's figures from a plan."""
    known = {f.name for f in dataclasses.fields(report)}
    for name, value in figures:
        if name in known:
            setattr(report, name, value)
