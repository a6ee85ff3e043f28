"""gpubroker: share GPUs between Ray Serve models.

The public API a model author imports::

    from gpubroker import InputError, Model

or, with an existing Ray Serve deployment, puts it under the broker::

    @serve.deployment
    @gpubroker.managed("scorer", config="fleet.yaml")
    class Scorer: ...

``Model`` is the protocol of a model class (only ``predict`` is required; subclass it to
inherit the defaults of the others); ``InputError(field, message)`` refuses a request's input
with a 422 naming the field; ``managed(model, config=...)`` makes a ``@serve.deployment`` class
report to the broker and take its batch cap, wait and memory grant (docs/serve-apps.md). Everything else in the package is the command and its machinery.
"""

from gpubroker.deployments.models.base import InputError
from gpubroker.deployments.models.protocol import Model
from gpubroker.deployments.serve.managed import managed

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)

__all__ = ["InputError", "Model", "__version__", "managed"]
