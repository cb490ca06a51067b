"""The library runs without its extras: ``rich`` (``convbn[cli]``) only serves bench / demo output."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from convbn.bench.table import require_rich

SRC = str(Path(__file__).resolve().parents[1] / "src")

_BLOCK_RICH = """
import importlib.abc, sys
class _NoRich(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "rich" or name.startswith("rich."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, _NoRich())
"""


def _run_without_rich(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", _BLOCK_RICH + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def without_rich() -> subprocess.CompletedProcess:
    """One process without rich (an import of torch costs seconds): the core and the commands
    load and train, rich is not imported; then the bench table's error names the package."""
    return _run_without_rich("""
        import torch
        from torch import nn
        import convbn, convbn.cli, convbn.demo, convbn.bench.training, convbn.bench.inference
        net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU()).train()
        fused = convbn.convert(net)
        fused(torch.randn(2, 1, 5, 5)).sum().backward()
        convbn.fold(net.eval())
        assert "rich" not in sys.modules
        print("core ok")
        from convbn.bench.table import print_rich_table
        try:
            print_rich_table(["a"], set(), [["1"]], "t")
        except ImportError as exc:
            print("table:", exc)
    """)


def test_core_and_commands_load_without_rich(without_rich: subprocess.CompletedProcess) -> None:
    assert without_rich.returncode == 0, without_rich.stderr
    assert "core ok" in without_rich.stdout.splitlines()


def test_bench_table_without_rich_names_the_package(without_rich: subprocess.CompletedProcess) -> None:
    assert without_rich.returncode == 0, without_rich.stderr
    table = [line for line in without_rich.stdout.splitlines() if line.startswith("table:")]
    assert table and "printing a benchmark table needs rich: pip install 'convbn[cli]'" in table[0], without_rich.stdout


def test_require_rich_passes_when_installed() -> None:
    pytest.importorskip("rich")
    require_rich("this test")
