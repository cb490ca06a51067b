"""What runs now: each fused chain's state read off the live model, for the report and
:func:`convbn.fused_modules`.

Note: [a report says what runs]
What :func:`convbn.convert` decided and what runs can part: a first-call or first-backward
check that fails sends the rewritten module back to its own forward
(``GraphForward.fallback``), the "never above eager" last resort runs a chain's layers as
eager modules (``FusedChain.eager``), a mode-dependent trace runs the module's own forward
in the other train/eval mode, and hooks registered after conversion make a chain call its
modules. The report's per-BatchNorm outcomes and ``fused_modules`` are therefore computed
from that state each time they are read, never copied once. A module called in more than one
way runs a capture per kind of call; what those calls ran is read from their counts
(Note: [a report says what ran, call by call] in calls_seen.py).
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple

from torch import nn

from ...nn.chain import FusedChain
from ...nn.chain_layer import ChainLayer
from ...nn.fused_conv_bn import hooks_of
from ..graph.graph_module import GraphForward, installed
from .calls_seen import calls_seen, route_label

__all__ = ["chain_status", "layer_status", "variant_only_status", "PARTLY", "running_fused_modules", "all_chains",
           "unchecked_chains", "awaiting_capture", "FUSED", "CHECK_PENDING"]

#: the status of a chain whose fused Function runs
FUSED = "fused"
#: the start of the status of a layer fused in some kinds of call and not in others (Note: [a
#: report says what ran, call by call] in calls_seen.py)
PARTLY = "fused in some calls"
_FALLBACK = "fallback: "
#: the status of a fused chain whose rewrite has not met its first-call check yet
CHECK_PENDING = "fused, first call not checked yet"


def _status(fwd: Optional[GraphForward], chain: FusedChain, main: Optional[GraphForward] = None) -> str:
    """``chain``'s status; ``main``: its module's installed forward, whose counted calls since the
    last read say whether ``fwd`` (the first capture's or a variant's) ran at all (Note: [a report
    says what ran, call by call] in calls_seen.py)."""
    seen = calls_seen(main) if main is not None else None
    own = seen is not None and set(seen) == {None}  # only its own forward ran: its last call says why
    if seen is not None and fwd not in seen and not (own and fwd is main):
        ran = ", ".join(route_label(r, main) for r in seen)
        return f"fallback: not called since the report was last read (the module's calls were {ran})"
    return _state_status(fwd, chain, last_call=seen is None or own)


def _state_status(fwd: Optional[GraphForward], chain: FusedChain, last_call: bool = True) -> str:
    """``chain``'s status from the state of its forward and its modules; ``last_call``: whether a
    last call off the captured ones (``off_call``) decides it (not where the calls are counted)."""
    if fwd is not None and fwd.fallback:
        why = getattr(fwd, "fallback_reason", "") or "the rewrite's check failed"
        return f"fallback: {why}; the module's own (unfused) forward runs"
    if fwd is not None and fwd.bypassed:
        return f"fallback: {fwd.bypassed}"
    if last_call and fwd is not None and getattr(fwd, "off_call", ""):
        return (f"fallback: its last call ({fwd.off_call}) was unlike the captured ones and ran the module's own "
                "(unfused) forward")
    if fwd is not None and fwd.modes is not None and any(m.training != t for m, t in fwd.modes):
        return ("fallback: the rewrite was traced in the other train/eval mode and differs in this one; the "
                "module's own (unfused) forward runs")
    if fwd is not None and fwd.inlined and any(hooks_of(m) for m in fwd.inlined):
        return ("fallback: hooks registered after conversion on a module the rewrite inlined; the module's own "
                "(unfused) forward runs")
    if chain.eager:
        return f"fallback: {getattr(chain, 'eager_reason', '') or 'its layers run as eager modules'}"
    if chain._hooked():
        return "fallback: hooks registered after conversion on its modules; its layers run as eager modules"
    return FUSED


def _chains_of(module: nn.Module, fwd: GraphForward) -> Iterator[Tuple[str, FusedChain]]:
    """``(target, chain)`` for each chain ``fwd``'s graph calls (a module's first capture lists
    its variants' chains too: those are the variants' own)."""
    for target in fwd.added:
        chain = functools.reduce(getattr, target.split("."), module)
        if isinstance(chain, FusedChain):
            yield target, chain


def _owned_chains(model: nn.Module) -> Iterator[Tuple[str, FusedChain, Optional[GraphForward], Optional[GraphForward]]]:
    """``(qualified name, chain, the forward calling it, its module's installed forward)``."""
    seen = set()
    for prefix, m in model.named_modules():
        fwd = installed(m)
        if isinstance(m, FusedChain) and id(m) not in seen:  # registered (a replaced container child)
            seen.add(id(m))
            yield prefix, m, None, None
        if fwd is None:
            continue
        caller = {t: v for v in _variant_forwards(fwd) for t in v.added}
        for target, chain in _chains_of(m, fwd):
            if id(chain) not in seen:
                seen.add(id(chain))
                yield (f"{prefix}.{target}" if prefix else target), chain, caller.get(target, fwd), fwd


def _variant_forwards(fwd: GraphForward) -> List[GraphForward]:
    return list(fwd.variants.forwards()) if fwd.variants is not None else []


def layer_status(model: nn.Module) -> Dict[int, str]:
    """``id(layer) -> status`` for each layer of a module's first capture whose calls since the
    report last read them ran something else too (a variant, the module's own forward): what
    ran, kind of call by kind of call (Note: [a report says what ran, call by call] in calls_seen.py).
    ``"fused"`` where every kind fused it, ``"fallback: ..."`` where none did, else
    ``"fused in some calls: ..."``."""
    found: Dict[int, str] = {}
    for _, m in model.named_modules():
        main = installed(m)
        if main is None or main.variants is None:
            continue
        seen = calls_seen(main)
        if not seen or set(seen) in ({main}, {None}):
            continue  # nothing counted, or every call ran one thing: the chain's own status says it
        theirs = {t for v in _variant_forwards(main) for t in v.added}
        for target, chain in _chains_of(m, main):
            if target in theirs:
                continue
            for layer in chain.layers:
                parts = [(route_label(r, main), _route_status(m, main, r, chain, layer)) for r in seen]
                found[id(layer)] = _combine(parts)
    return found


def variant_only_status(model: nn.Module) -> Dict[str, Tuple[str, Any]]:
    """``norm name -> (status, the variant's fused outcome)`` for each norm a module's first
    capture does not fuse but a variant that ran since the last read does: what each kind of call
    ran (Note: [a report says what ran, call by call] in calls_seen.py)."""
    found: Dict[str, Tuple[str, Any]] = {}
    for _, m in model.named_modules():
        main = installed(m)
        seen = calls_seen(main) if main is not None and main.variants is not None else None
        if not seen or set(seen) in ({main}, {None}):
            continue
        variants = [r for r in seen if r is not None and r is not main]
        theirs = {t for v in _variant_forwards(main) for t in v.added}
        first = {l.names[1] for t, c in _chains_of(m, main) if t not in theirs for l in c.layers}
        for variant in variants:
            for layer in (l for _, c in _chains_of(m, variant) for l in c.layers):
                norm = layer.names[1]
                if not norm or norm in first or norm in found:
                    continue
                parts = [(route_label(r, main), "fallback: the first capture does not fuse it" if r is main else
                          _route_status(m, main, r, None, layer)) for r in seen]
                fused = next((o for o in variant.variant_outcomes or () if o.batchnorm == norm and not o.left), None)
                found[norm] = (_combine(parts), fused)
    return found


def _route_status(module: nn.Module, main: GraphForward, route: Optional[GraphForward],
                  chain: Optional[FusedChain], layer: ChainLayer) -> str:
    """What the calls that ran ``route`` did with ``layer`` (of ``main``'s ``chain``, or a variant's)."""
    if route is main and chain is not None:
        return _state_status(main, chain, last_call=False)
    if route is None:
        return "fallback: the module's own (unfused) forward ran"
    for _, theirs in _chains_of(module, route):
        if any(_same_layer(other, layer) for other in theirs.layers):
            return _state_status(route, theirs, last_call=False)
    norm = layer.names[1]
    why = next((o.reason for o in route.variant_outcomes or () if norm and o.batchnorm == norm and o.left), "")
    why = f" ({why})" if why else ""
    return f"fallback: the capture for these calls does not fuse it{why}; it runs as modules"


def _same_layer(a: ChainLayer, b: ChainLayer) -> bool:
    """The same norm (or, for a chain's end, the same convolution), by qualified name."""
    return a.names[1] == b.names[1] if b.names[1] else a.names[0] == b.names[0]


def _combine(parts: List[Tuple[str, str]]) -> str:
    """One status from ``(kind of call, status)`` pairs."""
    fused = [label for label, status in parts if status == FUSED]
    other = [f"in {label}: {status[len(_FALLBACK):] if status.startswith(_FALLBACK) else status}"
             for label, status in parts if status != FUSED]
    if not other:
        return FUSED
    if not fused:
        return _FALLBACK + "; ".join(other)
    return f"{PARTLY}: fused in {', '.join(fused)}; " + "; ".join(other)


def chain_status(model: nn.Module) -> Dict[int, str]:
    """``id(chain) -> status`` for every fused chain of ``model``: ``"fused"`` while its fused
    Function runs, else ``"fallback: <why>"`` (Note: [a report says what runs])."""
    return {id(chain): _status(fwd, chain, main) for _, chain, fwd, main in _owned_chains(model)}


def unchecked_chains(model: nn.Module) -> Dict[int, str]:
    """``id(chain) -> qualified name of the rewritten module`` for every chain of ``model`` whose
    rewrite's first-call check has not run yet (converted without ``example_inputs``): it runs
    fused only if that call agrees with the original (Note: [a report says what runs])."""
    found: Dict[int, str] = {}
    for prefix, m in model.named_modules():
        fwd = installed(m)
        if fwd is None or fwd.pending is None:
            continue
        for target in fwd.added:
            found[id(functools.reduce(getattr, target.split("."), m))] = prefix
    return found


def awaiting_capture(model: nn.Module) -> List[str]:
    """Qualified names of the modules of ``model`` converted on their first call (code on
    shapes, no ``example_inputs``: ``convert/first_call_capture.py``) that have not been called
    yet: the BatchNorms under them are listed as left until then."""
    return [n for n, m in model.named_modules()
            if getattr(m.__dict__.get("forward"), "captures_on_first_call", False)]


def running_fused_modules(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every fused chain of ``model`` that runs fused now (a
    chain of a module that fell back to its own forward, or run as eager modules, is not
    listed; its report's outcomes say why).

    Example:
        >>> fast = convbn.convert(net)                      # doctest: +SKIP
        >>> [n for n, _ in convbn.fused_modules(fast)]      # doctest: +SKIP
        ['convbn_chain0']
    """
    for name, chain, fwd, main in _owned_chains(model):
        if _status(fwd, chain, main) == FUSED:
            yield name, chain


def all_chains(model: nn.Module) -> List[FusedChain]:
    """Every fused chain of ``model``, running fused or not."""
    return [chain for _, chain, _, _ in _owned_chains(model)]
