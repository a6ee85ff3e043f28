"""``scripts/gpu-check``'s own behaviour where there is no GPU (this machine, CI): an unknown
argument is refused, no CUDA reads as skipped, and ``--serve`` without Ray fails rather than
passing on a skipped module."""

from __future__ import annotations

import subprocess
import sys
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_unknown_argument_is_refused_with_the_option_named():
    out = _run("--serv")
    assert out.returncode == 2
    assert "unknown argument '--serv'" in out.stderr and "--serve" in out.stderr


def test_without_cuda_it_says_skipped_and_exits_0():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the checks would run")
    out = _run("--serve")
    assert out.returncode == 0, out.stderr
    assert "no CUDA device: skipped" in out.stdout


def test_serve_without_ray_fails_and_says_why(monkeypatch, capsys):
    loader = SourceFileLoader("gpu_check_script", str(SCRIPT))
    module = module_from_spec(spec_from_loader("gpu_check_script", loader))
    loader.exec_module(module)
    monkeypatch.setattr(module.importlib.util, "find_spec", lambda name: None)
    assert module.serve_checks() == 1
    assert "Ray is not installed" in capsys.readouterr().out
