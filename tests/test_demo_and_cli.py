"""The README's demo and the ``ortrain`` command, small enough for CI."""

from __future__ import annotations

import os

from ortrain.demo import DemoSettings, load_corpus, run_demo


def test_corpus_ships_with_the_package() -> None:
    assert len(load_corpus()) > 4000


def test_demo_trains_the_loss_down_and_reports_both_step_times() -> None:
    lines: list[str] = []
    settings = DemoSettings(steps=40, batch_size=8, block_size=32, d_model=32, n_layer=1, timing_steps=3)
    result = run_demo(settings, report=lines.append)
    assert result.last_loss < result.first_loss - 0.3
    assert result.ort_step_ms > 0 and result.eager_step_ms > 0
    assert any("ortrain/eager" in line for line in lines)


def test_the_command_refuses_what_it_cannot_run(tmp_path, capsys) -> None:
    """Wave 41: a mistyped cache directory listed "0 entries" and succeeded, and ``--steps 0`` or
    ``--repeats 0`` ended in a statistics traceback."""
    import pytest

    from ortrain.cli import main

    assert main(["cache", "list", "--dir", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["bench", "--quick", "--models", "mlp,nope"]) == 2  # before mlp runs
    assert "unknown model(s) nope" in capsys.readouterr().err
    for argv in (["bench", "--steps", "0"], ["bench", "--repeats", "0"], ["demo", "--steps", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "must be at least 1" in capsys.readouterr().err


def test_a_model_factory_that_cannot_be_found_is_one_line_before_anything_runs(
    tmp_path, monkeypatch, capsys
) -> None:
    """Until wave 53 a child's traceback (ModuleNotFoundError, AttributeError), exit 1."""
    from ortrain.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_models.py").write_text("def build():\n    pass\n")
    assert main(["bench", "--quick", "--models", "nosuchmod:build,mlp"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "nosuchmod:build: cannot import module 'nosuchmod'; it must be importable from the working "
        f"directory ({tmp_path}) or be installed\n"
    )
    assert main(["bench", "--quick", "--models", "my_models:nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("my_models:nosuch: module 'my_models' (") and err.count("\n") == 1
    assert err.endswith("has no factory 'nosuch'; name a function of it that returns (model, batch)\n")


def test_demo_steps_too_few_to_compare_the_loss_are_refused_and_the_help_says_why(capsys) -> None:
    """Until wave 53 ``--steps`` under 20 exited 1 without a word (the first and last 10 steps'
    windows overlap), and the help said neither its default nor its minimum."""
    import pytest

    from ortrain.cli import main

    for command, says in (
        ("demo", ["default 300", "at least 20", "default 30)"]),
        ("bench", ["model(**batch) for a dict batch"]),
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(s in text for s in says), text
    with pytest.raises(SystemExit) as exit_info:  # after the help: without it, the demo ran
        main(["demo", "--steps", "5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--steps must be at least 20: the demo compares the mean loss of the first 10 steps" in err


def test_a_bad_variable_is_a_finding_of_doctor_and_no_obstacle_to_the_cache_command(
    tmp_path, monkeypatch, capsys
) -> None:
    """Until wave 42 both ended in the variable's traceback: a user could not even clear the cache."""
    from ortrain.cli import main

    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "5")
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    assert main(["cache", "list"]) == 0
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "NO  ORTMODULE_MEMORY_OPT_LEVEL='5' is not a level" in out
    assert "training:" not in out


def test_doctor_lists_every_variable_finding_once_and_fails_on_them(monkeypatch, capsys, caplog) -> None:
    """Until wave 53 a typo alone printed "ok  none set (defaults)" above its own finding, said it
    again on standard error (the training check's ORTModule) and exited 0; a bad value beside a
    typo hid the typo."""
    import logging

    from ortrain.cli import main
    from ortrain.ortmodule import inactive_options

    monkeypatch.setattr(inactive_options, "_announced", set())
    for name in [n for n in os.environ if n.startswith("ORTMODULE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNNING", "1")
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    variables = out[out.index("ORTMODULE_* variables:") : out.index("training:")].splitlines()[1:]
    assert len(variables) == 1 and variables[0].startswith("  NO  ORTMODULE_ENABLE_TUNNING is set, but")
    assert "ok  tiny MLP" in out  # still trained: ORTModule ignores the variable
    assert not [r for r in caplog.records if "ORTMODULE_ENABLE_TUNNING is set" in r.getMessage()]
    monkeypatch.setenv("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "maybe")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "  NO  ORTMODULE_ENABLE_COMPUTE_OPTIMIZER='maybe' is not a switch; use 1 or 0\n" in out
    assert "  NO  ORTMODULE_ENABLE_TUNNING is set, but" in out
    assert "training:" not in out and "ok  set:" not in out


def test_python_dash_m_ortrain_is_the_command() -> None:
    """``python -m ortrain --help`` failed ("No module named ortrain.__main__") until wave 45."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "ortrain", "--help"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: ortrain")


def test_doctor_says_when_the_cache_directory_cannot_hold_the_cache(tmp_path, monkeypatch) -> None:
    """A path naming a file passed as "set" until wave 45 (ORTModule then ran uncached)."""
    from ortrain.doctor import cache_check

    monkeypatch.delenv("ORTMODULE_CACHE_DIR", raising=False)
    assert cache_check() is None
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    check = cache_check()
    assert check is not None and check.ok
    a_file = tmp_path / "cache.txt"
    a_file.write_text("not a directory")
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(a_file))
    check = cache_check()
    assert check is not None and not check.ok and "is not a directory" in check.detail
