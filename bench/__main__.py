"""``python -m bench SCENARIO [options]`` from the root of a clone (``python -m bench --help``)."""

from bench.cli import main

main()
