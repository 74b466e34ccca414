"""The `chunkcache` command line: user errors in one line with exit status 2 (tracebacks only with
--debug), engine flags' help, and `route` without torch."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkcache.cli import main
from chunkcache.config import OPTION_CHOICES, OPTION_GROUPS, option_names
from chunkcache.engine_args import OPTION_HELP, add_engine_arguments

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--threads", "1", "--kv-cache-tokens", "1024"]


@pytest.fixture(scope="module")
def model_dir(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama")


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the command, expect exit status 2, and return its one-line error."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error" in line]  # past progress bars
    assert len(lines) == 1 and lines[0].strip().startswith("chunkcache: error: "), err
    return lines[0].strip()


def test_router_imports_no_torch() -> None:
    # A fresh interpreter: this test process has torch loaded already.
    script = (
        "import sys\n"
        "import chunkcache.router.app\n"
        "from chunkcache.cli import main\n"
        "try:\n"
        "    main(['route', '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print('heavy:', heavy)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--backends-file" in out.stdout  # the route help was printed
    assert out.stdout.strip().endswith("heavy: []"), out.stdout


def test_bad_option_values_are_one_line(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    line = _error_line(
        capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--chunk-cache-size-gb", "-1"]
    )
    assert "chunk_cache_size_gb must be >= 0" in line
    line = _error_line(
        capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--temperature", "-2"]
    )
    assert "temperature" in line
    # Refused only once the model is known: its depth bounds the check layers (of blend: offset).
    argv = ["generate", "--model", str(model_dir), "--prompt", "hi", "--blend-check-layers", "99", *TINY]
    argv += ["--chunk-layout", "offset"]
    assert "out of range" in _error_line(capsys, argv)


def test_missing_model_and_files_are_one_line(
    capsys: pytest.CaptureFixture[str], model_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-model"
    line = _error_line(capsys, ["generate", "--model", str(missing), "--prompt", "hi"])
    assert str(missing) in line
    prompts = tmp_path / "prompts.jsonl"
    line = _error_line(capsys, ["eval", "--model", str(model_dir), "--prompts", str(prompts), *TINY])
    assert "No such file or directory" in line and str(prompts) in line
    bad = tmp_path / "docs.jsonl"
    bad.write_text("{not json\n")
    argv = [
        "prewarm",
        "--model",
        str(model_dir),
        "--documents",
        str(bad),
        "--chunk-cache-disk-dir",
        str(tmp_path),
    ]
    assert f"{bad}:1: not JSON" in _error_line(capsys, argv)
    bad.write_text(json.dumps({"system": "s", "documents": ["d"]}) + "\n")
    line = _error_line(capsys, ["prewarm", "--model", str(model_dir), "--documents", str(bad)])
    assert "--chunk-cache-disk-dir" in line
    line = _error_line(capsys, ["route", "--tokenizer", str(model_dir), "--model-name", "m"])
    assert "give --backends" in line


@pytest.mark.slow  # two interpreters that import torch
def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    argv = ["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi", "--chunk-layout", "offset"]
    with pytest.raises(Exception, match="nope"):
        main([*argv, "--debug"])
    with pytest.raises(Exception, match="nope"):
        main(["--debug", *argv])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "chunkcache.cli", *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    out = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "Traceback" in out.stderr and "ModelLoadError" in out.stderr


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the user's mistakes are shortened: anything else propagates as it is.
    import chunkcache.cli as cli

    def broken(args: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "run_generate", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["generate", "--prompt", "hi"])


def test_generate_still_runs(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    assert (
        main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--prompt",
                "hi",
                "--max-tokens",
                "3",
                "--ignore-eos",
                "--json",
                *TINY,
            ]
        )
        == 0
    )
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["completion_tokens"] == 3


def test_engine_flags_are_grouped_by_what_they_serve(capsys: pytest.CaptureFixture[str]) -> None:
    """Every engine option is in exactly one group, and `--help` shows one section per group, each
    option under its own; a default that depends on the model names the known models' own."""
    grouped = [name for names in OPTION_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(option_names())
    assert list(OPTION_GROUPS) == ["model", "memory", "scheduling", "reuse", "fidelity", "server"]
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = capsys.readouterr().out
    starts = [help_text.index(f"\n{group} options:") for group in OPTION_GROUPS]
    assert starts == sorted(starts)
    for (group, names), start, end in zip(OPTION_GROUPS.items(), starts, [*starts[1:], None], strict=True):
        section = help_text[start:end]
        assert all(f"--{name.replace('_', '-')}" in section for name in names), group
    weights = add_engine_arguments(argparse.ArgumentParser())._option_string_actions["--weights"]
    assert weights.help.endswith("(default: 'dense'; qwen2.5-coder-1.5b: 'auto')")


def test_every_engine_flag_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(OPTION_HELP) == sorted(option_names()), "OPTION_HELP must cover exactly the engine options"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "engine option" not in help_text  # the fallback for an option without help
    for name, choices in OPTION_CHOICES.items():
        assert f"--{name.replace('_', '-')} {{{','.join(choices)}}}" in help_text
    assert "(default: 0.15)" in help_text and "(default: 'fusion')" in help_text
