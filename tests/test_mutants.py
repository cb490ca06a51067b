"""Mutation testing in CI (issue 23): each deliberate bug of ``scripts/mutants.py`` is applied to
a temporary copy of the package and must make its fast subset of this suite fail. A mutant
that survives means the suite would stay green with that bug: this test then fails, naming it.
``python scripts/mutants.py`` runs the same from the command line (``--measure``: the whole
suite against the fused-forward mutant)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "mutants.py")
_spec = importlib.util.spec_from_file_location("convbn_mutants", _PATH)
mutants = importlib.util.module_from_spec(_spec)
sys.modules["convbn_mutants"] = mutants  # dataclasses look their module up there
_spec.loader.exec_module(mutants)  # type: ignore[union-attr]


@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_mutant_is_killed(name: str) -> None:
    killed, seconds, out = mutants.run_mutant(name, timeout=3600)  # a hang guard: a loaded machine is slow
    assert killed, f"mutant {name!r} ({mutants.MUTANTS[name].doc}) SURVIVED its tests " \
                   f"{list(mutants.MUTANTS[name].tests)}:\n{out}"


def test_every_mutant_edits_the_package(tmp_path) -> None:
    """Each edit applies exactly once and changes the source (a stale mutant is an error)."""
    for name, m in mutants.MUTANTS.items():
        dest = tmp_path / name
        mutants.apply_mutant(name, str(dest))
        for rel, old, new in m.edits:
            text = (dest / "convbn" / rel).read_text()
            assert new in text and old != new, (name, rel)


def test_plan_mutants_are_one_edit_each() -> None:
    """The plan is one value made in one place (``passes/plan/chain_plans.py``): a planner mutant
    is one search/replace in one file, and the op path's may_drop has its own."""
    plan = [n for n in mutants.MUTANTS if n.startswith("planner_")] + ["op_may_drop_ignored"]
    assert {"planner_keeps_all", "planner_keeps_nothing", "op_may_drop_ignored"} <= set(plan)
    for name in plan:
        assert len(mutants.MUTANTS[name].edits) == 1, name
