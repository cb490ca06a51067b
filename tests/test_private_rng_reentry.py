"""A check's private RNG where a random operator re-enters the dispatch mode.

``convert``'s checks draw their random numbers from generators of their own
(``convbn.functional.private_rng``). A random operator with no generator argument runs with
the private state swapped into the global generator for the call; CPU attention with dropout
(``aten._scaled_dot_product_flash_attention_for_cpu``) reaches the mode again from inside that
call. That second entry must continue the swapped-in state, not wait for the swap to end:
converting Hugging Face's RT-DETR (attention with dropout in its encoder) with
``example_inputs`` hung there. Run in a subprocess so a hang fails the test, not the run.
"""
import os
import subprocess
import sys
import textwrap

import pytest

import convbn

pytest.importorskip("transformers")

CODE = textwrap.dedent("""
    import sys, warnings
    sys.path.insert(0, {tests!r})
    from zoo import import_torchvision_without_fake_kernels
    import_torchvision_without_fake_kernels()
    import torch, convbn
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig
    torch.manual_seed(0)
    backbone = RTDetrResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                  out_features=["stage2", "stage3", "stage4"])
    config = RTDetrConfig(backbone_config=backbone, use_pretrained_backbone=False, encoder_in_channels=[32, 64, 128],
                          encoder_hidden_dim=32, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          decoder_in_channels=[32, 32, 32], decoder_layers=2, encoder_layers=1, num_queries=10,
                          num_labels=5, num_denoising=0, anchor_image_size=None)
    model = RTDetrForObjectDetection(config).train()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = convbn.convert(model, example_inputs=x)
    print("pairs", len(fast.convbn_report.pairs))
""")


@pytest.mark.expect_unfused("the conversion runs in a subprocess; it prints how many pairs it fused")
def test_convert_with_attention_dropout_in_the_model_finishes() -> None:
    tests = os.path.dirname(os.path.abspath(__file__))
    src = os.path.dirname(os.path.dirname(os.path.abspath(convbn.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    try:
        run = subprocess.run([sys.executable, "-c", CODE.format(tests=tests)], capture_output=True, text=True,
                             timeout=900, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("convert(example_inputs=...) of RT-DETR did not finish in 240 s (the check's RNG swap deadlocked)")
    assert run.returncode == 0, run.stderr[-3000:]
    pairs = int(run.stdout.split("pairs")[-1])
    assert pairs > 0, run.stdout
