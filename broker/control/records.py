"""Fast construction and copy of the broker's frozen records (``broker.wire``, ``broker.control.state``).

A frozen dataclass's ``__init__`` sets every field through ``object.__setattr__`` and
``dataclasses.replace`` re-runs it; the control tick builds and copies a few records per model,
so for a fleet of a hundred models these were a fifth of a tick. ``build`` and ``evolve`` give
the same objects (equal, hashable, still frozen against assignment) without it. They are for
records with plain defaults and no ``__post_init__`` only, and refuse others.
"""

from __future__ import annotations

from dataclasses import MISSING

_FIELDS: dict[type, frozenset[str]] = {}


def evolve(obj, **changes):  # noqa: ANN001, ANN201 - a frozen record
    """``dataclasses.replace`` for the policy's frozen, validation-free records, without
    re-running ``__init__`` (the tick calls it a few times per model; ``replace`` was a tenth
    of a 100-model tick). Unknown field names are refused like ``replace`` refuses them."""
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(cls.__dataclass_fields__)
    if not changes.keys() <= names:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(set(changes) - names)}")
    new = object.__new__(cls)
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


_SHAPES: dict[type, tuple[dict, frozenset[str], frozenset[str]]] = {}  # defaults, required, all fields


def build(cls, **values):  # noqa: ANN001, ANN201 - a frozen, validation-free dataclass of broker.wire / broker.control.state
    """``cls(**values)`` without the frozen dataclass's ``__init__`` (one ``object.__setattr__``
    per field: for the 38 fields of a ``ModelLoad`` built per model per tick, a twentieth of a
    tick). Defaults and the missing/unknown-field errors as ``__init__`` has them."""
    shape = _SHAPES.get(cls)
    if shape is None:
        fields = cls.__dataclass_fields__.values()
        if any(f.default_factory is not MISSING for f in fields) or hasattr(cls, "__post_init__"):
            raise TypeError(f"build() needs plain defaults and no __post_init__; {cls.__name__} has them")
        defaults = {f.name: f.default for f in fields if f.default is not MISSING}
        shape = _SHAPES[cls] = (
            defaults,
            frozenset(f.name for f in fields) - defaults.keys(),
            frozenset(f.name for f in fields),
        )
    defaults, required, names = shape
    if len(values) == len(names) and values.keys() <= names:  # every field given: no default to fill
        new = object.__new__(cls)
        object.__setattr__(new, "__dict__", values)  # the call's own keyword dict, nobody else holds it
        return new
    if not values.keys() <= names or not required <= values.keys():
        raise TypeError(
            f"{cls.__name__}: unknown {sorted(values.keys() - names)}, missing {sorted(required - values.keys())}"
        )
    new = object.__new__(cls)
    d = new.__dict__
    d.update(defaults)
    d.update(values)
    return new
