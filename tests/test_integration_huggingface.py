"""Hugging Face: ``transformers.Trainer`` and ``accelerate`` with a converted model built from its
config (no download). The recipe: ``convbn.convert`` the model before the Trainer or
``Accelerator.prepare`` gets it. Checked: losses and final state as the unconverted twin's,
every BatchNorm fused and the fused path run, ``save_pretrained`` / ``from_pretrained`` both
ways, and ``convbn.fused_modules`` seeing through accelerate's mixed-precision forward."""
import copy

import pytest
import torch
import torch.nn.functional as F

import convbn
import convbn.integrations
from fusion_checks import assert_chain_ran, assert_fused, fused_chains
from integration_helpers import assert_close_losses, assert_same_state, dataset, small_net
from zoo import import_torchvision_without_fake_kernels

try:  # transformers' image models import torchvision: through the helper (see tests/zoo.py)
    import_torchvision_without_fake_kernels()
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import ResNetConfig, ResNetForImageClassification, Trainer, TrainingArguments
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"transformers / accelerate do not import here: {type(exc).__name__}: {exc}", allow_module_level=True)

from convbn.passes.graph.graph_module import GraphForward, eager, installed  # noqa: E402

N_BN = 6  # the tiny ResNet below: stem, two basic blocks of two, one shortcut
CHAINS = 4
STEPS = 3


def _resnet(seed: int = 0) -> ResNetForImageClassification:
    torch.manual_seed(seed)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type="basic", num_labels=3)
    return ResNetForImageClassification(config)


class _Images(torch.utils.data.Dataset):
    """A tiny random image-classification set in the format Trainer's default collator stacks."""

    def __init__(self, n: int = 12) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


class _RecordingTrainer(Trainer):
    """Keeps every training loss unrounded (Trainer's logs average and round them)."""

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        self.losses.append((out[0] if return_outputs else out).item())
        return out


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Trainer and Accelerator share accelerate's process-wide state (mixed precision ...): reset it."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _train(model, tmp_path, name: str) -> _RecordingTrainer:
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=0.05, optim="sgd", use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = _RecordingTrainer(model=model, args=args, train_dataset=_Images())
    trainer.losses = []
    trainer.train()
    return trainer


def _logits(model, x):
    with torch.no_grad():
        return model(pixel_values=x).logits


def test_trainer_trains_a_converted_model_like_its_unconverted_twin(tmp_path):
    converted = convbn.convert(_resnet())
    assert_fused(converted, pairs=N_BN, chains=CHAINS, skipped=0)  # every BatchNorm fused
    trainer = _train(converted, tmp_path, "convbn")
    ref = _train(_resnet(), tmp_path, "eager")
    assert trainer.model is converted and len(trainer.losses) == STEPS
    assert trainer.losses == ref.losses, (trainer.losses, ref.losses)  # identical, step by step
    assert_same_state(converted.state_dict(), ref.model.state_dict())
    probe = copy.deepcopy(converted).train()  # a copy: the probe's forward must not move running stats
    assert_chain_ran(probe(pixel_values=torch.randn(2, 3, 32, 32)).logits, calls=CHAINS)


def test_save_pretrained_of_a_converted_model_loads_into_a_plain_one(tmp_path):
    converted = convbn.convert(_resnet())
    _train(converted, tmp_path, "convbn")  # running statistics and weights moved
    converted.save_pretrained(str(tmp_path / "saved"))
    plain = ResNetForImageClassification.from_pretrained(str(tmp_path / "saved"))
    assert type(plain) is ResNetForImageClassification and not any(True for _ in convbn.fused_modules(plain))
    saved, loaded = converted.state_dict(), plain.state_dict()
    assert set(saved) == set(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(_logits(plain.eval(), x), _logits(converted.eval(), x), rtol=1e-6, atol=1e-6)


def test_a_plain_models_save_loads_into_a_model_that_is_then_converted(tmp_path):
    plain = _resnet()
    _train(plain, tmp_path, "eager")
    plain.save_pretrained(str(tmp_path / "saved"))
    converted = convbn.convert(ResNetForImageClassification.from_pretrained(str(tmp_path / "saved")))
    assert_fused(converted, pairs=N_BN, chains=CHAINS, skipped=0)
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(_logits(converted.eval(), x), _logits(plain.eval(), x), rtol=1e-6, atol=1e-6)
    # one training step of each from the loaded weights: the same loss and gradients, the fused path ran
    a, b = copy.deepcopy(converted).train(), copy.deepcopy(plain).train()
    y = torch.tensor([0, 2, 1])
    out_a, out_b = a(pixel_values=x, labels=y), b(pixel_values=x, labels=y)
    assert_chain_ran(out_a.logits, calls=CHAINS)
    out_a.loss.backward()
    out_b.loss.backward()
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def _accelerate_steps(accelerator, model, data, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    losses, outputs = [], []
    for x, y in data[:steps]:
        out = model(x)
        outputs.append(out)
        loss = F.cross_entropy(out, y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, outputs


def _batches():
    data = dataset(24)
    return [(data.tensors[0][i:i + 4], data.tensors[1][i:i + 4]) for i in range(0, 24, 4)]


def test_accelerate_prepare_of_a_converted_resnet_trains_like_eager():
    accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(STEPS)]

    class Logits(torch.nn.Module):  # the plain training loop's view of a Hugging Face model
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def forward(self, x):
            return self.hf(pixel_values=x).logits

    converted = Logits(_resnet())
    assert convbn.integrations.convert_submodules(converted) == ["hf"]
    assert_fused(converted.hf, pairs=N_BN, chains=CHAINS, skipped=0)
    prepared, losses, outputs = _accelerate_steps(accelerator, converted, data)
    eager, ref_losses, _ = _accelerate_steps(accelerator, Logits(_resnet()), data)
    assert losses == ref_losses, (losses, ref_losses)
    assert_same_state(prepared.state_dict(), eager.state_dict())
    for out in outputs:
        assert_chain_ran(out, calls=CHAINS)


def test_fused_modules_see_through_accelerates_mixed_precision_forward():
    """accelerate replaces a prepared model's ``forward`` by a wrapper (autocast, outputs cast back to
    float32); a converted model's rewritten forward is that instance attribute, now inside the wrapper."""
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    torch.manual_seed(0)
    converted = convbn.convert(small_net())
    report = assert_fused(converted, pairs=2)
    before = [name for name, _ in convbn.fused_modules(converted)]
    rewritten = converted.__dict__["forward"]
    assert before and isinstance(rewritten, GraphForward)  # rewritten at the top
    prepared, losses, outputs = _accelerate_steps(accelerator, converted, _batches())
    wrapper = prepared.__dict__["forward"]
    assert not isinstance(wrapper, GraphForward)  # accelerate did wrap it (the premise of this test)
    assert [name for name, _ in convbn.fused_modules(prepared)] == before
    assert installed(prepared) is rewritten
    assert len(fused_chains(prepared)) == report.num_chains
    for out in outputs:  # the fused path ran under the wrapper, whose float32 cast still applies
        assert out.dtype == torch.float32
        assert_chain_ran(out)
    assert prepared.__dict__["forward"] is wrapper  # convbn's first-call check left accelerate's wrapper in place
    torch.manual_seed(0)
    eager, ref_losses, _ = _accelerate_steps(accelerator, small_net(), _batches())
    # bf16 rounds conv outputs to 8 bits of mantissa: the runs agree to bf16's resolution
    assert_close_losses(losses, ref_losses, rtol=2e-2)
    assert_same_state(prepared.state_dict(), eager.state_dict(), rtol=2e-2, atol=2e-2)


def test_running_a_prepared_model_as_eager_puts_accelerates_wrapper_back():
    """convbn's checks run a model as it was (its own forward) for a moment; the forward a wrapper
    was set around comes back as the wrapper, not as the bare rewritten forward."""
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    torch.manual_seed(0)
    prepared = accelerator.prepare(convbn.convert(small_net(), example_inputs=torch.randn(2, 3, 8, 8)))
    wrapper, x = prepared.__dict__["forward"], torch.randn(2, 3, 8, 8)
    with eager(prepared):
        assert "forward" not in prepared.__dict__  # the class's forward: eager modules
        assert not fused_chains(prepared)
    assert prepared.__dict__["forward"] is wrapper
    out = prepared(x)
    assert out.dtype == torch.float32 and assert_chain_ran(out)
