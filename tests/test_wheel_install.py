"""convbn installed as a user installs it: the wheel, in a fresh virtual environment that holds
torch (and torch's own dependencies) and nothing else.

The wheel is built from a copy of the project's packaging files and ``src/``; the venv is
``python -m venv`` with links to this interpreter's torch and the distributions torch requires
(read from their metadata), so no other package (numpy, rich, scikit-learn, matplotlib, onnx
...) can leak in: the test checks that ``import numpy`` fails there. The wheel goes in with
``pip install --no-deps`` (torch is present), then the installed ``convbn`` script runs
``--version``, ``--help`` and ``explain`` on a small model of the user's, and the library runs
the Quick start's first steps: convert with an example input, a training step, the report,
the checkpoint loading into the plain model, and fold.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Set

import pytest

import convbn

ROOT = Path(__file__).resolve().parents[1]
#: What a wheel build reads (README.md is the long description, LICENSE the licence file).
PACKAGING = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "CHANGELOG.md")

USER_NET = textwrap.dedent("""
    from torch import nn

    def build():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
""")

QUICK_START = textwrap.dedent("""
    import torch, convbn
    from tinynets import build

    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3, 16, 16)
    fast = convbn.convert(model, example_inputs=x)
    print(fast.convbn_report)
    loss = fast(x).logsumexp(1).mean()
    loss.backward(); opt.step()
    torch.save(fast.state_dict(), "ckpt.pt")
    build().load_state_dict(torch.load("ckpt.pt"), strict=True)
    assert list(convbn.fused_modules(fast)) and "2 pairs fused" in str(fast.convbn_report), fast.convbn_report
    serve = convbn.fold(model.eval())
    print(serve.convbn_report)
    print("quick start ok")
""")


def _requirements(dist: str) -> Set[str]:
    """``dist`` and every distribution it requires (no extras), recursively, by normalised name."""
    seen: Set[str] = set()
    todo = [dist]
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        for req in importlib.metadata.requires(name) or []:
            if "extra ==" in req.replace('"', "").replace("'", ""):
                continue
            todo.append(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0])
    return seen


def _top_level_entries(dist: str) -> Dict[str, Path]:
    """What distribution ``dist`` installed at the top of its site-packages (packages, modules,
    its .dist-info, .libs), by name, with where each is."""
    found = importlib.metadata.distribution(dist)
    entries = {}
    for file in found.files or []:
        first = file.parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            entries[first] = Path(str(found.locate_file(first)))
    return entries


def _torch_only_venv(where: Path) -> Path:
    """A venv whose site-packages links to torch and its requirements only; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=600)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, env=_clean_env()).stdout.strip())
    for dist in sorted(_requirements("torch")):
        for name, path in _top_level_entries(dist).items():
            if path.exists() and not (site / name).exists():
                (site / name).symlink_to(path)
    return python


def _clean_env() -> Dict[str, str]:
    """This environment without anything that would put other packages on the venv's path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env.update(OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1", COLUMNS="200")
    return env


def _copy_project(tmp: Path) -> Path:
    """A copy of what a build reads (packaging files, src/, and tests/ to see that the sdist leaves it out)."""
    project = tmp / "project"
    project.mkdir()
    for name in PACKAGING:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, project / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".hypothesis", ".pytest_cache")
    shutil.copytree(ROOT / "src", project / "src", ignore=ignore)
    shutil.copytree(ROOT / "tests", project / "tests", ignore=ignore)
    return project


def _build_wheel(tmp: Path) -> Path:
    """``pip wheel`` of a copy of the project: the build leaves the checkout alone."""
    project = _copy_project(tmp)
    out = tmp / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "--quiet", "-w", str(out), str(project)],
                          capture_output=True, text=True, timeout=900, env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = list(out.glob("convbn-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _run(args: List[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_clean_env())
    print(f"{time.perf_counter() - start:.1f} s: {' '.join(args[-3:])}")
    return proc


@pytest.mark.expect_unfused("nothing is converted in this process: the installed wheel converts in a child")
def test_wheel_in_a_torch_only_venv(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    python = _torch_only_venv(tmp_path / "venv")
    bin_dir = python.parent
    work = tmp_path / "user"
    work.mkdir()
    (work / "tinynets.py").write_text(USER_NET)

    # only torch is there: nothing of the dev environment leaks in
    probe = _run([str(python), "-c", "import torch, importlib.util as u; "
                  "print([m for m in ('numpy', 'rich', 'sklearn', 'matplotlib', 'onnx', 'convbn') if u.find_spec(m)])"],
                 work)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.strip() == "[]", probe.stdout

    install = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--quiet", str(wheel)], work, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]

    version = _run([str(bin_dir / "convbn"), "--version"], work)
    assert version.returncode == 0, version.stderr[-3000:]
    assert version.stdout.strip() == f"convbn {convbn.__version__}", version.stdout
    assert version.stderr == "", version.stderr  # not even torch's "Failed to initialize NumPy"

    help_ = _run([str(bin_dir / "convbn"), "--help"], work)
    assert help_.returncode == 0, help_.stderr[-3000:]
    assert all(c in help_.stdout for c in ("demo", "bench", "explain", "fold")), help_.stdout

    explain = _run([str(bin_dir / "convbn"), "explain", "tinynets:build", "--input-shape", "2x3x16x16"], work)
    assert explain.returncode == 0, explain.stderr[-3000:]
    assert "tinynets:build, input 2x3x16x16" in explain.stdout, explain.stdout

    quick = _run([str(python), "-c", QUICK_START], work)
    assert quick.returncode == 0, quick.stderr[-3000:]
    assert quick.stdout.strip().endswith("quick start ok"), quick.stdout
    assert (work / "ckpt.pt").exists()

    # a command that needs an extra says which, in one line, and does no work
    demo = _run([str(bin_dir / "convbn"), "demo", "--epochs", "1"], work)
    assert demo.returncode == 2, (demo.returncode, demo.stderr[-3000:])
    assert "Traceback" not in demo.stderr and len(demo.stderr.strip().splitlines()) == 1, demo.stderr
    assert "pip install 'convbn[demo]'" in demo.stderr, demo.stderr
    assert demo.stdout == "", demo.stdout


@pytest.mark.expect_unfused("packaging only: nothing is converted")
def test_wheel_and_sdist_ship_the_licence_and_the_sdist_leaves_tests_out(tmp_path: Path) -> None:
    """The sdist holds the package, README, CHANGELOG and LICENSE; the tests stay in the repository
    (they need its examples, benchmarks and README and the dev extras' models)."""
    project = _copy_project(tmp_path)
    proc = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                           "out = sys.argv[1]; s = b.build_sdist(out); w = b.build_wheel(out); print('BUILT', s, w)", str(tmp_path / "dist")],
                          cwd=project, capture_output=True, text=True, timeout=900, env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = [line.split() for line in proc.stdout.splitlines() if line.startswith("BUILT ")][-1]
    sdist, wheel = tmp_path / "dist" / built[1], tmp_path / "dist" / built[2]
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "src/convbn/__init__.py",
            "src/convbn/py.typed"} <= names, sorted(names)
    assert not [n for n in names if n.startswith("tests")], sorted(n for n in names if n.startswith("tests"))
    with zipfile.ZipFile(wheel) as whl:
        files = whl.namelist()
        metadata = whl.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
    assert any(f.endswith(".dist-info/licenses/LICENSE") for f in files), files
    assert "License-Expression: BSD-3-Clause" in metadata and "Author: convbn developers" in metadata
    extras = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, flags=re.M))
    assert {"cli", "plot", "onnx", "demo", "all", "dev"} <= extras and "sweep" not in extras, extras
    assert not re.search(r"^Requires-Dist: (torch|torchvision)\b.*extra ==", metadata, flags=re.M), metadata
