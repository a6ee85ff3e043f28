"""No public signature in ``quotas/``, ``broker/`` or ``gpubroker/`` takes or returns ``dict[str, Any]``
(issue 50 item 3): a value that crosses a function's edge has a type a checker can read (a frozen
dataclass, a ``TypedDict``, or ``quotas.config.ConfigDoc`` for a config the user wrote, which is
``dict[str, object]``). Plain data is allowed at the one conversion only: a wire type's
``to_dict``/``from_dict``, and the allow-list below."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINKED = {"broker", "deployments", "quotas"}  # gpubroker/<these> link to the top-level folders: walked there
LOOSE = ("dict[str, Any]", "Dict[str, Any]")
CONVERSIONS = {"to_dict", "from_dict"}  # the one conversion on each wire type

# "path::Class.method": why it may take or return plain data. Keep it tiny.
ALLOWED = {
    # The Ray boundary itself: the actor takes and returns plain data and converts with the wire
    # types' to_dict/from_dict (gpubroker.broker.wire's module note; its client is typed).
    "broker/actor.py::BrokerActor.plan",
    "broker/actor.py::BrokerActor.register",
    "broker/actor.py::BrokerActor.report",
    "broker/actor.py::BrokerActor.settings",
    # Not typed yet (issue 50 item 3, left open): the simulator's knee results are the JSON records
    # bench/results keeps, a knee row keyed by model name beside its own keys; they want TypedDicts
    # (SeedKnee, OracleArm, SeedValidation) and a row with its models under one key.
    "gpubroker/sim/knee.py::knee",
    "gpubroker/sim/knee.py::knee_on_seeds",
    "gpubroker/sim/knee.py::oracle",
    "gpubroker/sim/knee.py::seed_validation",
    "gpubroker/cli/views.py::knee_check_table",  # reads seed_validation's record
    # Not typed yet: up_fleet's result (gpubroker.deployments.cluster.fleet), in a file being changed now.
    "gpubroker/cli/fleet.py::up_with_progress",
}


def _sources() -> Iterator[Path]:
    for root in ("quotas", "broker"):
        yield from sorted((ROOT / root).rglob("*.py"))
    for path in sorted((ROOT / "gpubroker").rglob("*.py")):
        if path.relative_to(ROOT / "gpubroker").parts[0] not in LINKED:
            yield path


def _public_defs(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Module-level functions and the methods of module-level classes, public ones only (nested
    helpers are no one's interface)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and not item.name.startswith("_"):
                    yield f"{node.name}.{item.name}", item


def _loose_aliases(tree: ast.Module) -> set[str]:
    """Module-level names bound to ``dict[str, Any]`` (an alias would hide it from the scan)."""
    out = set()
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            target, value = node.target.id, node.value
        if target and value is not None and ast.unparse(value) in LOOSE:
            out.add(target)
    return out


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return ast.unparse(fn.args) + (" -> " + ast.unparse(fn.returns) if fn.returns else "")


def _names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    parts = [fn.args] + ([fn.returns] if fn.returns is not None else [])
    return {n.id for part in parts for n in ast.walk(part) if isinstance(n, ast.Name)}


def _loose_in(label: str, source: str) -> list[str]:
    """``label::qualname  (signature)`` of each public def in ``source`` with a loose signature."""
    tree = ast.parse(source)
    aliases = _loose_aliases(tree)
    found = []
    for qualname, fn in _public_defs(tree):
        sig = _signature(fn)
        if fn.name not in CONVERSIONS and (any(t in sig for t in LOOSE) or aliases & _names(fn)):
            found.append(f"{label}::{qualname}  ({sig})")
    return found


def _loose_signatures() -> list[str]:
    found = []
    for path in _sources():
        found += _loose_in(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
    return found


def test_no_public_signature_takes_or_returns_a_loose_dict():
    found = [f for f in _loose_signatures() if f.split("  ")[0] not in ALLOWED]
    assert not found, (
        "public signatures with dict[str, Any]: give them a wire type, a TypedDict or a frozen dataclass "
        "(gpubroker.broker.wire), or ConfigDoc for a config as the user wrote it:\n  " + "\n  ".join(found)
    )


def test_the_scan_sees_a_loose_signature_and_one_through_an_alias():
    """The check can fail: one loose signature written out, one through an alias, are caught; a
    conversion, a private helper and a nested one are not."""
    src = (
        "from typing import Any\nLoose = dict[str, Any]\n"
        "def shown(x: int) -> dict[str, Any]: ...\n"
        "def hidden(x: Loose) -> int: ...\n"
        "def _private(x: Loose) -> int: ...\n"
        "def outer() -> int:\n    def inner(x: Loose) -> int: ...\n    return 0\n"
        "class Thing:\n    def to_dict(self) -> dict[str, Any]: ...\n    def view(self) -> Loose: ...\n"
    )
    assert [f.split("  ")[0] for f in _loose_in("m.py", src)] == ["m.py::shown", "m.py::hidden", "m.py::Thing.view"]


def test_every_allowed_entry_still_exists():
    """An allow-list entry whose function is gone or typed now is dropped from the list, not kept."""
    loose = {f.split("  ")[0] for f in _loose_signatures()}
    assert ALLOWED <= loose, f"allowed but no longer loose: {sorted(ALLOWED - loose)}"
