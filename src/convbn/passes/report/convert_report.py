"""What :func:`convbn.convert` did: every pair fused (and how), and one
:class:`~convbn.passes.report.outcome.BNOutcome` per BatchNorm -- fused, or left and why."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ...functional.strategies import ConvertStrategy, LayerMode
from ...memory import format_bytes
from .live import (CHECK_PENDING, FUSED, PARTLY, all_chains, awaiting_capture, chain_status, layer_status, unchecked_chains,
                   variant_only_status)
from .outcome import BNOutcome

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ...nn.chain import ChainLayer

__all__ = ["FusedPair", "ConvertReport"]


@dataclass
class FusedPair:
    """One fused layer: Conv -> BN -> tail, fused into chain ``chain`` at ``position``.

    A pre-activation *head* (BN -> tail, reading the chain input) has ``conv == ""``; a
    chain's *end* (a convolution with no BN after it) has ``bn == ""``. ``activation`` is
    the tail as text (``"relu"``, ``"dropout(0.1) -> prelu"``, ``"identity"``).
    """

    conv: str
    bn: str
    activation: str
    chain: int
    position: int
    layer: "ChainLayer" = field(repr=False)

    @property
    def norm(self) -> str:
        """The per-sample norm's row of :data:`convbn.functional.norms.NORMS` (``"group_norm"``,
        ``"channel_rms_norm"`` ...); ``""`` for a BatchNorm or none (a chain end)."""
        call = getattr(self.layer.bn, "call", None)  # a NormView's NormCall; a BatchNorm has none
        return str(call().row) if callable(call) else ""

    @property
    def kind(self) -> str:
        """``"head"``, ``"end"`` or ``"layer"`` (an ordinary Conv -> BN -> tail)."""
        return "head" if self.layer.is_head else "end" if self.layer.is_end else "layer"

    @property
    def strategy(self) -> LayerMode:
        """What this layer keeps: ``"recompute_bn"`` or ``"recompute_conv"`` (the plan's choice under ``"auto"``)."""
        return self.layer.mode  # type: ignore[return-value]

    @property
    def status(self) -> str:
        """What runs now: ``"fused"``, ``"fused in some calls: ..."`` (a module called in several
        ways since the report was last read, fusing this layer in some and not in others: which
        ran what), ``"fused, plan pending"`` (converted without
        ``example_inputs``: the chain plans on its first training call, when its shapes are
        known; :attr:`strategy` until then is not a plan), ``"fused, first call not checked yet"``
        (converted without ``example_inputs``: it runs fused only if its module's first call
        agrees with the original) or ``"fallback: <why>"``."""
        report = self.__dict__.get("_report")
        if report is not None:
            report._pair_status()
        return self.__dict__.get("_status", FUSED)

    @property
    def kept_bytes(self) -> int:
        """Bytes this layer keeps for backward beyond the chain input (its conv output, if
        kept; a head and a bare end keep none)."""
        return self.layer.keep_bytes() if self.layer.mode == "recompute_bn" else 0

    @property
    def extra_flops(self) -> int:
        """Multiply-accumulates recomputed in backward (the conv, for ``recompute_conv``)."""
        return self.layer.flops() if self.layer.mode == "recompute_conv" else 0


@dataclass
class ConvertReport:
    """Result of :func:`convbn.convert` / :func:`convbn.explain`.

    Attributes:
        pairs: every fused layer: Conv -> BN (-> act), a pre-activation head, a chain's end;
            each with its :attr:`FusedPair.status` (what runs now).
        recorded: the outcomes as ``convert`` decided them (``outcomes`` is what runs now).
        outcomes: (read-only, computed when read from the model as it is now) one :class:`convbn.BNOutcome` per BatchNorm module or
            ``batch_norm`` call: ``"fused"`` (with the conv and whether it precedes the
            BatchNorm or follows it, as a pre-activation head's does) or ``"left"`` with the
            reason -- the same record :func:`convbn.fold`'s report lists.
        skipped: the outcomes ``"left"``, as a new list (record one with :meth:`leave`).
        untraced: ``(module, error)`` for modules that could not be traced whole.
        traced: modules traced whole (``""`` is the root).
        validated: modules whose rewrite was run against the original on ``example_inputs``
            (outputs, gradients, running statistics) and matched.
        strategy: the strategy asked for.
        eager_saved_bytes / saved_bytes / floor_saved_bytes / target_saved_bytes:
            measured (with ``example_inputs``) saved activation bytes -- bytes held for
            backward, parameters excluded -- of the eager model, of the converted model,
            of the lowest-memory plan, and the planner's target.
        predicted_peak_bytes / predicted_peak_where: the ``auto`` planner's prediction of
            the plan-dependent bytes alive at the step's peak (saved tensors plus a chain's
            backward transient; parameters' gradients and the loss excluded) and where.
        target_peak_bytes / lowest_peak_bytes: with ``peak_budget``, the predicted step peak
            asked for (``peak_budget`` times ``eager_peak_bytes``) and the lowest any plan
            reaches; the plan meets the target when ``predicted_peak_bytes <= target_peak_bytes``,
            else it is the lowest-peak plan.
        time_budget / step_costs / predicted_time_ratio: with ``time_budget``, the ratio asked
            for, the step costs measured for it (:class:`~convbn.passes.plan.time_planner.StepCosts`:
            eager's step, the converted step keeping every conv output, each conv's forward)
            and the chosen plan's predicted step time as a ratio of eager's.
        eager_fallback: the default plan's step was measured above eager's peak on
            ``example_inputs``, so the chains run as eager modules (the default plan never
            peaks above the model as it was).
        shared_pieces: for each tensor kept by several chains that start at a concatenation
            (a DenseNet's feature maps: every later layer of the block reads them), the number
            of chains keeping it; it is held once, whatever the count.
        measured_peak_bytes / measured_peak_where / eager_peak_bytes: from
            :func:`convbn.explain` with example inputs, one training step's measured peak
            (:func:`convbn.memory.timeline`) of the converted model, where it occurs, and
            the eager model's.
        lean_pools: max/average pooling calls that keep their indices instead of their input
            for backward: module names, or graph node names of functional calls.
        changes: what changed in the model after ``convert`` (a module replaced, an attribute
            set, a class swapped) and what runs since: the module captured again, or its own
            forward.
        planning_note: why ``strategy="auto"`` with ``example_inputs`` planned each chain on its
            first training call instead (the step could not be measured), or ``""``.
        variants: the variants captured after ``convert`` for calls unlike the first capture
            (another value of an optional argument, other input shapes), one line each:
            the module and what the variant was specialised on.
        plan: with ``example_inputs``, what this conversion decided (a :class:`convbn.ConvertPlan`:
            the checks' results, each chain's plan, the figures above), to pass back as
            ``convert(..., plan=...)`` after a resume: the same conversion without running the model.
        reused_plan: whether this conversion took its checks and plans from ``convert(plan=...)``.
    """

    pairs: List[FusedPair] = field(default_factory=list)
    recorded: List[BNOutcome] = field(default_factory=list)
    untraced: List[tuple] = field(default_factory=list)
    traced: List[str] = field(default_factory=list)
    validated: List[str] = field(default_factory=list)
    strategy: ConvertStrategy = "auto"
    eager_saved_bytes: Optional[int] = None
    saved_bytes: Optional[int] = None
    floor_saved_bytes: Optional[int] = None
    target_saved_bytes: Optional[int] = None
    predicted_peak_bytes: Optional[int] = None
    predicted_peak_where: Optional[str] = None
    measured_peak_bytes: Optional[int] = None
    measured_peak_where: Optional[str] = None
    eager_peak_bytes: Optional[int] = None
    target_peak_bytes: Optional[int] = None
    lowest_peak_bytes: Optional[int] = None
    eager_fallback: bool = False
    time_budget: Optional[float] = None
    step_costs: Optional[Any] = None  # a plan.time_planner.StepCosts (report sits below plan)
    predicted_time_ratio: Optional[float] = None
    shared_pieces: Dict[str, int] = field(default_factory=dict)
    lean_pools: List[str] = field(default_factory=list)
    changes: List[str] = field(default_factory=list)
    variants: List[str] = field(default_factory=list)
    plan: Optional[Any] = field(default=None, repr=False)
    reused_plan: bool = False
    planning_note: str = ""

    @property
    def outcomes(self) -> List[BNOutcome]:
        """One outcome per BatchNorm, as things run now: a BatchNorm ``convert`` fused whose
        chain does not run fused (a failed first-call or first-backward check, the "never
        above eager" last resort, the other train/eval mode of a mode-dependent trace, hooks
        added later) is ``"left"`` with the reason ``"fallback: <why>"``."""
        status = self._pair_status()
        model = self.__dict__.get("_model")
        theirs = variant_only_status(model) if model is not None else {}
        return [_as_running(o, status.get(o.batchnorm, FUSED)) if o.batchnorm not in theirs
                else _fused_by_variant(o, *theirs[o.batchnorm]) for o in self.recorded]

    def _pair_status(self) -> Dict[str, str]:
        """Per fused BatchNorm name, its chain's status; sets each pair's ``status``."""
        model = self.__dict__.get("_model")
        by_bn: Dict[str, str] = {}
        if model is None:
            return by_bn
        status = chain_status(model)
        by_call = layer_status(model)  # Note: [a report says what ran, call by call] in calls_seen.py
        unchecked = unchecked_chains(model)
        chain_of = {id(l): c for c in all_chains(model) for l in c.layers}
        for p in self.pairs:
            chain = chain_of.get(id(p.layer))
            now = status.get(id(chain), FUSED) if chain is not None else FUSED
            now = by_call.get(id(p.layer), now)
            if now == FUSED and chain is not None and chain.plan_on_first_call is not None:
                now = "fused, plan pending"
            elif now == FUSED and chain is not None and id(chain) in unchecked:
                now = CHECK_PENDING  # runs fused only if its first call agrees with the original
            elif now == FUSED and chain is not None and (caveat := chain.compile_caveat()):
                now = f"{_CAVEAT}{caveat}"
            p.__dict__["_status"] = now
            p.__dict__["_unchecked"] = chain is not None and id(chain) in unchecked and now.startswith(FUSED)
            if p.bn:
                by_bn[p.bn] = FUSED if now.startswith(FUSED) and not now.startswith((PARTLY, _CAVEAT)) else now
        return by_bn

    def attach(self, model: "nn.Module") -> None:
        """Read the live state of ``model`` (the converted model) from now on."""
        self.__dict__["_model"] = model
        for p in self.pairs:
            p.__dict__["_report"] = self

    @property
    def skipped(self) -> List[BNOutcome]:
        """Every BatchNorm left as it was, with its reason (``.bn``, ``.reason``, ``.conv``)."""
        return [o for o in self.outcomes if o.left]

    def leave(self, bn: str, reason: str, conv: Optional[str] = None) -> None:
        """Record that BatchNorm ``bn`` is left as it was, and why (``conv``: the convolution
        considered, if the match got that far)."""
        self.recorded.append(BNOutcome(bn, "left", conv, None, reason))

    @property
    def num_chains(self) -> int:
        return len({p.chain for p in self.pairs})

    def _first_call_lines(self) -> List[str]:
        """What waits for the first call, in words: pairs whose rewrite's first-call check has
        not run (each pair's status read first) and modules captured on their first call."""
        lines: List[str] = []
        model = self.__dict__.get("_model")
        if model is None:
            return lines
        pending = [p for p in self.pairs if p.__dict__.get("_unchecked")]  # set by the status read
        if pending:
            owners = sorted({n or "<root>" for n in unchecked_chains(model).values()})
            lines.append(f"  first call not checked yet: {len(pending)} of these pairs run fused only if the first call of "
                         f"the module rewritten ({', '.join(owners[:4])}{', ...' if len(owners) > 4 else ''}) agrees with "
                         "its original; else that module's own (unfused) forward runs and they are listed as 'fallback' "
                         "(example_inputs checks now)")
        waiting = awaiting_capture(model)
        if waiting:
            lines.append(f"  captured on the first call: {', '.join(n or '<root>' for n in waiting[:4])}"
                         f"{', ...' if len(waiting) > 4 else ''} (traced with that call's real inputs then; the "
                         "norms under them are listed as skipped until it)")
        return lines

    def __str__(self) -> str:
        skipped = self.skipped  # as things run now (sets each pair's status)
        running = [p for p in self.pairs if p.status.startswith(FUSED)]
        lines = [f"convbn.convert report (strategy={self.strategy!r}): {len(self.pairs)} pairs fused "
                 f"in {self.num_chains} chains, {len(skipped)} norms skipped"]
        if len(running) != len(self.pairs):
            lines.append(f"  running fused now: {len(running)} of {len(self.pairs)} pairs (the others: see 'fallback' below)")
        return "\n".join(lines + self._memory_lines() + self._pair_lines() + self._note_lines(skipped))

    def _memory_lines(self) -> List[str]:
        """The report's lines on saved bytes and peaks: eager's, planned, predicted and measured."""
        lines: List[str] = []
        if self.eager_saved_bytes:
            lines.append(f"  saved activation bytes: eager {format_bytes(self.eager_saved_bytes)}"
                         + (f", converted {format_bytes(self.saved_bytes)} "
                            f"({self.saved_bytes / self.eager_saved_bytes:.2f}x)" if self.saved_bytes is not None else "")
                         + (f", floor {format_bytes(self.floor_saved_bytes)}" if self.floor_saved_bytes else "")
                         + (f", target {format_bytes(self.target_saved_bytes)}" if self.target_saved_bytes else ""))
        if self.eager_fallback:
            lines.append("  chains run as eager modules: the fused step measured above eager's peak on example_inputs")
        if self.planning_note:
            lines.append(f"  plan: {self.planning_note}")
        if self.predicted_peak_bytes is not None:
            lines.append(f"  predicted peak: {format_bytes(self.predicted_peak_bytes)} (saved + backward transient) "
                         f"at {self.predicted_peak_where}")
        if self.target_peak_bytes is not None:
            met = self.predicted_peak_bytes is not None and self.predicted_peak_bytes <= self.target_peak_bytes
            lines.append(f"  peak budget: {format_bytes(self.target_peak_bytes)} "
                         + ("met" if met else f"unreachable, planned for the lowest reachable peak "
                            f"{format_bytes(self.lowest_peak_bytes or 0)}"))
        if self.time_budget is not None and self.predicted_time_ratio is not None:
            met = self.predicted_time_ratio <= self.time_budget
            lines.append(f"  time budget: {self.time_budget}x eager's step; chosen plan predicted at "
                         f"{self.predicted_time_ratio:.3f}x" + ("" if met else " (no plan fits: the fastest)"))
        if self.step_costs is not None:
            lines += self.step_costs.lines()
        if self.measured_peak_bytes is not None:
            ratio = f" ({self.measured_peak_bytes / self.eager_peak_bytes:.2f}x eager " \
                    f"{format_bytes(self.eager_peak_bytes)})" if self.eager_peak_bytes else ""
            lines.append(f"  measured step peak: {format_bytes(self.measured_peak_bytes)}{ratio} "
                         f"at {self.measured_peak_where}")
        return lines

    def _pair_lines(self) -> List[str]:
        """The table of fused pairs: one line per conv + BN (+ tail), in chain order."""
        lines: List[str] = []
        width = max([12] + [len(p.activation) for p in self.pairs])
        lines.append(f"  {'chain.pos':>9}  {'conv':<32} {'norm':<32} {'tail':<{width}} {'strategy':<15} {'kept':>10} "
                     f"{'extra MACs':>12}")
        for p in self.pairs:
            # a head has no conv and an end no BN: "-" there, and the kind instead of a strategy
            # (neither keeps a conv output of its own, whatever its mode says)
            strategy = p.strategy if p.kind == "layer" or (p.kind == "end" and p.layer.elements) else p.kind
            if p.status == "fused, plan pending":
                strategy = "plan pending"  # made on the chain's first training call
            elif not p.status.startswith(FUSED):
                strategy = "fallback"
            lines.append(
                f"  {p.chain:>6}.{p.position:<2}  {p.conv or '- (pre-act head)':<32} {_norm_cell(p):<32} "
                f"{p.activation:<{width}} {strategy:<15} "
                + (f"{'-':>10} {'-':>11}" if strategy == "plan pending" else
                   f"{format_bytes(p.kept_bytes):>10} {p.extra_flops / 1e6:>10.1f}M")
            )
        return lines

    def _note_lines(self, skipped: List[BNOutcome]) -> List[str]:
        """Shared pieces, lean pools, pending plans, then every BatchNorm skipped, module not
        traced, validation, change and variant."""
        lines: List[str] = []
        if self.shared_pieces:
            most = sorted(self.shared_pieces.items(), key=lambda kv: -kv[1])
            shown = ", ".join(f"{n} ({k} chains)" for n, k in most[:4]) + (", ..." if len(most) > 4 else "")
            lines.append(f"  shared pieces: {len(most)} concatenated tensors kept once for "
                         f"{sum(self.shared_pieces.values())} chain inputs: {shown}")
        if self.lean_pools:
            shown = ", ".join(self.lean_pools[:4]) + (", ..." if len(self.lean_pools) > 4 else "")
            lines.append(f"  pooling keeping indices, not inputs: {len(self.lean_pools)} ({shown})")
        if any(p.status == "fused, plan pending" for p in self.pairs):
            lines.append("  plan pending: chains converted without example_inputs choose each layer's strategy on "
                         "their first training call (their shapes known then)")
        lines += self._first_call_lines()
        for s in skipped:
            lines.append(f"  skipped {s.batchnorm}: {s.reason}")
        for p in self.pairs:
            if p.status.startswith(PARTLY) or (p.bn and p.status.startswith(_CAVEAT)):
                lines.append(f"  {p.bn or p.conv}: {p.status}")
        for mod, err in self.untraced:
            lines.append(f"  not traced as a whole: {mod or '<root>'}: {err}")
        for mod in self.validated:
            lines.append(f"  validated against eager on example_inputs: {mod or '<root>'}")
        for change in self.changes:
            lines.append(f"  changed after convert: {change}")
        for variant in self.variants:
            lines.append(f"  variant captured for a call: {variant}")
        return lines


#: the start of the status of a chain that runs fused, but as eager modules under torch.compile
#: (``FusedChain.compile_caveat``)
_CAVEAT = f"{FUSED}; "


def _as_running(outcome: BNOutcome, status: str) -> BNOutcome:
    """``outcome`` as its chain runs now (``status``): a fused BatchNorm whose chain does not run
    fused is ``"left"`` with the status as reason; one fused in some kinds of call only stays
    ``"fused"``, the status its note (Note: [a report says what ran, call by call])."""
    if outcome.result != "fused" or status == FUSED:
        return outcome
    if status.startswith(PARTLY):
        return replace(outcome, reason=status)
    if status.startswith(_CAVEAT):  # fused; runs as eager modules only under torch.compile
        return replace(outcome, reason=status[len(_CAVEAT):])
    return replace(outcome, result="left", direction=None, reason=status)


def _fused_by_variant(outcome: BNOutcome, status: str, fused: Optional[BNOutcome]) -> BNOutcome:
    """``outcome`` (left by the first capture) where a variant fuses it: ``"fused"`` as the variant
    recorded it where every kind of call since the last read fused it, with ``status`` as its note
    where only some did; left as it was where none did (Note: [a report says what ran, call by call])."""
    if outcome.result != "left" or fused is None or not status.startswith(FUSED):
        return outcome
    return replace(fused, batchnorm=outcome.batchnorm, reason="" if status == FUSED else status)


def _norm_cell(p: FusedPair) -> str:
    """The norm column of a fused layer: its name, with its row of the norm table for a
    per-sample norm (``1 (channel_rms_norm)``)."""
    if not p.bn:
        return "- (chain end)"
    return f"{p.bn} ({p.norm})" if p.norm else p.bn
