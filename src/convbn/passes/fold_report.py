"""The report of :func:`convbn.fold`: one :class:`FoldAction` per BatchNorm and the :class:`FoldCheck`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple



__all__ = ["FoldAction", "FoldCheck", "FoldReport"]


@dataclass(frozen=True)
class FoldAction:
    """What happened to one BatchNorm (module call or functional call).

    Attributes:
        batchnorm: qualified name of the BatchNorm module in the input model, or a
            description of a functional ``batch_norm`` call.
        folded: whether it was folded away.
        layer: qualified name of the conv/linear it was folded into (``None`` if skipped).
        direction: ``"preceding"`` (BN after the layer) or ``"following"`` (BN before it).
        reason: why it was skipped, or a note about the fold (e.g. a fresh copy was made).
    """

    batchnorm: str
    folded: bool
    layer: Optional[str] = None
    direction: Optional[str] = None
    reason: str = ""


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
    """Everything :func:`fold` did: one :class:`FoldAction` per BatchNorm call found, one
    per BatchNorm module never reached by tracing, the parts that could not be traced and
    the result of the numerical check. ``str(report)`` is a readable table.
    """

    actions: List[FoldAction] = field(default_factory=list)
    untraceable: List[Tuple[str, str]] = field(default_factory=list)
    check: Optional[FoldCheck] = None

    @property
    def folded(self) -> List[FoldAction]:
        return [a for a in self.actions if a.folded]

    @property
    def skipped(self) -> List[FoldAction]:
        return [a for a in self.actions if not a.folded]

    def __str__(self) -> str:
        rows = [("BatchNorm", "result", "layer", "reason / note")]
        for a in self.actions:
            result = f"folded ({a.direction})" if a.folded else "skipped"
            rows.append((a.batchnorm, result, a.layer or "-", a.reason or ""))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [
            f"FoldReport: {len(self.folded)} folded, {len(self.skipped)} skipped "
            f"({len(self.actions)} BatchNorm calls/modules)"
        ]
        for i, r in enumerate(rows):
            lines.append("  " + "  ".join(r[j].ljust(widths[j]) for j in range(3)) + "  " + r[3])
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in widths) + "  " + "-" * 13)
        for name, why in self.untraceable:
            lines.append(f"  untraceable: {name or '<root>'}: {why}")
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
