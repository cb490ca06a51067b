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
    CONFIGS,
    COMMAND,
    DemoConfig,
    compare_losses,
    grad_difference,
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


def test_demo_reduced_size_accuracy_exact_peak_identical_losses(digits_small: Any, tmp_path: Any) -> None:
    """The demo at a reduced size (480 digits, 1 epoch of batch 16): a real result, exact
    deterministic peaks, and the losses' equality stated exactly. (The full demo reaches
    >= 90%: 3 epochs of batch 64 on all 1438 training digits, see docs/demo.md.)"""
    cfg = DemoConfig(epochs=1, batch_size=16, limit=480, device="cpu", progress=False, plot=str(tmp_path / "d.png"))
    r = run_demo(cfg, data=digits_small)
    steps = 480 // 16
    assert all(len(r.step_losses[c]) == steps for c in CONFIGS)
    # a real result: it learns (chance is 10%)
    assert min(acc[-1] for acc in r.accuracy.values()) >= 0.70, r.accuracy
    # losses: the same weights, batches and dropout masks give bit-identical losses for the
    # first steps (later, last-bit rounding differences of the backward may grow: the demo
    # states exactly which equality holds, and why)
    assert r.step_losses["tutorial"][:3] == r.step_losses["unfused"][:3]
    assert r.step_losses["auto"][:2] == r.step_losses["unfused"][:2]
    np.testing.assert_allclose(r.step_losses["auto"][:4], r.step_losses["unfused"][:4], rtol=1e-5, atol=1e-6)
    for name in ("auto", "tutorial"):
        text = r.equality[name]
        if r.step_losses[name] == r.step_losses["unfused"]:
            assert "bit-identical" in text and "differ" not in text.split("Loss")[-1], text
        else:  # the losses only part after the gradients did, and the sentence says where
            assert "gradients bit-identical to unfused for the first" in text and "it differs" in text, text
    # exact live-tensor peaks: deterministic, so a second run gives the same bytes
    assert r.memory_source == "tensors"
    small = DemoConfig(epochs=1, batch_size=16, limit=32, device="cpu", progress=False)
    assert run_demo(small, data=digits_small).peak == run_demo(small, data=digits_small).peak
    # fusing keeps less for backward and peaks lower: the conv outputs the fused pairs drop
    conv_outputs = [math.prod(s) * F32 for s in MnistNet().pair_output_shapes(16)]
    assert r.saved["unfused"] - r.saved["tutorial"] >= sum(conv_outputs)
    assert r.saved["auto"] < r.saved["unfused"]
    # the tutorial's method peaks lower (exact bytes, so a strict comparison)
    assert r.peak["tutorial"] < r.peak["unfused"], r.peak
    assert all(t > 0 for t in r.step_time.values())
    assert r.plot and os.path.getsize(r.plot) > 1000
    assert r.timeline_plot and r.timeline_plot.endswith("d-timeline.png") and os.path.getsize(r.timeline_plot) > 1000
    # the peak-aware plan: auto peaks lower than unfused too
    assert r.peak["auto"] < r.peak["unfused"], r.peak


def test_compare_losses_sentences() -> None:
    same = compare_losses("x", [1.0, 2.0], [1.0, 2.0])
    assert same == "x: loss and gradients bit-identical to unfused at every one of the 2 steps"
    text = compare_losses("x", [1.0, 2.0, 3.5], [1.0, 2.0, 3.0], (1, 3e-8))
    assert "gradients bit-identical to unfused for the first 1 of 3 steps; at step 2" in text and "3.0e-08" in text
    assert "Loss bit-identical for the first 2 steps; from step 3" in text and "5.0e-01" in text


def test_grad_difference() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 2)
    a(x).sum().backward()
    b(x).sum().backward()
    assert grad_difference(a, b) == 0.0
    b.weight.grad += 0.5
    assert grad_difference(a, b) == 0.5


def test_python_m_convbn_demo_prints_table(tmp_path: Any) -> None:
    """``python -m convbn demo`` end to end, tiny: exits 0, prints the table, the equality and the PNG path."""
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1")
    png = tmp_path / "demo.png"
    proc = subprocess.run(
        [sys.executable, "-m", "convbn", "demo", "--epochs", "1", "--limit", "96", "--batch-size", "48",
         "--device", "cpu", "--plot", str(png)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())  # rich wraps at the console width
    for text in ("epoch 1:", "saved for backward", "live tensors, exact", "tutorial:", "bit-identical",
                 "final test accuracy: unfused", f"plot written to {png}"):
        assert text in out, text
    assert png.exists() and "Traceback" not in proc.stderr


def test_accuracy_sentence_says_equal_only_when_equal() -> None:
    from convbn.demo_results import DemoResult, accuracy_sentence

    r = DemoResult(test_images=359)
    r.accuracy = {"unfused": [0.5, 0.944], "auto": [0.5, 0.944], "tutorial": [0.5, 0.944]}
    assert accuracy_sentence(r).endswith(": equal")
    r.accuracy = {"unfused": [0.933], "auto": [0.944], "tutorial": [0.933]}
    text = accuracy_sentence(r)
    assert "not equal" in text and "4 of 359 test images apart" in text
    assert "unfused 93.3%, auto 94.4%, tutorial 93.3%" in text


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


def test_run_demo_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="--limit must be at least 2"):
        run_demo(DemoConfig(limit=1, progress=False, device="cpu"))
    with pytest.raises(ValueError, match=r"batch size must be at least 2 \(BatchNorm needs 2 samples\), but got -1"):
        run_demo(DemoConfig(batch_size=-1, progress=False, device="cpu"))
    with pytest.raises(FileNotFoundError, match="/nonexistent"):
        run_demo(DemoConfig(mnist_dir="/nonexistent", progress=False, device="cpu"))


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
               "--no-progress", "--no-plot", "--device", "cpu"])
    assert rc == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the console width
    assert "MNIST (" in out and "32 train / 8 test" in out
    assert "tutorial:" in out and "bit-identical" in out and "test accuracy" in out


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
    args = parser.parse_args(["demo", "--epochs", "2", "--batch-size", "32"])
    assert args.command_obj is COMMAND and args.epochs == 2 and args.batch_size == 32
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
