"""Where a pass's report lives on the model it returns: the attribute ``convbn_report``.

Both passes attach their report under the one name (``convert``: a
:class:`~convbn.passes.report.convert_report.ConvertReport`, ``fold``: a
:class:`~convbn.passes.report.fold_report.FoldReport`); it is an instance attribute, not part
of ``state_dict``. Fold's old name ``fold_report`` answers too, for one release, warning.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ...functional.deprecation import RenamedAttribute

__all__ = ["REPORT_ATTRIBUTE", "attach_report", "detach_report"]

#: The attribute both passes set on the module they return.
REPORT_ATTRIBUTE = "convbn_report"
_OLD_FOLD_ATTRIBUTE = "fold_report"


def attach_report(model: nn.Module, report: Any) -> None:
    """Set ``model.convbn_report = report`` (and fold's old name, deprecated, for a ``FoldReport``).

    Args:
        model: the module a pass returns.
        report: its report.

    Example:
        >>> from convbn.passes.report.fold_report import FoldReport
        >>> m = nn.Identity()
        >>> attach_report(m, FoldReport())
        >>> type(m.convbn_report).__name__
        'FoldReport'
    """
    model.__dict__[REPORT_ATTRIBUTE] = report
    from .fold_report import FoldReport

    if isinstance(report, FoldReport):
        model.__dict__[_OLD_FOLD_ATTRIBUTE] = RenamedAttribute(report, "model.fold_report", "model.convbn_report")


def detach_report(model: nn.Module) -> Optional[Any]:
    """Remove and return ``model``'s report (``None`` if it has none).

    Example:
        >>> detach_report(nn.Identity()) is None
        True
    """
    model.__dict__.pop(_OLD_FOLD_ATTRIBUTE, None)
    return model.__dict__.pop(REPORT_ATTRIBUTE, None)
