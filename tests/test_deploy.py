"""Deployment: fold -> ONNX -> ONNX Runtime and fold -> torch.export with one dynamic batch dimension,
on real MONAI networks (classification, segmentation with transposed convs, 3-D), and
``--checkpoint`` for the commands (a state_dict or a training loop's checkpoint dict)."""
import pytest
import torch
from torch import nn

import convbn
from convbn import deploy
from convbn.cli import main
from convbn.cli_model import load_checkpoint

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
nets = pytest.importorskip("monai.networks.nets")

BATCHES = (1, 7)


def _randomize_bn(model, seed=0):
    """Running statistics and affine parameters away from identity, so a missed fold shows."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.2)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model


REAL = {
    "resnet-2d-classification": (lambda: nets.ResNet("basic", (1, 1, 1, 1), (8, 16, 32, 64), spatial_dims=2,
                                                     n_input_channels=3, num_classes=5), (3, 32, 32)),
    "densenet-2d-classification": (lambda: nets.DenseNet(2, 3, 5, init_features=8, growth_rate=4,
                                                         block_config=(2, 2)), (3, 32, 32)),
    "unet-2d-segmentation": (lambda: nets.UNet(2, 1, 2, channels=(8, 16, 32), strides=(2, 2), norm="batch"),
                             (1, 32, 32)),
    "unet-3d-segmentation": (lambda: nets.UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), norm="batch"),
                             (1, 16, 16, 16)),
    "basicunet-2d-segmentation": (lambda: nets.BasicUNet(2, 1, 2, features=(4, 4, 8, 8, 16, 4), norm="batch"),
                                  (1, 32, 32)),
    "segresnet-3d-segmentation": (lambda: nets.SegResNet(3, init_filters=4, in_channels=1, out_channels=2,
                                                         norm="batch", blocks_down=(1, 1), blocks_up=(1,),
                                                         upsample_mode="deconv"), (1, 16, 16, 16)),
}


@pytest.mark.parametrize("name", list(REAL))
def test_fold_onnx_onnxruntime_dynamic_batch_on_real_models(tmp_path, name):
    build, shape = REAL[name]
    torch.manual_seed(0)
    model = _randomize_bn(build().eval())
    n_bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    folded = convbn.fold(model, example_inputs=torch.randn(2, *shape))
    report = folded.fold_report
    n_folded = sum(o.result == "folded" for o in report.outcomes)
    assert n_folded >= 1 and n_folded + sum(o.result == "left" for o in report.outcomes) == n_bn
    path = str(tmp_path / "m.onnx")
    deploy.save_onnx(folded, torch.randn(2, *shape), path)  # ONE export ...
    graph = onnx.load(path).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("BatchNormalization") == n_bn - n_folded  # folded BatchNorms are gone from the graph
    if "segmentation" in name:
        assert "ConvTranspose" in ops
    dim = graph.input[0].type.tensor_type.shape.dim[0]
    assert dim.dim_param and not dim.dim_value  # a named, dynamic batch dimension
    inputs = [torch.randn(b, *shape) for b in BATCHES]  # ... run at batch 1 and 7
    errors = deploy.check_onnx(path, model, inputs)  # against the ORIGINAL model, BatchNorms and all
    assert max(errors) < 1e-5, errors


def test_cli_fold_save_onnx_checks_batch_1_and_7(tmp_path, capsys):
    path = tmp_path / "mnist.onnx"
    assert main(["fold", "mnist", "--save-onnx", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"written to {path}; ONNX Runtime at batch 1, 7" in out
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b in (1, 3):
        (y,) = session.run(None, {"input": torch.randn(b, 1, 28, 28).numpy()})
        assert y.shape == (b, 10)


def test_cli_fold_save_export_has_a_dynamic_batch(tmp_path, capsys):
    """Exported with the default batch of 2, the program runs at 4 (a fixed batch failed a guard here)."""
    path = tmp_path / "m.pt2"
    assert main(["fold", "mnist", "--batch-size", "2", "--save-export", str(path)]) == 0
    program = torch.export.load(str(path))
    for b in (1, 4, 7):
        assert program.module()(torch.randn(b, 1, 28, 28)).shape == (b, 10)


def test_export_from_a_batch_of_one_is_still_dynamic(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(1)).eval()
    _randomize_bn(model)
    folded = convbn.fold(model)
    program = deploy.export_program(folded, torch.randn(1, 3, 8, 8))
    errors = deploy.check_program(program, model, [torch.randn(b, 3, 8, 8) for b in (1, 5)])
    assert max(errors) < 1e-5


def _trained_mnist(seed=1):
    from convbn.bench.models import MNISTNet

    torch.manual_seed(seed)
    return _randomize_bn(MNISTNet(), seed)


@pytest.mark.parametrize("wrap", ["plain", "lightning", "ddp-in-dict", "ema"])
def test_checkpoint_formats_load_into_the_spec_model(tmp_path, wrap):
    trained = _trained_mnist()
    sd = trained.state_dict()
    obj = {
        "plain": sd,
        "lightning": {"epoch": 3, "global_step": 10, "state_dict": {f"model.{k}": v for k, v in sd.items()}},
        "ddp-in-dict": {"model": {f"module.{k}": v for k, v in sd.items()}, "optimizer": {"state": {}}},
        "ema": {"ema": sd, "epoch": 1},
    }[wrap]
    path = tmp_path / "ckpt.pt"
    torch.save(obj, path)
    from convbn.bench.models import MNISTNet

    fresh = MNISTNet()
    load_checkpoint(fresh, str(path))
    for k, v in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_cli_fold_with_checkpoint_folds_the_trained_weights(tmp_path, capsys):
    trained = _trained_mnist().eval()
    ckpt, state = tmp_path / "ckpt.pt", tmp_path / "folded.pt"
    torch.save({"state_dict": trained.state_dict(), "epoch": 2}, ckpt)
    assert main(["fold", "mnist", "--checkpoint", str(ckpt), "--save-state", str(state)]) == 0
    expected = convbn.fold(trained).state_dict()
    got = torch.load(state)
    assert set(got) == set(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k])


def test_cli_explain_and_bench_take_a_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "ckpt.pt"
    torch.save(_trained_mnist().state_dict(), ckpt)
    assert main(["explain", "mnist", "--checkpoint", str(ckpt)]) == 0
    assert "2 pairs fused" in capsys.readouterr().out
    assert main(["bench", "--inference", "--model", "mnist", "--checkpoint", str(ckpt), "--repeats", "1",
                 "--warmup", "0", "--no-progress"]) == 0
    assert "convbn.fold" in capsys.readouterr().out


def test_folded_state_dict_into_the_original_is_one_line_saying_why(tmp_path, capsys):
    folded_sd = tmp_path / "folded.pt"
    torch.save(convbn.fold(_trained_mnist().eval()).state_dict(), folded_sd)
    code = main(["fold", "mnist", "--checkpoint", str(folded_sd)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "missing" in err and "folded model's state_dict" in err


def test_checkpoint_that_matches_nothing_names_the_keys(tmp_path, capsys):
    path = tmp_path / "other.pt"
    torch.save({"optimizer": {"lr": 0.1}}, path)
    code = main(["explain", "mnist", "--checkpoint", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "holds no state_dict" in err and "optimizer" in err


def test_missing_checkpoint_file_is_one_line(tmp_path, capsys):
    try:
        code = main(["explain", "mnist", "--checkpoint", str(tmp_path / "nope.pt")])
    except SystemExit as exc:  # checked while parsing, before the model is built
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nope.pt" in err, err
