"""``python -m gpubroker``: the ``gpubroker`` command."""

from gpubroker.cli.main import app

app()
