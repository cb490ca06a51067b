"""The ``convbn`` command line: subcommands, mode dispatch of ``bench``, bad options."""
import pytest

from convbn.cli import load_commands, main


def test_commands_registered():
    assert [c.name for c in load_commands()] == ["demo", "bench"]


def test_bench_training_mode_runs(capsys):
    code = main(["bench", "--model", "mnist", "--batch-size", "8", "--steps", "1", "--warmup", "0",
                 "--memory-rounds", "1", "--no-compile", "--configs", "eager,auto", "--no-progress", "--markdown"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| mnist | convert auto |" in out and "\\|Δout\\|" in out


def test_bench_inference_mode_runs(capsys):
    code = main(["bench", "--inference", "--models", "mnist", "--batch-size", "2", "--repeats", "1",
                 "--warmup", "0", "--no-progress"])
    assert code == 0
    assert "convbn.fold" in capsys.readouterr().out


def test_unknown_option_is_an_error_for_commands_without_modes(capsys):
    with pytest.raises(SystemExit) as err:
        main(["demo", "--no-such-flag"])
    assert err.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_bench_mode_rejects_unknown_option(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--inference", "--no-such-flag"])
    assert "--no-such-flag" in capsys.readouterr().err


def test_inference_and_ddp_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--inference", "--ddp", "2"])
    assert "not allowed with" in capsys.readouterr().err
