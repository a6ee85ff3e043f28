"""``Model``: what a user's model class may have, and what each method must return.

Re-exported as ``gpubroker.Model``. Only ``predict`` is required; a class that subclasses
``Model`` inherits the defaults below for the rest, a class that does not gets the same
defaults from the replica (``gpubroker.deployments.models.DuckAdapter``). Any method may be ``async def``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Protocol


class Model(Protocol):
    """A model the broker serves: ``model: mypkg.models:MyModel`` in the fleet config, its
    ``options:`` passed to ``__init__`` as keyword arguments.

    Memory is measured, not declared: the replica reads its process's memory before and after
    ``load`` and while calibration batches run, whatever the attributes holding the weights
    are called.
    """

    cost_unit: ClassVar[Literal["requests", "tokens"]] = "requests"  # what ``cost`` counts

    def predict(self, items: list[Any]) -> list[Any]:
        """One output per item, in order. An output is JSON data or what PyTorch code returns:
        numpy scalars and arrays, torch tensors, tuples, dataclasses (NaN and infinity are
        refused with a 500 naming the item and the field). When it raises, the replica splits
        the batch until the items that fail alone are found; only they fail, with their own
        error (``gpubroker.InputError``: 422 naming the field; anything else: 500)."""
        ...

    def load(self, device: str) -> None:
        """Load the weights on ``device`` ("cpu", "cuda:0"); called once, before any request."""

    def validate(self, item: Any) -> Any:
        """The item as ``predict`` takes it, or raise ``gpubroker.InputError(field, message)``
        (the client gets a 422 naming the field)."""
        return item

    def cost(self, item: Any) -> int:
        """What one item costs in ``cost_unit`` (tokens for a token-priced model); 1 by default."""
        return 1

    def example_input(self, cost: int | None = None) -> Any:
        """One valid item (of about ``cost`` units when given): ``gpubroker up`` sends it as each
        model's first request and calibration batches copies of it. Optional: without it the
        first real request is the first."""
        raise NotImplementedError(f"{type(self).__name__} has no example_input()")

    def set_memory_limit(self, grant_bytes: int | None) -> None:
        """The replica's memory grant changed (informational: the replica enforces it)."""

    # A model that embeds text defines ``embedding_input`` (and ``embedding`` where its output is not
    # the vector itself or ``{"embedding": vector}``): ``POST /v1/embeddings`` then serves it in
    # OpenAI's shape, through the same admission, validation and batches as ``/infer``.

    def embedding_input(self, text: str) -> Any:
        """The item ``predict`` takes to embed ``text`` (checked by ``validate`` like any input).
        Optional: without it the model does not embed, and ``/v1/embeddings`` refuses it."""
        raise NotImplementedError(f"{type(self).__name__} does not embed text")

    def embedding(self, output: Any) -> list[float]:
        """The vector in one of ``predict``'s outputs for an ``embedding_input`` item. Optional: by
        default the output itself (a list of numbers) or its ``"embedding"`` entry."""
        ...
