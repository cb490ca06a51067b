"""PyTorch Lightning with :class:`convbn.integrations.lightning.ConvertCallback`: a real Trainer fits
a converted model, resumes from its checkpoint, runs bf16-mixed and DDP (gloo, 2 processes),
and ends where the same runs without convbn end (losses, weights, running statistics)."""
import copy
import os

import pytest
import torch
import torch.nn.functional as F

from integration_helpers import (assert_close_losses, assert_fused_path_runs, assert_same_state, dataset, grad_fn_names,
                                 small_net)
from zoo import import_torchvision_without_fake_kernels

try:  # Lightning imports torchmetrics, which imports torchvision: through the helper (see tests/zoo.py)
    import_torchvision_without_fake_kernels()
    import lightning.pytorch as pl
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"lightning does not import here: {type(exc).__name__}: {exc}", allow_module_level=True)

from convbn.integrations.lightning import ConvertCallback  # noqa: E402

LR = 0.05


class LitNet(pl.LightningModule):
    def __init__(self, seed: int = 0, probe_dir=None):
        super().__init__()
        torch.manual_seed(seed)
        self.net = small_net()
        self.losses = []
        self.probe_dir = probe_dir  # where each DDP rank writes the autograd nodes of its first step

    def on_train_start(self):
        if self.probe_dir is not None:
            nodes = grad_fn_names(copy.deepcopy(self.net)(torch.randn(2, 3, 8, 8)))  # a copy: stats stay
            (self.probe_dir / f"rank{self.global_rank}.txt").write_text(" ".join(sorted(nodes)))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def _loader():
    return torch.utils.data.DataLoader(dataset(24), batch_size=4, shuffle=False)


def _trainer(tmp_path, convert, max_steps, **kw):
    callbacks = [ConvertCallback()] if convert else []
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), **kw)


def _fit_and_resume(tmp_path, convert, **kw):
    """3 steps, save a checkpoint, a fresh module resumes from it for 3 more: losses and final state."""
    lit = LitNet()
    trainer = _trainer(tmp_path, convert, 3, **kw)
    trainer.fit(lit, _loader())
    ckpt = tmp_path / f"{'convbn' if convert else 'eager'}.ckpt"
    trainer.save_checkpoint(str(ckpt))
    resumed = LitNet(seed=123)  # other weights: the checkpoint must overwrite them
    trainer2 = _trainer(tmp_path, convert, 6, **kw)
    trainer2.fit(resumed, _loader(), ckpt_path=str(ckpt))
    return lit, resumed, trainer2



@pytest.fixture(autouse=True)
def _restore_environment():
    """Lightning's DDP strategies write MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE into this
    process's environment and leave them there; a later test in the same worker would then
    look launched by torchrun (``convbn bench --ddp`` reads them). Put the environment back."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)

def test_callback_converts_before_the_optimizer_and_resumes_like_eager(tmp_path):
    lit, resumed, trainer = _fit_and_resume(tmp_path, convert=True)
    ref_lit, ref_resumed, _ = _fit_and_resume(tmp_path, convert=False)
    assert trainer.callbacks[0].converted == ["net"]
    assert_fused_path_runs(resumed.net, pairs=2)
    # the optimizer holds the converted network's parameters (the model's own objects)
    opt_params = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in resumed.net.parameters()}
    assert_close_losses(lit.losses, ref_lit.losses)
    assert_close_losses(resumed.losses, ref_resumed.losses)  # steps 4..6, after the resume
    assert_same_state(resumed.state_dict(), ref_resumed.state_dict())
    # the checkpoint has the model's own keys: it loads into the unconverted network too
    state = torch.load(tmp_path / "convbn.ckpt", weights_only=True)["state_dict"]
    plain = LitNet(seed=5)
    plain.load_state_dict(state)
    assert_same_state(plain.state_dict(), ref_lit.state_dict())


def test_callback_bf16_mixed_matches_eager_bf16(tmp_path):
    lit, resumed, _ = _fit_and_resume(tmp_path, convert=True, precision="bf16-mixed")
    ref_lit, ref_resumed, _ = _fit_and_resume(tmp_path, convert=False, precision="bf16-mixed")
    assert_fused_path_runs(resumed.net, pairs=2)
    # bf16 rounds conv outputs to 8 bits of mantissa; convbn's fused kernels round at the same
    # points as eager's autocast, so the runs agree to bf16's resolution
    assert_close_losses(lit.losses + resumed.losses, ref_lit.losses + ref_resumed.losses, rtol=2e-2)
    assert_same_state(resumed.state_dict(), ref_resumed.state_dict(), rtol=2e-2, atol=2e-2)


def test_callback_under_ddp_two_gloo_processes(tmp_path):
    """ddp_fork: the workers inherit this process's imports (Lightning's torchvision import included)."""
    if torch.cuda.is_initialized():  # a CUDA test ran earlier in this worker
        pytest.skip("Lightning's ddp_fork cannot start once this process has initialised CUDA "
                    "(its own RNG isolation reads the CUDA RNG in the fork)")
    kw = dict(strategy="ddp_fork", devices=2)
    lit = LitNet(probe_dir=tmp_path)
    _trainer(tmp_path, True, 3, **kw).fit(lit, _loader())
    for rank in (0, 1):  # every rank trained the converted network: its forward ran the fused chain
        nodes = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert any("Chain" in n for n in nodes) and "NativeBatchNormBackward0" not in nodes, nodes
    ref = LitNet()
    _trainer(tmp_path, False, 3, **kw).fit(ref, _loader())
    # rank 0's final state comes back to this process; each rank saw its half of every batch
    assert_same_state(lit.state_dict(), ref.state_dict())
    assert not torch.equal(lit.state_dict()["net.0.weight"], LitNet().state_dict()["net.0.weight"])  # it trained


def test_sync_batchnorm_is_refused_with_the_reason(tmp_path):
    with pytest.raises(Exception, match="sync_batchnorm=True"):  # raised in a worker, re-raised here
        _trainer(tmp_path, True, 1, strategy="ddp_fork", devices=2, sync_batchnorm=True).fit(LitNet(), _loader())
