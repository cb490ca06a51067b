"""Deployment: fold -> ONNX -> ONNX Runtime and fold -> torch.export with one dynamic batch dimension,
on real MONAI networks (classification, segmentation with transposed convs, 3-D); one
self-contained ``.onnx`` file; dynamic spatial dimensions checked at two sizes; and
``--checkpoint`` for the commands (a state_dict or a training loop's checkpoint dict)."""
import os
import shutil

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
    report = folded.convbn_report
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


# --------------------------------------------------------------------------- a file a user can ship


def _audio_net():
    """A 1-d audio-like classifier: strided Conv1d + BatchNorm + ReLU blocks, global pooling, a head."""
    torch.manual_seed(0)
    return _randomize_bn(nn.Sequential(
        nn.Conv1d(1, 8, 9, stride=2, padding=4), nn.BatchNorm1d(8), nn.ReLU(),
        nn.Conv1d(8, 16, 5, stride=2, padding=2), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Conv1d(16, 16, 3, padding=1), nn.BatchNorm1d(16), nn.ReLU(),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(16, 4))).eval()


def _unet_2d():
    torch.manual_seed(0)
    return _randomize_bn(nets.BasicUNet(2, 1, 2, features=(4, 4, 8, 8, 16, 4), norm="batch").eval())


# name: (model, the example's shape, a second shape to run at)
SPATIAL = {
    "audio-1d-length-400-then-333": (_audio_net, (2, 1, 400), (3, 1, 333)),
    "unet-2d-64x64-then-48x80": (_unet_2d, (2, 1, 64, 64), (1, 1, 48, 80)),
}


def _folded(model, shape):
    n_bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    folded = convbn.fold(model, example_inputs=torch.randn(*shape))
    assert sum(o.result == "folded" for o in folded.convbn_report.outcomes) == n_bn  # every BatchNorm folded
    return folded


def _ort_run(path, x):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"input": x.numpy()})
    return torch.from_numpy(y)


def test_save_onnx_writes_one_file_that_runs_after_moving_it(tmp_path):
    model = _audio_net()
    folded = _folded(model, (2, 1, 400))
    path = tmp_path / "out" / "audio.onnx"
    path.parent.mkdir()
    files = deploy.save_onnx(folded, torch.randn(2, 1, 400), str(path))
    assert files == [str(path)] and os.listdir(path.parent) == ["audio.onnx"]  # no audio.onnx.data beside it
    shipped = tmp_path / "elsewhere" / "model.onnx"
    shipped.parent.mkdir()
    shutil.move(str(path), shipped)
    shutil.rmtree(path.parent)
    x = torch.randn(5, 1, 400)
    with torch.no_grad():
        torch.testing.assert_close(_ort_run(shipped, x), folded(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_ort_run(shipped, x), model(x), rtol=1e-4, atol=1e-5)


def test_weights_past_the_single_file_limit_go_to_a_data_file_it_names(tmp_path, monkeypatch):
    monkeypatch.setattr(deploy, "SINGLE_FILE_BYTES", 1000)  # this model's weights are ~3 kB
    model = _audio_net()
    folded = _folded(model, (2, 1, 400))
    path = tmp_path / "big.onnx"
    files = deploy.save_onnx(folded, torch.randn(2, 1, 400), str(path))
    assert len(files) == 2 and files[0] == str(path) and os.path.dirname(files[1]) == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(f) for f in files)
    weights = onnx.load(str(path), load_external_data=False).graph.initializer
    convs = [w for w in weights if w.name in ("0.weight", "3.weight", "6.weight")]  # (tiny tensors stay inline)
    assert len(convs) == 3 and all(w.data_location == onnx.TensorProto.EXTERNAL for w in convs)  # in the data file
    x = torch.randn(2, 1, 400)
    with torch.no_grad():
        torch.testing.assert_close(_ort_run(path, x), folded(x), rtol=1e-5, atol=1e-5)


def test_cli_save_onnx_is_one_file_and_names_the_data_file_past_the_limit(tmp_path, capsys, monkeypatch):
    one = tmp_path / "one"
    one.mkdir()
    assert main(["fold", "mnist", "--save-onnx", str(one / "m.onnx")]) == 0
    assert os.listdir(one) == ["m.onnx"] and ".data" not in capsys.readouterr().out
    monkeypatch.setattr(deploy, "SINGLE_FILE_BYTES", 1000)
    assert main(["fold", "mnist", "--save-onnx", str(tmp_path / "big.onnx")]) == 0
    data = sorted(set(os.listdir(tmp_path)) - {"one", "big.onnx"})
    assert len(data) == 1, data
    out = capsys.readouterr().out
    assert f"written to {tmp_path / 'big.onnx'} and its weights to {tmp_path / data[0]}" in out, out


@pytest.mark.parametrize("name", list(SPATIAL))
def test_dynamic_spatial_onnx_runs_at_two_sizes(tmp_path, name):
    build, shape, other = SPATIAL[name]
    model = build()
    folded = _folded(model, shape)
    static, dynamic = tmp_path / "batch-only.onnx", tmp_path / "spatial.onnx"
    deploy.save_onnx(folded, torch.randn(*shape), str(static))  # the default: only the batch is dynamic
    assert deploy.save_onnx(folded, torch.randn(*shape), str(dynamic), dynamic_axes=("batch", "spatial")) \
        == [str(dynamic)]
    dims = onnx.load(str(dynamic)).graph.input[0].type.tensor_type.shape.dim
    assert [bool(d.dim_param) for d in dims] == [True, False] + [True] * (len(shape) - 2)
    for size in (shape, other):
        x = torch.randn(*size)
        with torch.no_grad():
            want, original = folded(x), model(x)
        torch.testing.assert_close(_ort_run(dynamic, x), want, rtol=1e-5, atol=1e-5)
        assert max(deploy.check_onnx(str(dynamic), model, [x])) < 1e-5  # against the unfolded model too
    with pytest.raises(Exception, match="(?i)dimension"):  # the test can fail: without the flag, the size is fixed
        _ort_run(static, torch.randn(*other))


@pytest.mark.parametrize("name", list(SPATIAL))
def test_dynamic_spatial_torch_export_runs_at_two_sizes(name):
    build, shape, other = SPATIAL[name]
    model = build()
    folded = _folded(model, shape)
    program = deploy.export_program(folded, torch.randn(*shape), dynamic_axes="batch,spatial")
    inputs = [torch.randn(*shape), torch.randn(*other)]
    assert max(deploy.check_program(program, folded, inputs)) < 1e-5
    assert max(deploy.check_program(program, model, inputs)) < 1e-5
    batch_only = deploy.export_program(folded, torch.randn(*shape))
    with pytest.raises(Exception, match="(?i)expected|guard|size"):
        batch_only.module()(torch.randn(*other))


def test_a_model_that_fixes_its_spatial_size_says_so():
    model = nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 50, 2)).eval()
    folded = _folded(model, (2, 1, 50))
    with pytest.raises(ValueError, match=r"dynamic batch and spatial dimensions failed.*size\(\)\[2\].*spatial size"):
        deploy.export_program(folded, torch.randn(2, 1, 50), dynamic_axes=("batch", "spatial"))


@pytest.mark.parametrize("bad, match", [("height", "'height'"), (["batch", "time"], "'time'"), (3, "int")])
def test_dynamic_axes_takes_batch_and_spatial_only(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        deploy.save_onnx(nn.Conv1d(1, 1, 1).eval(), torch.randn(2, 1, 8), "never-written.onnx", dynamic_axes=bad)
    assert not os.path.exists("never-written.onnx")


def test_cli_dynamic_axes_spatial_checks_a_second_size(tmp_path, capsys, monkeypatch):
    (tmp_path / "audionets_deploy.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Conv1d(1, 8, 9, stride=2, padding=4), nn.BatchNorm1d(8), nn.ReLU(),\n"
        "                         nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    onnx_path, pt2 = tmp_path / "a.onnx", tmp_path / "a.pt2"
    assert main(["fold", "audionets_deploy:build", "--input-shape", "2x1x400", "--dynamic-axes", "batch,spatial",
                 "--save-onnx", str(onnx_path), "--save-export", str(pt2)]) == 0
    out = capsys.readouterr().out
    assert "(opset 18, dynamic batch and spatial) written to" in out and "batch 1, 7 and size 416" in out, out
    assert _ort_run(onnx_path, torch.randn(3, 1, 333)).shape == (3, 4)
    assert torch.export.load(str(pt2)).module()(torch.randn(3, 1, 333)).shape == (3, 4)
    with pytest.raises(SystemExit) as exit_:
        main(["fold", "mnist", "--dynamic-axes", "batch,height"])
    assert exit_.value.code == 2 and "--dynamic-axes" in capsys.readouterr().err
