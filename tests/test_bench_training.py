"""Tests for ``convbn.bench.training``: rows, ratios, differences, outputs and errors."""
from __future__ import annotations

import argparse
import copy
import json
from typing import List

import pytest
import torch
from torch import nn

from convbn.bench.training import (
    CONFIG_KEYS,
    CheckpointBlock,
    TrainingRow,
    add_training_arguments,
    checkpoint_blocks,
    config_names,
    find_blocks,
    main_training,
    rows_to_json,
    rows_to_markdown,
    run_training_bench,
    write_plot,
)

NO_COMPILE_NAMES = [
    "eager",
    "convert auto",
    "convert auto budget=0.85",
    "convert recompute_conv (tutorial)",
    "convert recompute_bn",
    "checkpoint per block",
]


@pytest.fixture(scope="module")
def mnist_rows() -> List[TrainingRow]:
    return run_training_bench("mnist", batch_size=8, steps=2, warmup=1, memory_rounds=1, budgets=[0.85],
                              use_compile=False, progress=False)


def _parse(argv: List[str]) -> argparse.Namespace:
    return add_training_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_one_row_per_config_in_order(mnist_rows: List[TrainingRow]) -> None:
    assert [r.config for r in mnist_rows] == NO_COMPILE_NAMES
    for r in mnist_rows:
        assert r.model == "mnist" and r.input_shape == (8, 1, 28, 28)
        assert not r.note.startswith("failed"), r.note
        assert r.saved_bytes is not None and r.median_ms is not None and r.median_ms > 0
        assert r.peak_bytes is not None and r.setup_s is not None


def test_ratios_are_to_eager_of_the_same_run(mnist_rows: List[TrainingRow]) -> None:
    eager = mnist_rows[0]
    assert eager.saved_ratio == 1.0 and eager.time_ratio == 1.0
    for r in mnist_rows:
        assert r.saved_ratio == pytest.approx(r.saved_bytes / eager.saved_bytes)
        assert r.time_ratio == pytest.approx(r.median_ms / eager.median_ms)


def test_convert_matches_eager_and_saves_less(mnist_rows: List[TrainingRow]) -> None:
    eager = mnist_rows[0]
    for r in mnist_rows:
        if r.config.startswith("convert") or r.config.startswith("checkpoint"):
            assert r.max_out_diff is not None and r.max_out_diff < 1e-5, r
            assert r.max_grad_diff is not None and r.max_grad_diff < 1e-4, r
        if r.config.startswith("convert"):
            assert r.saved_bytes < eager.saved_bytes, r
            assert r.activation_bytes < eager.activation_bytes, r
        assert 0 < r.activation_bytes <= r.saved_bytes
    by = {r.config: r for r in mnist_rows}
    # the budget was met (a fraction of eager saved activation bytes, parameters excluded)
    # and the tutorial keeps the least of the three
    assert by["convert auto budget=0.85"].activation_ratio <= 0.85 + 1e-9
    assert by["convert recompute_conv (tutorial)"].saved_bytes < by["convert recompute_bn"].saved_bytes


def test_activation_bytes_drop_exactly_the_saved_parameters(mnist_rows: List[TrainingRow]) -> None:
    from convbn.bench.models import MNISTNet

    eager = mnist_rows[0]
    # eager saves every conv / linear / batchnorm weight (addmm saves weight.t(), a view of the same storage)
    kinds = (nn.Conv2d, nn.Linear, nn.BatchNorm2d)
    weights = sum(m.weight.numel() for m in MNISTNet().modules() if isinstance(m, kinds)) * 4
    assert eager.saved_bytes - eager.activation_bytes == weights
    assert eager.activation_ratio == 1.0
    for r in mnist_rows:
        assert r.activation_ratio == pytest.approx(r.activation_bytes / eager.activation_bytes)


def test_checkpoint_note_reports_double_bn_update(mnist_rows: List[TrainingRow]) -> None:
    ck = next(r for r in mnist_rows if r.config == "checkpoint per block")
    assert "running stats differ" in ck.note and "BN inside" in ck.note


def test_configs_selection_and_errors() -> None:
    assert config_names(["tutorial"], use_compile=False) == ["eager", "convert recompute_conv (tutorial)"]
    assert config_names(["auto"], budgets=[0.4]) == ["eager", "convert auto", "convert auto budget=0.4"]
    assert config_names(["compile"], compile_budgets=[0.5, 0.1]) == [
        "eager", "torch.compile budget=0.5", "torch.compile budget=0.1"]
    assert config_names(["compile"], use_compile=False) == ["eager"]
    # no budget given, no compile (neither alone nor after convert)
    assert len(config_names(None, use_compile=False)) == len(CONFIG_KEYS) - 3
    with pytest.raises(ValueError, match=r"unknown configuration.*'bogus'.*choose from"):
        config_names(["bogus"])
    with pytest.raises(ValueError, match="positive"):
        config_names(["auto"], budgets=[0.0])


def test_budget_below_floor_is_reported_in_its_row() -> None:
    rows = run_training_bench("mnist", batch_size=4, configs=["budget"], steps=1, warmup=0, memory_rounds=0,
                              budgets=[0.01], use_compile=False, progress=False)
    assert [r.config for r in rows] == ["eager", "convert auto budget=0.01"]
    bad = rows[1]
    assert bad.note.startswith("failed: ValueError") and "memory_budget" in bad.note
    assert bad.median_ms is None and bad.time_ratio is None
    assert rows[0].median_ms is not None


def test_bad_spec_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown model source 'nosuch'"):
        run_training_bench("nosuch:bad-name", batch_size=2, steps=1, use_compile=False, progress=False)
    with pytest.raises(ValueError, match="needs input_shape"):
        run_training_bench("mine", model=nn.Linear(2, 2), use_compile=False, progress=False)
    with pytest.raises(ValueError, match="steps >= 1"):
        run_training_bench("mnist", batch_size=2, steps=0, use_compile=False, progress=False)
    with pytest.raises(ValueError, match="unknown model source"):  # convbn.cli.main prints it as one line, exit 2
        main_training(_parse(["--model", "nosuch:bad-name", "--no-progress"]))


def test_outputs_written(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    js, png = tmp_path / "rows.json", tmp_path / "plot.png"
    args = _parse(["--model", "mnist", "--batch-size", "4", "--steps", "1", "--warmup", "0", "--memory-rounds", "1",
                   "--no-compile", "--configs", "eager,tutorial", "--no-progress",
                   "--json", str(js), "--plot", str(png), "--markdown"])
    assert main_training(args) == 0
    out = capsys.readouterr().out
    assert "| model | config |" in out and "convert recompute_conv (tutorial)" in out
    data = json.loads(js.read_text())
    assert [d["config"] for d in data] == ["eager", "convert recompute_conv (tutorial)"]
    assert data[1]["saved_ratio"] < 1 and data[0]["device"] == "cpu"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_and_json_helpers(mnist_rows: List[TrainingRow], tmp_path) -> None:
    md = rows_to_markdown(mnist_rows).splitlines()
    assert len(md) == 2 + len(mnist_rows) and md[0].startswith("| model | config |")
    assert len(json.loads(rows_to_json(mnist_rows))) == len(mnist_rows)
    write_plot(mnist_rows, str(tmp_path / "p.png"))
    write_plot(mnist_rows, str(tmp_path / "q.png"), x="saved")
    assert (tmp_path / "p.png").stat().st_size > 1000 and (tmp_path / "q.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="x must be"):
        write_plot(mnist_rows, str(tmp_path / "r.png"), x="peak")


class _Block(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.layer1 = nn.Sequential(_Block(), _Block())
        self.blocks = nn.ModuleList([_Block()])
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(self.stem(x))
        for b in self.blocks:
            x = b(x)
        return self.act(x)


def test_find_blocks_uses_top_level_containers_then_falls_back() -> None:
    assert find_blocks(_Net()) == ["layer1.0", "layer1.1", "blocks.0"]
    assert find_blocks(nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU(), nn.Linear(1, 1))) == ["0", "2"]
    from convbn.bench.models import MNISTNet

    assert find_blocks(MNISTNet()) == ["conv1", "bn1", "conv2", "bn2", "fc1", "fc2"]


def test_checkpoint_blocks_same_params_and_results() -> None:
    torch.manual_seed(0)
    net = _Net()
    ck = checkpoint_blocks(copy.deepcopy(net))
    assert isinstance(ck.layer1[0], CheckpointBlock) and isinstance(ck.blocks[0], CheckpointBlock)
    assert not isinstance(ck.stem, CheckpointBlock)
    assert [n for n, _ in ck.named_parameters()][2] == "layer1.0.block.0.weight"
    x = torch.randn(2, 3, 5, 5)
    a, b = net(x), ck(x)
    torch.testing.assert_close(a, b)
    a.sum().backward()
    b.sum().backward()
    for p, q in zip(net.parameters(), ck.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(ValueError, match="found no block"):
        checkpoint_blocks(nn.ReLU())
    with pytest.raises(ValueError, match="not a submodule"):
        checkpoint_blocks(_Net(), ["layer9.0"])


def _compile_works() -> bool:
    try:
        import torch._inductor  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.mark.skipif(not _compile_works(), reason="torch.compile (inductor) does not import here")
def test_compile_budgets_on_a_tiny_model() -> None:
    """Each budget gets its own compiled graph and saved_tensors_hooks see what it keeps.

    Compiles twice on a tiny network: a few seconds with a warm inductor cache, up to a
    minute cold (run however long it takes: whether it runs depends on no clock).
    """
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    rows = run_training_bench("tiny", batch_size=4, configs=["compile"], steps=1, warmup=0, memory_rounds=0,
                              compile_budgets=[1.0, 0.1], progress=False, model=net, input_shape=(3, 8, 8))
    if any(r.note.startswith("failed") for r in rows):
        pytest.skip(f"torch.compile failed here: {[r.note for r in rows]}")
    by = {r.config: r for r in rows}
    full, low = by["torch.compile budget=1"], by["torch.compile budget=0.1"]
    assert full.saved_bytes and low.saved_bytes and low.saved_bytes < full.saved_bytes
    assert low.activation_bytes < full.activation_bytes
    assert full.max_out_diff < 1e-4 and full.max_grad_diff < 1e-3
    assert low.max_out_diff < 1e-4 and low.max_grad_diff < 1e-3



def test_settings_value_runs_as_the_keyword_call() -> None:
    """run_training_bench takes one frozen TrainingBenchSettings, or its fields as before."""
    import dataclasses

    from convbn.bench.training_settings import TrainingBenchSettings

    fields = dict(batch_size=4, configs=["budget"], steps=1, warmup=0, memory_rounds=0, budgets=[0.01],
                  use_compile=False, progress=False)
    settings = TrainingBenchSettings("mnist", **fields)
    by_value = run_training_bench(settings)
    by_keyword = run_training_bench("mnist", **fields)
    assert [r.config for r in by_value] == [r.config for r in by_keyword] == ["eager", "convert auto budget=0.01"]
    assert by_value[0].saved_bytes == by_keyword[0].saved_bytes and by_value[0].peak_bytes == by_keyword[0].peak_bytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError, match="no other arguments"):
        run_training_bench(settings, steps=2)
    with pytest.raises(TypeError):  # budgets and what follows are keyword-only, as before
        TrainingBenchSettings("mnist", 4, None, 1, 0, "cpu", torch.float32, None, [0.5])
