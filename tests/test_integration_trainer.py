"""A trainer that builds the model itself (ultralytics' DetectionTrainer, YOLOv8n from its bundled
yaml, a tiny synthetic dataset on disk, no downloads): the recipe of docs/guides/trainers.md converts the model
where the trainer creates it, before its EMA, optimizer and wrappers exist, and training ends
where the same trainer without convbn ends."""
import copy
import os

import numpy as np
import pytest
import torch

from integration_helpers import assert_close_losses, assert_same_state, grad_fn_names
from zoo import import_torchvision_without_fake_kernels

try:  # ultralytics imports torchvision: through the helper (see tests/zoo.py)
    import_torchvision_without_fake_kernels()
    os.environ.setdefault("YOLO_OFFLINE", "1")
    from ultralytics.models.yolo.detect import DetectionTrainer
    from ultralytics.nn.tasks import DetectionModel
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"ultralytics does not import here: {type(exc).__name__}: {exc}", allow_module_level=True)

from convbn.integrations import convert_submodules  # noqa: E402


def _dataset(root):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(4):
            Image.fromarray((rng.random((32, 32, 3)) * 255).astype("uint8")).save(root / "images" / split / f"{i}.jpg")
            (root / "labels" / split / f"{i}.txt").write_text("0 0.5 0.5 0.4 0.4\n")
    (root / "data.yaml").write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n  0: thing\n")
    return root / "data.yaml"


def _train(tmp_path, data, convert):
    converted = []

    class Trainer(DetectionTrainer):
        def get_model(self, cfg=None, weights=None, verbose=True):
            model = super().get_model(cfg, weights, verbose=False)
            if convert:  # the recipe: the layers of the Sequential the model iterates, as it is built
                converted.extend(convert_submodules(model.model))
            return model

        # validation runs NMS, a torchvision compiled op this CPU-only torch lacks; saving needs polars
        def validate(self):
            return {}, 0.0

        def final_eval(self):
            pass

        def save_model(self):
            pass

    trainer = Trainer(overrides=dict(model="yolov8n.yaml", data=str(data), epochs=2, imgsz=32, batch=2, device="cpu",
                                     workers=0, plots=False, amp=False, val=False, seed=0, deterministic=True,
                                     project=str(tmp_path / "runs"), name="convbn" if convert else "eager",
                                     exist_ok=True, verbose=False))
    losses = []
    trainer.add_callback("on_train_batch_end", lambda tr: losses.append(tr.loss.item()))
    trainer.train()
    return trainer, losses, converted


def test_ultralytics_trainer_with_the_recipe_trains_like_eager(tmp_path):
    data = _dataset(tmp_path / "data")
    trainer, losses, converted = _train(tmp_path, data, convert=True)
    ref, ref_losses, _ = _train(tmp_path, data, convert=False)
    model = trainer.model
    assert len(converted) >= 10  # every Conv / C2f / SPPF / Detect layer holding a BatchNorm
    pairs = sum(len(m.convbn_report.pairs) for m in model.model if getattr(m, "convbn_report", None) is not None)
    assert pairs >= 50, pairs
    probe = copy.deepcopy(model).train()
    leaves = [t for t in torch.utils._pytree.tree_leaves(probe(torch.randn(2, 3, 32, 32))) if torch.is_tensor(t)]
    assert any("Chain" in n for n in grad_fn_names(sum(t.float().sum() for t in leaves)))
    # the trainer built its optimizer and EMA after the conversion: they hold the converted layers
    opt_params = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in model.parameters()}
    assert_close_losses(losses, ref_losses)
    assert_same_state(model.state_dict(), ref.model.state_dict())
    assert_same_state(trainer.ema.ema.state_dict(), ref.ema.ema.state_dict())
    # the trained weights are a checkpoint for the plain model: same keys, strict load
    plain = DetectionModel("yolov8n.yaml", nc=1, verbose=False)
    plain.load_state_dict(model.state_dict())
