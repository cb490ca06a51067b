"""MONAI's ``SupervisedTrainer`` (an ignite engine) and timm's ``ModelEmaV3`` with a converted
network: each fits a few steps, resumes from a checkpoint and ends where the same loop
without convbn ends (losses, weights, running statistics, the EMA copy's weights and outputs)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import convbn
from integration_helpers import assert_close_losses, assert_fused_path_runs, assert_same_state, dataset, small_net
from zoo import timm_or_skip


# --------------------------------------------------------------------------- MONAI SupervisedTrainer

def _monai_run(convert: bool, tmp_path, epochs: int, resume_from=None):
    engines = pytest.importorskip("monai.engines")
    pytest.importorskip("ignite")
    torch.manual_seed(0)
    net = small_net()
    if convert:
        net = convbn.convert(net)  # the bare network, before the optimizer and the engine see it
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    if resume_from is not None:
        state = torch.load(resume_from, weights_only=True)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
    data = [{"image": x, "label": y} for x, y in dataset(16)]
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    trainer = engines.SupervisedTrainer(device=torch.device("cpu"), max_epochs=epochs, train_data_loader=loader,
                                        network=net, optimizer=opt, loss_function=F.cross_entropy)
    losses = []
    from ignite.engine import Events

    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(float(e.state.output[0]["loss"])))
    trainer.run()
    path = tmp_path / f"monai-{'convbn' if convert else 'eager'}.pt"
    torch.save({"net": net.state_dict(), "opt": opt.state_dict()}, path)
    return net, losses, path


def test_monai_supervised_trainer_fits_and_resumes_like_eager(tmp_path):
    net, losses, ckpt = _monai_run(True, tmp_path, epochs=1)
    ref, ref_losses, ref_ckpt = _monai_run(False, tmp_path, epochs=1)
    assert_fused_path_runs(net, pairs=2)
    assert_close_losses(losses, ref_losses)
    assert_same_state(net.state_dict(), ref.state_dict())
    net2, losses2, _ = _monai_run(True, tmp_path, epochs=1, resume_from=ckpt)
    ref2, ref_losses2, _ = _monai_run(False, tmp_path, epochs=1, resume_from=ref_ckpt)
    assert_close_losses(losses2, ref_losses2)
    assert losses2 != losses  # the resumed run started from the checkpoint, not from scratch
    assert_same_state(net2.state_dict(), ref2.state_dict())


# --------------------------------------------------------------------------- timm ModelEmaV3

def _ema_run(convert: bool, steps: int = 6):
    timm = timm_or_skip()
    from timm.utils import ModelEmaV3

    torch.manual_seed(0)
    net = small_net()
    if convert:
        net = convbn.convert(net)  # before the EMA copy is made: the copy is converted too
    ema = ModelEmaV3(net, decay=0.9)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step, (x, y) in zip(range(steps), torch.utils.data.DataLoader(dataset(24), batch_size=4)):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        ema.update(net, step=step)
        losses.append(loss.item())
    assert timm is not None
    return net, ema, losses


def test_timm_model_ema_v3_of_a_converted_model_updates_and_evaluates_like_eager(tmp_path):
    net, ema, losses = _ema_run(True)
    ref, ref_ema, ref_losses = _ema_run(False)
    assert_fused_path_runs(net, pairs=2)
    assert_fused_path_runs(ema.module, pairs=2)  # the EMA copy is a converted model of its own
    assert all(p is not q for p, q in zip(ema.module.parameters(), net.parameters()))
    assert_close_losses(losses, ref_losses)
    assert_same_state(net.state_dict(), ref.state_dict())
    assert_same_state(ema.module.state_dict(), ref_ema.module.state_dict())  # EMA weights and running stats
    ema.module.eval()
    ref_ema.module.eval()
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(ema.module(x), ref_ema.module(x), rtol=1e-5, atol=1e-6)
    # the EMA copy checkpoints under the model's own keys and loads into the plain network
    path = tmp_path / "ema.pt"
    torch.save({"state_dict_ema": ema.module.state_dict()}, path)
    from convbn.cli_model import load_checkpoint

    plain = small_net().eval()
    load_checkpoint(plain, str(path))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), ref_ema.module(x), rtol=1e-5, atol=1e-6)
