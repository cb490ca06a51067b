"""The report of :func:`convbn.fold`: one :class:`~convbn.passes.report.outcome.BNOutcome` per
BatchNorm (the record convert's report lists too) and the :class:`FoldCheck`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ...functional.deprecation import warn_renamed
from .outcome import BNOutcome

__all__ = ["FoldCheck", "FoldReport"]


@dataclass
class FoldCheck:
    """Result of the numerical check run by ``fold(check=True)``."""

    ran: bool
    note: str = ""
    input_shapes: Tuple[Tuple[int, ...], ...] = ()
    max_abs_diff: float = 0.0
    tolerance: float = 0.0
    passed: bool = True


@dataclass
class FoldReport:
    """Everything :func:`fold` did. ``str(report)`` is a readable table.

    Attributes:
        outcomes: one :class:`convbn.BNOutcome` per BatchNorm call found and
            one per BatchNorm module never reached by tracing: ``"folded"`` (with the layer
            and ``direction``) or ``"left"`` with the reason -- the same record
            :func:`convbn.convert`'s report lists.
        untraced: ``(module, why)`` for the parts not traced whole (the name
            :class:`~convbn.ConvertReport` uses): untraceable, kept as an opaque module, or
            left unfolded.
        check: the result of the numerical check (``None``: not requested).
    """

    outcomes: List[BNOutcome] = field(default_factory=list)
    untraced: List[Tuple[str, str]] = field(default_factory=list)
    check: Optional[FoldCheck] = None

    @property
    def actions(self) -> List[BNOutcome]:
        """Deprecated: :attr:`outcomes`."""
        warn_renamed("FoldReport.actions", "FoldReport.outcomes")
        return self.outcomes

    @property
    def untraceable(self) -> List[Tuple[str, str]]:
        """Deprecated: :attr:`untraced`."""
        warn_renamed("FoldReport.untraceable", "FoldReport.untraced")
        return self.untraced

    @property
    def folded(self) -> List[BNOutcome]:
        return [a for a in self.outcomes if a.folded]

    @property
    def skipped(self) -> List[BNOutcome]:
        """The outcomes ``"left"``, as a new list (record one with :meth:`leave`)."""
        return [a for a in self.outcomes if a.left]

    def leave(self, bn: str, reason: str) -> None:
        """Record that BatchNorm ``bn`` is left as it was, and why."""
        self.outcomes.append(BNOutcome(bn, "left", None, None, reason))

    def __str__(self) -> str:
        rows = [("norm", "result", "layer", "reason / note")]
        for a in self.outcomes:
            result = f"folded ({a.direction})" if a.folded else "skipped"
            rows.append((a.batchnorm, result, a.layer or "-", a.reason or ""))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [
            f"FoldReport: {len(self.folded)} folded, {len(self.skipped)} skipped "
            f"({len(self.outcomes)} norm calls/modules)"
        ]
        for i, r in enumerate(rows):
            lines.append("  " + "  ".join(r[j].ljust(widths[j]) for j in range(3)) + "  " + r[3])
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in widths) + "  " + "-" * 13)
        for name, why in self.untraced:
            lines.append(f"  not traced as a whole: {name or '<root>'}: {why}")
        c = self.check
        if c is None:
            lines.append("  check: not requested")
        elif not c.ran:
            lines.append(f"  check: not run: {c.note}")
        else:
            verdict = "passed" if c.passed else "FAILED"
            lines.append(
                f"  check: {verdict}: max |folded - reference| = {c.max_abs_diff:.3g} "
                f"(allowed {c.tolerance:.3g}) on inputs {list(c.input_shapes)}"
                + (f"; {c.note}" if c.note else "")
            )
        return "\n".join(lines)
