"""``python -m cli``: the ``gpubroker`` command."""

from cli.main import app

app()
