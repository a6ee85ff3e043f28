"""scripts/pick-python: the interpreter `make` builds the venv from is the first candidate that is
Python 3.11 and can make a venv with pip (a distribution's python3.11 without its venv package
must not be taken)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pick-python"


def _pick(*candidates: str) -> str:
    out = subprocess.run([str(SCRIPT), *candidates], capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip()


def _fake(tmp_path: Path, name: str, exit_code: int) -> str:
    """An executable that answers the script's check with ``exit_code`` (1: not 3.11, or no ensurepip)."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    path.chmod(0o755)
    return str(path)


def test_the_first_candidate_that_can_make_a_venv_wins(tmp_path):
    no_venv = _fake(tmp_path, "python3.11-without-venv", 1)
    assert _pick(str(tmp_path / "missing"), no_venv, sys.executable) == sys.executable
    assert _pick(sys.executable, no_venv) == sys.executable


def test_the_check_itself_runs_in_each_candidate(tmp_path):
    passes = _fake(tmp_path, "says-yes", 0)  # the script trusts the candidate's own answer
    assert _pick(_fake(tmp_path, "says-no", 1), passes) == passes


def test_without_any_it_falls_back_to_python3(tmp_path):
    assert _pick(_fake(tmp_path, "a", 1), str(tmp_path / "missing")) == "python3"


def test_the_default_list_gives_a_python_3_11_with_venv():
    path = _pick()
    if path == "python3":  # nothing on this machine qualifies: make says why when it runs python3
        return
    check = "import sys, venv, ensurepip; print(sys.version_info[:2])"
    assert subprocess.run([path, "-c", check], capture_output=True, text=True, check=True).stdout.strip() == "(3, 11)"
