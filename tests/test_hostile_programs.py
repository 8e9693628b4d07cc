"""Programs fedrepro runs and reads are read within bounds (issue 46): fedrepro.bounded_run stops one
that prints without end (at a byte limit), hangs (at a time limit, with whatever it started) or
prints non-UTF-8, with one line naming it; git for provenance and the interpreter probed for the
plugins' search path go through it (nvidia-smi: tests/test_local_plan.py). docs/security.md,
"Programs fedrepro runs"."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest

from fedrepro import bounded_run, plugins, provenance
from fedrepro.bounded_run import NOT_RUN, NOT_UTF8, TIMED_OUT, TOO_LARGE, EXIT_STATUS, ProgramFailed, run_bounded
from fedrepro.registry import ConfigError

SH = shutil.which("sh")
FLOOD = f"exec {shutil.which('yes')}"
NOT_UTF8_OUTPUT = r"printf 'ok \377\n'"


def script(folder: Path, name: str, body: str) -> Path:
    """An executable shell script `folder`/`name`."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / name
    exe.write_text(f"#!{SH}\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def failure(argv, **kwargs) -> ProgramFailed:
    with pytest.raises(ProgramFailed) as exc:
        run_bounded(argv, **kwargs)
    return exc.value


# ------------------------------------------------------------------ the bounded reader


def test_a_program_that_prints_without_end_is_killed_at_the_limit():
    start = time.monotonic()
    exc = failure([SH, "-c", FLOOD], timeout=20, limit=64 << 10, program="flooder")
    assert str(exc) == "flooder printed more than 64 KiB" and exc.reason == TOO_LARGE
    assert time.monotonic() - start < 10  # by its size, not its time


def test_a_program_that_hangs_is_killed_with_what_it_started(tmp_path):
    left = tmp_path / "still-running"
    start = time.monotonic()
    exc = failure([SH, "-c", f"(sleep 1; touch {left}) & sleep 30"], timeout=0.3)
    assert str(exc) == "sh timed out after 0.3 s" and exc.reason == TIMED_OUT
    assert time.monotonic() - start < 5
    time.sleep(1.5)
    assert not left.exists()
    # one that closes its output but goes on is stopped at the same limit
    assert failure([SH, "-c", "exec >&-; sleep 30"], timeout=0.3).reason == TIMED_OUT


def test_non_utf8_output_a_failed_start_and_an_exit_status_are_one_line_each(tmp_path):
    exc = failure([SH, "-c", NOT_UTF8_OUTPUT], timeout=10)
    assert str(exc) == "sh printed output that is not UTF-8 (byte 3)" and exc.reason == NOT_UTF8
    exc = failure([str(tmp_path / "absent")], timeout=10)
    assert str(exc) == "absent could not be run (No such file or directory)" and exc.reason == NOT_RUN
    exc = failure([SH, "-c", "exit 3"], timeout=10)
    assert str(exc) == "sh exited with status 3" and exc.reason == EXIT_STATUS
    done = run_bounded([SH, "-c", "echo answer; exit 3"], timeout=10, check=False)
    assert (done.returncode, done.stdout) == (3, "answer\n")


# ------------------------------------------------------------------ provenance: git


@pytest.mark.parametrize("body,told", [(FLOOD, "git printed more than 1 MiB"), (NOT_UTF8_OUTPUT, "git printed output that "
                                       "is not UTF-8 (byte 3)"), ("sleep 30", "git timed out after 0.3 s")])
def test_a_misbehaving_git_leaves_provenance_unknown_with_a_warning(tmp_path, monkeypatch, capsys, body, told):
    monkeypatch.setenv("PATH", f"{script(tmp_path / 'bin', 'git', body).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(provenance, "GIT_TIMEOUT_S", 0.3)
    assert provenance._git("rev-parse", "HEAD") is None
    assert capsys.readouterr().err == (f"[fedrepro] warning: provenance: {told}; its answer to 'git rev-parse' is "
                                       "recorded as unknown\n")


def test_git_status_too_long_to_read_is_dirty_and_no_git_is_quietly_unknown(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(script(tmp_path / "bin", "git", FLOOD).parent))
    assert provenance._git("status", "--porcelain", too_much="many") == "many"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert provenance._git("rev-parse", "HEAD") is None
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ plugins: the interpreter's search path


@pytest.mark.parametrize("body,told", [(FLOOD, "printed more than 1 MiB"), (NOT_UTF8_OUTPUT, "printed output that is not "
                                       "UTF-8 (byte 3)"), ("sleep 30", "timed out after 0.3 s")])
def test_a_misbehaving_interpreter_probe_is_one_config_error(tmp_path, monkeypatch, body, told):
    python = script(tmp_path, "python", body)
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.setattr(plugins, "PROBE_TIMEOUT_S", 0.3)
    with pytest.raises(ConfigError) as exc:
        plugins.search_path()
    assert str(exc.value) == (f"environment variable FEDREPRO_PLUGINS: cannot determine the module search path of "
                              f"'{python}' (python {told}); allowed: a working Python interpreter")


def test_every_program_the_package_runs_goes_through_the_bounded_reader():
    """No other call of subprocess in the package (or the workflow): a new one must read within bounds too."""
    root = Path(bounded_run.__file__).parent
    others = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py"))
              if p.name != "bounded_run.py" and ("subprocess" in p.read_text() or "os.popen" in p.read_text())]
    repo = Path(__file__).resolve().parents[1]
    others += [str(p) for p in [repo / "Snakefile", *sorted((repo / "workflow").rglob("*.smk"))] if "subprocess" in p.read_text()]
    assert others == []
