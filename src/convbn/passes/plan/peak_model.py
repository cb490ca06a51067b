"""Predicting a training step's peak memory under a plan, from plain numbers per chain.

:class:`ChainCost` is what the peak planner knows of one chain; :func:`chain_backward_peak`
replays the chain's backward on buffer sizes, :func:`step_peak` the whole step, and
:func:`drops_needed` says which chains must drop and rebuild inputs for that peak.
Pure: numbers in, numbers and flags out (:mod:`convbn.passes.plan.peak_planner` searches
the plans with them).

# Note: [predicting the peak of a step]
# A step's live memory peaks either at the end of forward (everything saved) or inside
# some chain's backward: the bytes saved *before* that chain (still alive) plus the
# chain's own transient. :func:`chain_backward_peak` replays the chain's backward order
# (autograd/chain.py, Note: [chain backward order]) on buffer sizes only: kept and
# recomputed conv outputs, rebuilt inputs, the incoming gradient, grad_y and grad_x.
# The chain's own parameter gradients are made by its conv backwards and held until the
# Function returns them (``ChainCost.w_bytes``: on ResNet-50's last stage they outweigh
# the activations). Everything else alive beside a chain (activations saved before it,
# gradients of the layers after it, whatever autograd holds for the ops around it) is
# the same for every plan: ``convert`` measures it once (``ChainCost.prefix``), from a
# recorded step of the all-recompute plan, as that step's peak inside the chain minus the
# replayed transient. Parameters themselves (alive before the step) are left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from ...autograd.chain_memory import choose_drops, replay
from ...autograd.norm_chain_memory import norm_conv_runs, norm_replay

__all__ = ["ChainCost", "chain_backward_peak", "step_peak", "drops_needed", "gaps_of"]


@dataclass(frozen=True)
class ChainCost:
    """What the peak planner knows of one chain (all plain numbers: the planner is pure).

    Attributes:
        y_bytes: bytes of each layer's conv output.
        x_bytes: bytes of each layer's conv input (``x_bytes[0]`` is the chain input, always kept).
        macs: each layer's cost of recomputing its conv when ``y`` is not kept, in MAC
            equivalents (``ChainLayer.recompute_cost``; plain MACs work too).
        acts: each layer's activation kind: ``"identity"``, ``"output"`` (derivative from the
            output: the ReLU family) or ``"smooth"``.
        prefix: bytes alive besides the chain during its backward that no plan changes:
            activations saved before it (every earlier chain keeping nothing) and the
            gradients of the parameters used after it.
        s_bytes: each layer's saved BatchNorm statistics (mean, inverse std), freed after
            its BN backward (empty: not counted).
        w_bytes: each layer's parameter-gradient bytes, made during the chain's backward
            and held until it returns (empty: not counted).
        head: layer 0 has no conv: its BN input (``y_bytes[0]``) is the chain input, always
            kept and in the floor; it recomputes nothing.
        end: the last layer has no BN: without a tail (kind ``"identity"``) it keeps nothing
            whatever its flag.
        forward: a per-sample-norm chain's moments in its own forward, per layer: the most
            bytes in use (the recorded all-recompute step's, the chains before it keeping
            nothing) while that layer ran (0: none recorded; empty: not measured, such moments
            are among the ``gaps`` of :func:`step_peak`). Note: [a moment inside a chain's forward].
        norms: a per-sample-norm chain's norms, each layer's row of the norm table
            (``""``: none); empty for a BatchNorm chain. Its backward is replayed as
            :class:`~convbn.autograd.norm_chain.NormChainFunction` runs it
            (:func:`~convbn.autograd.norm_chain_memory.norm_replay`), not as a BatchNorm chain's.
    """

    y_bytes: Tuple[int, ...]
    x_bytes: Tuple[int, ...]
    macs: Tuple[int, ...]
    acts: Tuple[str, ...]
    prefix: int = 0
    w_bytes: Tuple[int, ...] = ()
    head: bool = False
    end: bool = False
    s_bytes: Tuple[int, ...] = ()
    norms: Tuple[str, ...] = ()
    forward: Tuple[int, ...] = ()

    def kept_bytes(self, keep: Sequence[bool]) -> int:
        """Bytes the chain keeps above the floor under ``keep``."""
        return sum(self._kept(i, f) for i, f in enumerate(keep))

    def _kept(self, i: int, f: bool) -> int:
        k = len(self.y_bytes)
        return self.y_bytes[i] if f and not (self.head and i == 0) and not (
            self.end and i == k - 1 and self.acts[i] == "identity") else 0

    def forward_peak(self, keep: Sequence[bool]) -> int:
        """The most bytes in use during the chain's own forward under ``keep`` (0 where
        ``forward`` is not measured): Note: [a moment inside a chain's forward]."""
        out, kept = 0, 0
        for i, b in enumerate(self.forward):
            if b:
                out = max(out, b + kept)
            kept += self._kept(i, keep[i])
        return out

    def recompute(self, keep: Sequence[bool]) -> int:
        """Recompute cost under ``keep``: ``macs`` of the layers not keeping their conv output,
        each as many times as the chain's backward runs that conv again (a per-sample-norm
        chain: :func:`~convbn.autograd.norm_chain_memory.norm_conv_runs`; a BatchNorm chain: once)."""
        if self.norms:
            runs = norm_conv_runs(keep, self.acts, self.norms, self.head)
            return sum(m * r for m, r in zip(self.macs, runs))
        return sum(m for m, f in zip(self.macs, keep) if not f)


def chain_backward_peak(cost: ChainCost, keep: Sequence[bool], may_drop: Union[bool, Sequence[bool]] = True
                        ) -> Tuple[int, int]:
    """Peak bytes during the chain's backward under ``keep`` (Note: [predicting the peak of a
    step]): :func:`convbn.autograd.chain_memory.replay` with the drops the backward itself
    chooses. Counts the kept conv outputs, the incoming gradient, every buffer the
    backward creates and the chain's parameter gradients (``cost.w_bytes``); not the chain
    input, not the parameters themselves. ``may_drop``: for the chain, or (a per-sample-norm
    chain) per layer.

    Returns:
        ``(peak_bytes, layer)``: the peak and the layer whose backward reaches it.
    """
    if cost.norms:  # a per-sample-norm chain: its own backward order and drops (Note: [a norm before
        # a dropped conv recomputed once] in autograd/norm_chain.py)
        return norm_replay(cost.y_bytes, cost.x_bytes, keep, cost.acts, cost.norms, cost.w_bytes or None,
                           cost.head, cost.end, cost.s_bytes or None,
                           drops=[may_drop] * len(keep) if isinstance(may_drop, bool) else list(may_drop))
    # the drops the backward itself chooses (it does not count parameter gradients); none
    # where the chain may not drop (Note: [drops only where the step peaks])
    drop = choose_drops(cost.y_bytes, cost.x_bytes, keep, cost.acts, cost.head, cost.end) if may_drop \
        else [False] * len(keep)
    return replay(cost.y_bytes, cost.x_bytes, keep, cost.acts, drop, cost.w_bytes or None, cost.head, cost.end,
                  cost.s_bytes or None)


def step_peak(costs: Sequence[ChainCost], keeps: Sequence[Sequence[bool]], floor: int,
              _cache: Optional[dict] = None, may_drop: Optional[Sequence[bool]] = None,
              gaps: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """Predicted peak of a step's plan-dependent bytes: the end of forward
    (``floor`` + every kept conv output), a chain's backward (its prefix, the kept
    outputs of the chains before it, its own transient) or a moment outside every chain's
    backward (``gaps``, Note: [moments outside the chains]). Chains in forward order;
    ``may_drop`` per chain (default: every chain may drop, :func:`drops_needed`).

    Returns:
        ``(peak_bytes, where)``: ``where`` is ``-1`` for the end of forward, ``-2`` for a
        moment outside the chains' backwards (``gaps``), else the chain index.
    """
    kept = [c.kept_bytes(kp) for c, kp in zip(costs, keeps)]
    best, where = floor + sum(kept), -1
    if gaps:
        outside = max(g + sum(kept[:m]) for m, g in enumerate(gaps))
        if outside > best:
            best, where = outside, -2
    before = 0
    for j, (c, kp) in enumerate(zip(costs, keeps)):
        inner = before + c.forward_peak(kp) if c.forward else 0
        if inner > best:
            best, where = inner, -2
        md = True if may_drop is None else bool(may_drop[j])
        key = (j, tuple(kp), md)
        own = _cache.get(key) if _cache is not None else None
        if own is None:
            own = chain_backward_peak(c, kp, md)[0]
            if _cache is not None:
                _cache[key] = own
        p = c.prefix + before + own
        if p > best:
            best, where = p, j
        before += kept[j]
    return best, where


def gaps_of(gaps: Optional[Sequence[int]], n: int) -> List[int]:
    """``gaps`` padded to one entry per number of chains (0 .. n) alive; 0 where unmeasured.

    # Note: [moments outside the chains]
    # A step's peak can fall outside every chain's backward: in another op's backward (a
    # max-pool's gradient is as large as its input) while the conv outputs kept by the
    # chains not yet differentiated are all alive, or in forward after some chains ran. At
    # such a moment t the bytes are those measured in the recorded all-recompute step
    # (``base_t``) plus what the plan keeps in the chains alive at t: in forward the chains
    # already run, in backward those not yet differentiated. Counting, conservatively, the
    # first ``m`` chains in forward order (``m`` one past the last chain alive at t), the
    # moments give ``gaps[m] = max base_t``, and a plan's peak is at least
    # ``gaps[m] + kept(chains 0 .. m-1)`` for every ``m``. In forward order that is one
    # more check per chain in the searches below; without it, a plan keeping much (on the
    # tutorial's MNIST network, every conv output) was predicted 54 MiB under the peak
    # measured in its max-pool backward.

    # Note: [a moment inside a chain's forward]
    # Counting every conv output a chain keeps at a moment inside that chain's own forward
    # over-counts: the outputs of its later layers do not exist yet. On the 3-D InstanceNorm
    # U-Net the decoder chain's forward was predicted at 30.5 MiB for a plan measured at
    # 27.0, which made the planner prefer a plan with more recompute. So a per-sample-norm
    # chain's forward moments are recorded per layer (``ChainCost.forward``, from the
    # operators of the recorded step: a layer starts at its convolution) and a plan's value
    # there is that moment's bytes plus the outputs it keeps of the chains before and of its
    # own layers before ``i``. Layer ``i``'s own output needs no count: while its norm runs
    # the recorded bytes hold it, and NormChainFunction's forward lets it go only before an
    # in-place activation, which allocates nothing (kept, the step holds then what it held
    # before); a tail keeps it bound into the next layer's convolution, in the recorded
    # bytes too. Never below what the step holds then, never above the gap it used to be.
    """
    out = [0] * (n + 1)
    for m, g in enumerate(gaps or ()):
        out[min(m, n)] = max(out[min(m, n)], g)
    return out


def drops_needed(costs: Sequence[ChainCost], keeps: Sequence[Sequence[bool]], floor: int,
                 gaps: Optional[Sequence[int]] = None) -> List[bool]:
    """Per chain, whether its backward must drop rebuilt inputs for the step to peak where
    :func:`step_peak` predicts: ``False`` where the chain's backward, with no drop at all,
    stays within that peak.

    # Note: [drops only where the step peaks]
    # A drop (autograd/chain.py, Note: [chain backward order]) lowers its chain's own peak at
    # the price of one more element-wise rebuild (on ResNet-50, batch 8, 224², 13 drops over
    # 40 MiB cost 0.9 % of a CPU step). The backward cannot tell whether its chain is where
    # the step peaks; the planner can: a chain whose backward without drops stays within the
    # step's predicted peak gets ``may_drop=False``. The step peak is unchanged by
    # construction (each chain's moment stays within the maximum; ``step_peak`` with these
    # flags equals it), and the plan's recompute too.

    Example:
        >>> a = ChainCost((4, 8), (1, 4), (10, 100), ("output", "output"), prefix=0)
        >>> drops_needed([a], [[False, False]], floor=0), drops_needed([a], [[False, False]], floor=100)
        ([True], [False])
    """
    total = step_peak(costs, keeps, floor, gaps=gaps)[0]
    need = []
    before = 0
    for c, kp in zip(costs, keeps):
        need.append(c.prefix + before + chain_backward_peak(c, kp, may_drop=False)[0] > total)
        before += c.kept_bytes(kp)
    return need
