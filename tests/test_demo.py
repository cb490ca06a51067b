"""The training demo (``python -m convbn demo``), its data loaders and the CLI dispatch."""
from __future__ import annotations

import gzip
import math
import os
import struct
import subprocess
import sys
from typing import Any, Dict

import numpy as np
import pytest
import torch
from torch import nn

import convbn.cli as cli
from convbn.demo import (
    COMMAND,
    DemoConfig,
    MnistNet,
    load_digits_28,
    load_mnist,
    main,
    read_idx,
    run_demo,
)

F32 = torch.empty((), dtype=torch.float32).element_size()



@pytest.fixture(scope="module")
def digits_small() -> Any:
    return load_digits_28(seed=1)


# --------------------------------------------------------------------------- end to end


def test_python_m_convbn_demo_prints_table() -> None:
    """``python -m convbn demo`` runs one short epoch, exits 0 and prints losses and the table."""
    env = dict(os.environ, COLUMNS="120", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "convbn", "demo", "--epochs", "1", "--limit", "96", "--batch-size", "48",
         "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())  # rich wraps at the console width
    assert "epoch 1: train loss fused" in out
    assert "fused (recompute_conv) vs unfused" in out
    for row in ("saved bytes at end of forward", "peak memory of a step", "median step time", "fused/unfused"):
        assert row in out, row


@pytest.mark.parametrize("strategy", ["recompute_conv", "recompute_bn", "frozen"])
def test_demo_saves_memory_and_losses_track(strategy: str, digits_small: Any) -> None:
    batch = 32
    cfg = DemoConfig(epochs=1, batch_size=batch, limit=96, strategy=strategy, device="cpu", progress=False)
    r = run_demo(cfg, console=None, data=digits_small)
    assert r.batch_size == batch
    assert len(r.step_losses["fused"]) == 96 // batch
    # same maths: the losses of the first steps agree closely (same weights, batches, dropout masks)
    np.testing.assert_allclose(r.step_losses["fused"], r.step_losses["unfused"], rtol=1e-5, atol=1e-6)
    assert all(math.isfinite(v) for v in r.step_losses["fused"])
    e = r.epochs[0]
    assert abs(e["fused_acc"] - e["unfused_acc"]) <= 1.0 / 96 + 1e-9
    # memory: bytes held at the end of forward
    conv_outputs = [math.prod(s) * F32 for s in MnistNet().pair_output_shapes(batch)]
    if strategy in ("recompute_conv", "frozen"):
        # each fused pair drops (at least) its conv output y, which eager's BatchNorm keeps
        assert r.saved["unfused"] - r.saved["fused"] >= sum(conv_outputs), (r.saved, conv_outputs)
    else:
        # recompute_bn keeps y but not the BN output: never more than eager
        assert r.saved["fused"] <= r.saved["unfused"]
    assert set(r.peak) == set(r.step_time) == {"fused", "unfused"}
    assert r.memory_source == "rss"
    assert all(t > 0 for t in r.step_time.values())


def test_demo_leaves_stats_consistent(digits_small: Any) -> None:
    """The measurement runs on copies: after training, fused and unfused running stats agree."""
    cfg = DemoConfig(epochs=2, batch_size=32, limit=64, device="cpu", progress=False)
    r = run_demo(cfg, data=digits_small)
    assert len(r.epochs) == 2 and len(r.step_losses["unfused"]) == 4
    np.testing.assert_allclose(r.step_losses["fused"], r.step_losses["unfused"], rtol=1e-5, atol=1e-6)


def test_mnist_net_fused_unfused_same_keys_and_outputs() -> None:
    torch.manual_seed(0)
    fused, unfused = MnistNet(fused=True, strategy="recompute_bn"), MnistNet(fused=False)
    assert list(fused.state_dict()) == list(unfused.state_dict())
    unfused.load_state_dict(fused.state_dict(), strict=True)
    fused.eval()
    unfused.eval()
    x = torch.randn(3, 1, 28, 28)
    torch.testing.assert_close(fused(x), unfused(x))
    assert sum(isinstance(m, nn.BatchNorm2d) for m in fused.modules()) == 2
    assert fused.fc1.in_features == 9216


def test_demo_main_rejects_bad_options(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main(["--strategy", "fast"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--limit must be at least 2"):
        run_demo(DemoConfig(limit=1, progress=False, device="cpu"))


# --------------------------------------------------------------------------- data


def _write_idx(path: str, array: np.ndarray, type_code: int = 0x08) -> None:
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)


def _fake_mnist(directory: str, n_train: int = 40, n_test: int = 12, gz: bool = False, seed: int = 0) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, (n_train,), dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, (n_test,), dtype=np.uint8),
    }
    for name, a in arrays.items():
        _write_idx(os.path.join(directory, name + (".gz" if gz else "")), a)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip(tmp_path: Any, gz: bool) -> None:
    arrays = _fake_mnist(str(tmp_path), gz=gz)
    for name, a in arrays.items():
        got = read_idx(os.path.join(str(tmp_path), name + (".gz" if gz else "")))
        assert got.dtype == np.uint8 and got.shape == a.shape
        np.testing.assert_array_equal(got, a)


def test_read_idx_other_types(tmp_path: Any) -> None:
    a = np.arange(24, dtype=np.int32).reshape(2, 3, 4) - 7
    path = str(tmp_path / "ints.idx")
    _write_idx(path, a.astype(np.dtype(">i4")), type_code=0x0C)
    got = read_idx(path)
    np.testing.assert_array_equal(got, a)
    f = np.linspace(-1, 1, 6).astype(np.float32)
    _write_idx(str(tmp_path / "f.idx"), f, type_code=0x0D)
    np.testing.assert_array_equal(read_idx(str(tmp_path / "f.idx")), f)


def test_read_idx_errors(tmp_path: Any) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x01\x05")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(str(bad))
    code = tmp_path / "code"
    code.write_bytes(b"\x00\x00\x07\x01\x00\x00\x00\x01\x05")
    with pytest.raises(ValueError, match="unknown IDX type byte 0x07"):
        read_idx(str(code))
    short = tmp_path / "short"
    short.write_bytes(b"\x00\x00\x08\x02\x00\x00\x00\x03\x00\x00\x00\x03\x01\x02")
    with pytest.raises(ValueError, match="truncated"):
        read_idx(str(short))


def test_load_mnist_normalises(tmp_path: Any) -> None:
    arrays = _fake_mnist(str(tmp_path), gz=True)
    data = load_mnist(str(tmp_path))
    assert data.train_x.shape == (40, 1, 28, 28) and data.test_x.shape == (12, 1, 28, 28)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    expected = (arrays["train-images-idx3-ubyte"].astype(np.float32) / 255.0 - 0.1307) / 0.3081
    np.testing.assert_allclose(data.train_x[:, 0].numpy(), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(data.test_y.numpy(), arrays["t10k-labels-idx1-ubyte"])


def test_load_mnist_dotted_names_and_missing(tmp_path: Any) -> None:
    _fake_mnist(str(tmp_path))
    for name in os.listdir(tmp_path):
        os.rename(tmp_path / name, tmp_path / name.replace("-idx", ".idx"))
    assert len(load_mnist(str(tmp_path)).train_y) == 40
    os.remove(tmp_path / "t10k-labels.idx1-ubyte")
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_mnist(str(tmp_path))


def test_load_mnist_count_mismatch(tmp_path: Any) -> None:
    _fake_mnist(str(tmp_path))
    _write_idx(str(tmp_path / "train-labels-idx1-ubyte"), np.zeros(3, dtype=np.uint8))
    with pytest.raises(ValueError, match="40 images but labels"):
        load_mnist(str(tmp_path))


def test_demo_on_mnist_dir(tmp_path: Any, capsys: Any) -> None:
    """``--mnist-dir`` end to end (in process) on synthetic IDX files."""
    _fake_mnist(str(tmp_path), n_train=32, n_test=8, gz=True)
    rc = main(["--mnist-dir", str(tmp_path), "--epochs", "1", "--batch-size", "16",
               "--no-progress", "--device", "cpu"])
    assert rc == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the console width
    assert "MNIST (" in out and "32 train / 8 test" in out
    assert "median step time" in out


def test_load_digits_28(digits_small: Any) -> None:
    d = digits_small
    assert d.train_x.shape[1:] == (1, 28, 28) and d.test_x.shape[1:] == (1, 28, 28)
    assert len(d.train_y) + len(d.test_y) == 1797
    assert len(d.test_y) == round(1797 * 0.2)
    assert set(d.train_y.tolist()) == set(range(10))
    # normalised with the MNIST constants: background (0) maps to -mean/std
    torch.testing.assert_close(d.train_x.min(), torch.tensor(-0.1307 / 0.3081))
    again = load_digits_28(seed=1)
    assert torch.equal(again.train_x, d.train_x)
    other = load_digits_28(seed=2)
    assert not torch.equal(other.train_y, d.train_y)


# --------------------------------------------------------------------------- CLI


def test_cli_dispatch_and_registry(capsys: Any) -> None:
    assert [c.name for c in cli.load_commands()][0] == "demo"  # bench follows (tests/test_cli.py)
    assert cli.load_commands()[0] is COMMAND
    parser = cli.build_parser()
    args = parser.parse_args(["demo", "--epochs", "2", "--strategy", "frozen"])
    assert args.command_obj is COMMAND and args.epochs == 2 and args.strategy == "frozen"
    with pytest.raises(SystemExit):
        cli.main([])
    assert "COMMAND" in capsys.readouterr().err
    with pytest.raises(TypeError, match="COMMAND"):
        cli.load_commands(["convbn.memory"])
    with pytest.raises(ValueError, match="two convbn subcommands are named 'demo'"):
        cli.load_commands(["convbn.demo", "convbn.demo"])


def test_cli_extra_command_runs() -> None:
    """A new subcommand plugs in through a :class:`convbn.cli.Command` (how ``bench`` will)."""
    seen: Dict[str, Any] = {}

    def add(p: Any) -> None:
        p.add_argument("--n", type=int, default=1)

    def run(args: Any) -> int:
        seen["n"] = args.n
        return 3

    extra = cli.Command("extra", "test command", add, run)
    parser = cli.build_parser([COMMAND, extra])
    args = parser.parse_args(["extra", "--n", "5"])
    assert args.command_obj.run(args) == 3 and seen == {"n": 5}
