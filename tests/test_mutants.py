"""Mutation testing in CI (issue 23): each deliberate bug of ``scripts/mutants.py`` is applied to
a temporary copy of the package and must make its fast subset of this suite fail. A mutant
that survives means the suite would stay green with that bug: this test then fails, naming it.
``python scripts/mutants.py`` runs the same from the command line (``--measure``: the whole
suite against the fused-forward mutant)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "mutants.py")
_spec = importlib.util.spec_from_file_location("convbn_mutants", _PATH)
mutants = importlib.util.module_from_spec(_spec)
sys.modules["convbn_mutants"] = mutants  # dataclasses look their module up there
_spec.loader.exec_module(mutants)  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def warm():
    """One server per test process that forks a pytest per mutant with torch, pytest and hypothesis
    already imported (Note: [warm mutant runs] in scripts/mutants.py): each mutant still gets a
    process of its own and its own copy of the package."""
    if not hasattr(os, "fork"):  # no fork (Windows): a fresh ``python -m pytest`` per mutant
        yield None
        return
    with mutants.WarmPytest() as runner:
        yield runner


@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_mutant_is_killed(name: str, warm) -> None:
    killed, seconds, out = mutants.run_mutant(name, timeout=3600, runner=warm)  # a hang guard: a loaded machine is slow
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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the warm runner forks")
def test_the_warm_runner_passes_the_kill_tests_on_the_package_as_it_is(warm, tmp_path) -> None:
    """A forked pytest on an unmutated copy passes (exit 0), so a kill above is the mutant's doing,
    not the fork's; the fresh-process runner agrees with it on a mutant (both exit 1)."""
    shutil.copytree(mutants.SRC, tmp_path / "convbn", ignore=shutil.ignore_patterns("__pycache__"))
    tests = [mutants.MUTANTS["fused_forward_eager"].tests[0], mutants.MUTANTS["lean_pool_keeps_input"].tests[0]]
    code, out = warm.run(str(tmp_path), [*mutants._PYTEST_ARGS, *tests], 3600)
    assert code == 0, out[-3000:]
    assert "2 passed" in out, out[-3000:]
    for runner in (warm, None):
        killed, _, out = mutants.run_mutant("lean_pool_keeps_input", timeout=3600, runner=runner)
        assert killed, out
