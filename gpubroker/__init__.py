"""gpubroker: share GPUs between Ray Serve models.

The public API a model author imports::

    from gpubroker import InputError, Model

``Model`` is the protocol of a model class (only ``predict`` is required; subclass it to
inherit the defaults of the others); ``InputError(field, message)`` refuses a request's input
with a 422 naming the field. Everything else in the package is the command and its machinery.
"""

from gpubroker.deployments.models.base import InputError
from gpubroker.deployments.models.protocol import Model

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)

__all__ = ["InputError", "Model", "__version__"]
