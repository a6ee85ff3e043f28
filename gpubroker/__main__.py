"""``python -m gpubroker``: the ``gpubroker`` command."""

from gpubroker.cli.main import app

if __name__ == "__main__":  # vLLM spawns processes that import __main__ again: the command must not rerun
    app()
