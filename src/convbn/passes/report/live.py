"""What runs now: each fused chain's state read off the live model, for the report and
:func:`convbn.fused_modules`.

Note: [a report says what runs]
What :func:`convbn.convert` decided and what runs can part: a first-call or first-backward
check that fails sends the rewritten module back to its own forward
(``GraphForward.fallback``), the "never above eager" last resort runs a chain's layers as
eager modules (``FusedChain.eager``), a mode-dependent trace runs the module's own forward
in the other train/eval mode, and hooks registered after conversion make a chain call its
modules. The report's per-BatchNorm outcomes and ``fused_modules`` are therefore computed
from that state each time they are read, never copied once.
"""
from __future__ import annotations

import functools
from typing import Dict, Iterator, List, Optional, Tuple

from torch import nn

from ...nn.chain import FusedChain
from ...nn.fused_conv_bn import hooks_of
from ..graph.graph_module import GraphForward, installed

__all__ = ["chain_status", "running_fused_modules", "all_chains", "unchecked_chains", "awaiting_capture", "FUSED", "CHECK_PENDING"]

#: the status of a chain whose fused Function runs
FUSED = "fused"
#: the status of a fused chain whose rewrite has not met its first-call check yet
CHECK_PENDING = "fused, first call not checked yet"


def _status(fwd: Optional[GraphForward], chain: FusedChain) -> str:
    if fwd is not None and fwd.fallback:
        why = getattr(fwd, "fallback_reason", "") or "the rewrite's check failed"
        return f"fallback: {why}; the module's own (unfused) forward runs"
    if fwd is not None and fwd.bypassed:
        return f"fallback: {fwd.bypassed}"
    if fwd is not None and getattr(fwd, "off_call", ""):
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


def _owned_chains(model: nn.Module) -> Iterator[Tuple[str, FusedChain, Optional[GraphForward]]]:
    seen = set()
    for prefix, m in model.named_modules():
        fwd = installed(m)
        if isinstance(m, FusedChain) and id(m) not in seen:  # registered (a replaced container child)
            seen.add(id(m))
            yield prefix, m, None
        if fwd is None:
            continue
        for target in fwd.added:
            chain = functools.reduce(getattr, target.split("."), m)
            if isinstance(chain, FusedChain) and id(chain) not in seen:
                seen.add(id(chain))
                yield (f"{prefix}.{target}" if prefix else target), chain, fwd


def chain_status(model: nn.Module) -> Dict[int, str]:
    """``id(chain) -> status`` for every fused chain of ``model``: ``"fused"`` while its fused
    Function runs, else ``"fallback: <why>"`` (Note: [a report says what runs])."""
    return {id(chain): _status(fwd, chain) for _, chain, fwd in _owned_chains(model)}


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
    for name, chain, fwd in _owned_chains(model):
        if _status(fwd, chain) == FUSED:
            yield name, chain


def all_chains(model: nn.Module) -> List[FusedChain]:
    """Every fused chain of ``model``, running fused or not."""
    return [chain for _, chain, _ in _owned_chains(model)]
