"""The planner's keep flags made into each chain's plan value, and applied.

The planner (:mod:`convbn.passes.plan.planner`) is pure: numbers in, keep flags out.
:func:`chain_plan` is the one place a chain's flags become its
:class:`~convbn.autograd.chain_plan.ChainPlan` (``convert`` with ``example_inputs``,
``max_batch``, and the plan a chain makes on its first call without them alike), and
``FusedChain.apply_plan`` the one place a chain takes it.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

from ...autograd.chain_plan import ChainPlan, LazyPlan
from ...nn.chain import ChainLayer, FusedChain
from .planner import plan_on_first_call

__all__ = ["chain_plan", "lazy_plan", "apply_plan", "recompute_all", "decide_on_first_call"]


def chain_plan(keeps: Sequence[bool], may_drop: Union[bool, Sequence[bool]] = True) -> ChainPlan:
    """The plan of one chain from the planner's flags.

    Args:
        keeps: per layer, ``True`` where it keeps its conv output (``recompute_bn``).
        may_drop: for the whole chain, or per layer: whether backward may drop and rebuild
            inputs (Note: [drops only where the step peaks] in peak_model.py).

    Returns:
        The chain's :class:`ChainPlan`.

    Example:
        >>> chain_plan([True, False], may_drop=False).modes
        ('recompute_bn', 'recompute_conv')
    """
    keep = tuple(bool(k) for k in keeps)
    drops = (bool(may_drop),) * len(keep) if isinstance(may_drop, bool) else tuple(bool(d) for d in may_drop)
    return ChainPlan(keep, drops)


def decide_on_first_call(layers: Sequence[ChainLayer]) -> ChainPlan:
    """The plan a chain converted without ``example_inputs`` makes on its first training call
    (:func:`plan_on_first_call` on the shapes its layers recorded; their ``may_drop`` kept)."""
    return chain_plan(plan_on_first_call(layers), [l.may_drop for l in layers])


def lazy_plan(chain: FusedChain, guard: Optional[Callable[[FusedChain, Sequence], str]] = None) -> LazyPlan:
    """``chain``'s plan, made on its first training call (every layer keeps its conv output
    until then); ``guard``: Note: [never above eager, without example inputs] in first_call_peak.py."""
    until = ChainPlan((True,) * len(chain.layers), tuple(chain.plan.may_drop))
    return LazyPlan(until, decide_on_first_call, guard)


def recompute_all(chain: FusedChain) -> ChainPlan:
    """``chain``'s plan with every layer recomputing its convolution (what the planner's
    measurements run; its ``may_drop`` flags and eager fallback kept)."""
    plan = chain.plan
    return ChainPlan((False,) * len(chain.layers), tuple(plan.may_drop), plan.eager_reason)


def apply_plan(chains: Sequence[FusedChain], keeps: Sequence[Sequence[bool]], may_drop: Sequence[bool]) -> None:
    """Give each of ``chains`` (forward order) its plan: a keep flag per layer, ``may_drop`` per
    chain (a chain running as eager modules keeps doing so)."""
    for c, kp, md in zip(chains, keeps, may_drop):
        plan = chain_plan(kp, md)
        c.apply_plan(plan.running_eager(c.eager_reason) if c.eager else plan)
