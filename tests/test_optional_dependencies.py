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


def test_core_and_commands_load_without_rich() -> None:
    proc = _run_without_rich("""
        import torch
        from torch import nn
        import convbn, convbn.cli, convbn.demo, convbn.bench.training, convbn.bench.inference
        net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU()).train()
        fused = convbn.convert(net)
        fused(torch.randn(2, 1, 5, 5)).sum().backward()
        convbn.fold(net.eval())
        assert "rich" not in sys.modules
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_bench_table_without_rich_names_the_package() -> None:
    proc = _run_without_rich("""
        from convbn.bench.table import print_rich_table
        try:
            print_rich_table(["a"], set(), [["1"]], "t")
        except ImportError as exc:
            print(exc)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "printing a benchmark table needs rich: pip install 'convbn[cli]'" in proc.stdout


def test_require_rich_passes_when_installed() -> None:
    pytest.importorskip("rich")
    require_rich("this test")
