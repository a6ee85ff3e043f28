"""Import contract: the layers' arrows run one way, pure code stays pure, no cycles.

Every ``.py`` under the five packages is parsed (not imported), and every ``import`` in it
counts: at module level, inside functions and under ``if TYPE_CHECKING:``. A lazy import
is still an arrow.

Only ``gpubroker/cli/`` imports typer or rich; the pure rooms (``quotas/``, ``broker/control/``,
``broker/wire.py``) touch no hardware, Ray or clock; ``broker/capacity.py`` (what the broker reads of
a card) imports nothing of ours; the memory probes live beside their readers on the Serve side
(``deployments/enforce/probes.py``) and import only ``broker/capacity.py``.

    quotas -> nothing of ours
    broker -> quotas
    deployments -> broker, quotas
    gpubroker -> deployments, broker, quotas (never bench: ``python -m bench`` is the benchmarks' door)
    bench -> everything (bench/ is not installed)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("quotas", "broker", "deployments", "gpubroker", "bench")
ALLOWED: dict[str, frozenset[str]] = {
    "quotas": frozenset(),
    "broker": frozenset({"quotas"}),
    "deployments": frozenset({"broker", "quotas"}),
    "gpubroker": frozenset({"deployments", "broker", "quotas"}),
    "bench": frozenset({"gpubroker", "deployments", "broker", "quotas"}),
}
# The broker's pure rooms: its control subpackage and the wire. Everything else in broker/ is the
# mechanism around them (the actor, checkpoints, metrics, the card's capacity).
BROKER_PURE_PREFIXES = ("gpubroker.broker.control", "gpubroker.broker.wire")
# The broker core takes its clock and capacity injected: it may import the standard clock as
# the default, but never hardware, Ray, the capacity or the probes, not even through another module.
NO_HARDWARE_MODULES = frozenset(
    {"gpubroker.broker.core", "gpubroker.broker.fleet_core", "gpubroker.broker.fleet_store"}
)  # fleet_core: one BrokerCore per card
UI = frozenset({"typer", "rich", "click"})  # the command line's toolkits: only gpubroker/cli draws
CAPACITY = "gpubroker.broker.capacity"  # the device and the card's size: the broker's one hardware module
PROBES = "gpubroker.deployments.enforce.probes"  # the replica's memory readings
HARDWARE = frozenset({"ray", "torch", "pynvml", "psutil", CAPACITY, PROBES})
CLOCKS = frozenset({"time"})
CLOCK_CALLS = frozenset({"now", "utcnow", "today", "time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"})
# importlib loads only what a user's config names ('pkg.module:Class'), never a module of ours.
IMPORTLIB_ALLOWED = frozenset({"gpubroker.deployments.models"})


@dataclass(frozen=True)
class Import:
    target: str  # dotted name as resolved (our module, or an outside top-level name + rest)
    line: int


# The card's top-level folders, installed under the one import name: broker/x.py is gpubroker.broker.x
# (gpubroker/broker is a link to ../broker). The layer of a module is its folder's name.
LINKED = ("quotas", "broker", "deployments")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in LINKED:
        parts.insert(0, "gpubroker")
    return ".".join(parts)


@cache
def source_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            if any((ROOT / Path(*rel.parts[:n])).is_symlink() for n in range(1, len(rel.parts))):
                continue  # gpubroker/broker/... is broker/... seen through its link
            out[_module_name(path)] = path
    return out


def _is_pure(module: str) -> bool:
    return _top(module) == "quotas" or any(module == p or module.startswith(p + ".") for p in BROKER_PURE_PREFIXES)


def policy_modules() -> frozenset[str]:
    return frozenset(m for m in source_files() if _is_pure(m))


def _is_package(module: str) -> bool:
    return source_files()[module].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def imports_in(tree: ast.AST, module: str) -> tuple[Import, ...]:
    """Every import anywhere in ``tree`` (functions and TYPE_CHECKING blocks too), resolved."""
    known = source_files()
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:  # `from broker import policy` is an arrow to gpubroker.broker.control.policy
                sub = f"{base}.{alias.name}"
                found.append(Import(sub if sub in known else base, node.lineno))
    return tuple(found)


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    return imports_in(ast.parse(source_files()[module].read_text(encoding="utf-8")), module)


def _ours(target: str) -> str | None:
    """The module of ours an import names (the longest known prefix), or None if outside."""
    known = source_files()
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in known:
            return name
    return None


def _top(name: str) -> str:
    """The layer a dotted name belongs to: ``gpubroker.broker.core`` is in broker, ``gpubroker.cli`` in gpubroker."""
    parts = name.split(".")
    if parts[0] == "gpubroker" and len(parts) > 1 and parts[1] in LINKED:
        return parts[1]
    return parts[0]


def graph() -> dict[str, set[str]]:
    return {m: {o for i in imports_of(m) if (o := _ours(i.target)) and o != m} for m in source_files()}


def _closure(start: str) -> Iterator[tuple[str, Import]]:
    """Every import of ``start`` and of the modules of ours it reaches, with the module that makes it."""
    seen, todo = {start}, [start]
    while todo:
        mod = todo.pop()
        for imp in imports_of(mod):
            yield mod, imp
            ours = _ours(imp.target)
            if ours and ours not in seen:
                seen.add(ours)
                todo.append(ours)


def _where(module: str, imp: Import) -> str:
    return f"{source_files()[module].relative_to(ROOT)}:{imp.line} imports {imp.target}"


def _hits(target: str, names: frozenset[str]) -> bool:
    return any(target == n or target.startswith(n + ".") for n in names)


# ------------------------------------------------------------------------------- the tests
def test_every_package_is_found():
    tops = {_top(m) for m in source_files()}
    assert tops == set(PACKAGES), f"packages without sources: {set(PACKAGES) - tops}"
    named = NO_HARDWARE_MODULES | {CAPACITY, PROBES}
    assert named <= set(source_files()), f"named in this test but missing: {sorted(named - set(source_files()))}"
    assert {
        "gpubroker.broker.control.policy",
        "gpubroker.broker.control.batch_rules",
        "gpubroker.broker.control.lending",
        "gpubroker.quotas.ledger",
    } <= policy_modules()


def test_one_import_name():
    """Nothing imports broker, deployments or quotas by their bare names: installed, only ``gpubroker``
    exists, and a user's own ``deployments`` package must never be the one that loads."""
    bad = [_where(m, i) for m in source_files() for i in imports_of(m) if i.target.split(".")[0] in LINKED]
    assert not bad, "import them as gpubroker.<name>:\n" + "\n".join(bad)


def test_arrows_run_one_way():
    bad = []
    for mod in source_files():
        layer = _top(mod)
        for imp in imports_of(mod):
            ours = _ours(imp.target)
            allowed = ALLOWED[layer]
            if ours and _top(ours) != layer and _top(ours) not in allowed:
                bad.append(f"{_where(mod, imp)}: {layer} may import only {sorted(ALLOWED[layer]) or 'nothing of ours'}")
    assert not bad, "\n".join(bad)


def test_only_the_cli_draws():
    bad = [
        _where(m, i)
        for m in source_files()
        if not m.startswith("gpubroker.cli") and m != "bench.cli"  # the benchmarks' own command line
        for i in imports_of(m)
        if _hits(i.target, UI)
    ]
    assert not bad, (
        "typer and rich belong to gpubroker/cli/ (report progress through a callback instead):\n" + "\n".join(bad)
    )


def test_no_import_cycles():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles (each group imports itself through the others): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


@pytest.mark.parametrize("module", sorted(policy_modules() | NO_HARDWARE_MODULES))
def test_pure_code_touches_no_hardware_and_no_ray(module: str):
    bad = list(dict.fromkeys(_where(m, i) for m, i in _closure(module) if _hits(i.target, HARDWARE)))
    assert not bad, f"{module} reaches hardware, Ray or the probes:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(policy_modules()))
def test_policy_code_reads_no_clock_and_imports_only_pure_code(module: str):
    bad = []
    for imp in imports_of(module):
        ours = _ours(imp.target)
        if _hits(imp.target, CLOCKS):
            bad.append(f"{_where(module, imp)} (a clock: take now_s as an input)")
        elif ours and ours not in policy_modules() and ours not in ("gpubroker.broker", "gpubroker.broker.control"):
            bad.append(f"{_where(module, imp)} (not a pure module)")
    tree = ast.parse(source_files()[module].read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in CLOCK_CALLS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in {"datetime", "date", "time"}
        ):
            bad.append(
                f"{source_files()[module].relative_to(ROOT)}:{node.lineno} calls "
                f"{node.func.value.id}.{node.func.attr}() (a clock: take now_s as an input)"
            )
    assert not bad, "\n".join(dict.fromkeys(bad))


def test_capacity_is_a_leaf_and_the_probes_import_only_it():
    bad = [_where(CAPACITY, i) for i in imports_of(CAPACITY) if _ours(i.target) not in (None, "gpubroker.broker")]
    assert not bad, "broker/capacity.py must import nothing of ours:\n" + "\n".join(bad)
    near = (None, "gpubroker.broker", CAPACITY, "gpubroker.deployments", "gpubroker.deployments.enforce")
    bad = [_where(PROBES, i) for i in imports_of(PROBES) if _ours(i.target) not in near]
    assert not bad, "deployments/enforce/probes.py may import only broker/capacity.py of ours:\n" + "\n".join(bad)


def test_the_probes_live_beside_their_readers_and_the_broker_reads_only_capacity():
    """The memory probes are read on the Serve side (the replica, a managed deployment, the limits
    and watchers: ``deployments/``, and the command above it); in ``broker/`` only ``capacity.py``
    touches torch or pynvml (the actor's reading of a card's size)."""
    readers = {
        m for m in source_files() if _top(m) in INSTALLED and any(_ours(i.target) == PROBES for i in imports_of(m))
    }
    assert any(_top(m) == "deployments" for m in readers), f"nothing in deployments/ reads {PROBES}: stale name?"
    bad = [
        _where(m, i)
        for m in source_files()
        if _top(m) == "broker" and m != CAPACITY
        for i in imports_of(m)
        if _hits(i.target, frozenset({"torch", "pynvml", "psutil"}))
    ]
    assert not bad, "in broker/ only capacity.py touches the hardware:\n" + "\n".join(bad)


def test_no_importlib_registration():
    bad = []
    for mod in source_files():
        if mod in IMPORTLIB_ALLOWED:
            continue
        bad += [_where(mod, i) for i in imports_of(mod) if _top(i.target) == "importlib"]
        tree = ast.parse(source_files()[mod].read_text(encoding="utf-8"))
        bad += [
            f"{source_files()[mod].relative_to(ROOT)}:{n.lineno} calls __import__"
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "__import__"
        ]
    assert not bad, "static imports only (a module registered by importlib is an arrow nobody sees):\n" + "\n".join(bad)


def test_the_contract_sees_lazy_and_type_checking_imports():
    """The parser counts imports inside functions and TYPE_CHECKING blocks (guards the checks above)."""
    src = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpubroker.broker.control.policy import decide\n"
        "def f():\n    import torch\n    from . import window\n    from .types import ModelLoad\n"
    )
    targets = [i.target for i in imports_in(ast.parse(src), "gpubroker.broker.control.lending")]
    assert targets == [
        "typing",
        "gpubroker.broker.control.policy",
        "torch",
        "gpubroker.broker.control.window",
        "gpubroker.broker.control.types",
    ]


INSTALLED = ("quotas", "broker", "deployments", "gpubroker")  # what the wheel installs (bench/ is not)


def private_imports(tree: ast.AST, module: str) -> list[tuple[int, str, str]]:
    """``(line, module imported from, name)`` for every ``from X import _name`` in ``tree`` where X
    is another module of ours and ``_name`` is private (one leading underscore, not a dunder)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if _top(source) not in PACKAGES or source == module:
                continue
            for alias in node.names:
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and f"{source}.{name}" not in source_files():
                    out.append((node.lineno, source, name))
    return out


def test_no_module_imports_another_modules_private_names():
    """A private name is its module's own: a file that needs another's is one concept cut in two
    (fold it back) or the name is public (drop the underscore)."""
    bad = [
        f"{source_files()[m].relative_to(ROOT)}:{line} imports {name} from {source}"
        for m in source_files()
        if _top(m) in INSTALLED
        for line, source, name in private_imports(ast.parse(source_files()[m].read_text(encoding="utf-8")), m)
    ]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_the_private_import_check_sees_one():
    tree = ast.parse(
        "from gpubroker.broker.control.window import _OOM\nfrom gpubroker.broker.control.window import Digest\n"
    )
    assert private_imports(tree, "gpubroker.broker.control.policy") == [(1, "gpubroker.broker.control.window", "_OOM")]
    assert private_imports(ast.parse("from . import _x\n"), "gpubroker.broker.control.policy") == [
        (1, "gpubroker.broker.control", "_x")
    ]
    assert private_imports(tree, "gpubroker.broker.control.window") == []  # a module's own names are its own


def private_getattrs(tree: ast.AST) -> list[tuple[int, str]]:
    """``getattr(x, "_name", ...)`` calls whose object is not ``self`` or ``cls``: (line, name)."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"):
            continue
        if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant) or not isinstance(node.args[1].value, str):
            continue
        obj, name = node.args[0], node.args[1].value
        if (
            name.startswith("_")
            and not name.startswith("__")
            and not (isinstance(obj, ast.Name) and obj.id in ("self", "cls"))
        ):
            out.append((node.lineno, name))
    return out


def test_no_getattr_of_another_objects_private_attribute():
    """A rule reads its inputs, not the mechanism's privates: ``getattr(core, "_state")`` is refused
    (on ``self`` a class may read its own; dunders are the language's)."""
    assert private_getattrs(ast.parse('getattr(core, "_state", None)')) == [(1, "_state")]
    found = [
        f"{path.relative_to(ROOT)}:{line} getattr(..., {name!r})"
        for path in source_files().values()
        for line, name in private_getattrs(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not found, "getattr of another object's private attribute: " + "; ".join(found)
