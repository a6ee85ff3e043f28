"""The demo fleets' files, inside the package: a user who installed the wheel has them without a clone.

A clone keeps them in ``configs/`` (the paths the README and docs name); the files here are links to
those, and the wheel carries copies of them (setuptools follows the links, as for gpubroker/broker).
``gpubroker up --demo`` and ``gpubroker validate --demo`` read ``demo.yaml`` from here; ``gpubroker
demo-config`` writes them all under ``./configs``, so every command the README shows with a
``configs/...`` path works as written outside a clone. The models they name are the built-in ones
(``minilm``, ``cnn``, ``mlp``, ``profiled``, ``tiny-llama``), which the package itself carries.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
DEMO = "demo.yaml"
# Each file by its path under configs/, the same path under this package.
FILES = ("demo.yaml", "llm-demo.yaml", "cluster-demo.yaml", "prometheus.yml", "grafana/gpubroker.json")


def demo_path(name: str = DEMO) -> Path:
    """The shipped file ``name`` (one of ``FILES``); a ValueError names the choices."""
    if name not in FILES:
        raise ValueError(f"no demo file {name!r}; the package ships {', '.join(FILES)}")
    return HERE / name


def existing(dest: Path) -> list[Path]:
    """The files ``write_demo_files(dest)`` would overwrite."""
    return [dest / name for name in FILES if (dest / name).exists()]


def write_demo_files(dest: Path, *, force: bool = False) -> list[Path]:
    """Copies every shipped file under ``dest`` (``dest/grafana/`` too) and returns the paths written.

    Without ``force`` a file already there is kept: a FileExistsError names every such file before
    anything is written, so a user's edited config is never half replaced."""
    taken = existing(dest)
    if taken and not force:
        names = ", ".join(str(p) for p in taken)
        raise FileExistsError(f"{names} already there; keep them, write elsewhere (--out DIR) or replace (--force)")
    written = []
    for name in FILES:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(demo_path(name).read_bytes())
        written.append(target)
    return written
