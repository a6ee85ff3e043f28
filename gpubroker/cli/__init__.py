"""The ``gpubroker`` command line: Typer commands and rich views over every other package."""
