"""Config errors that name the field path, the bad value and the fix (from pydantic's errors),
and the YAML reader that refuses what PyYAML would let pass silently (a key written twice)."""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel


@dataclass(frozen=True)
class ConfigIssue:
    path: str  # dotted field path, e.g. models.minilm.quota.base
    value: Any  # the bad value as written ("" when the whole section is at fault)
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        shown = "" if self.value is MISSING else f" (got {self.value!r})"
        return f"{self.path or '<root>'}{shown}: {self.message}"


MISSING = object()


class ConfigError(ValueError):
    """A config that cannot be used; ``issues`` lists every problem found."""

    def __init__(self, issues: list[ConfigIssue], source: str = "config", exit_code: int = 1):
        self.issues = issues
        self.source = source
        self.exit_code = exit_code  # 1: invalid config, 2: unreadable or not YAML
        lines = "\n".join(f"  - {issue}" for issue in issues)
        super().__init__(f"{source}: {len(issues)} problem(s):\n{lines}")


_FIXES = {
    "extra_forbidden": "remove it or check its spelling",
    "missing": "add it",
}


def _branches(tp: Any) -> list[Any]:
    """The types a field annotation stands for: Optional, unions and Annotated unwrapped."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _branches(get_args(tp)[0])
    if origin is Union or origin is types.UnionType:
        return [b for arg in get_args(tp) for b in _branches(arg)]
    return [tp]


def _step(tp: Any, part: str) -> list[Any]:
    """The annotations ``part`` leads to from ``tp``: a model's field, a mapping's value, a list's item."""
    out: list[Any] = []
    for branch in _branches(tp):
        origin = get_origin(branch)
        if isinstance(branch, type) and issubclass(branch, BaseModel):
            fields = {f.alias or name: f for name, f in branch.model_fields.items()}
            if part in fields:
                out.append(fields[part].annotation)
        elif origin in (dict, Mapping) and len(get_args(branch)) == 2:
            out.append(get_args(branch)[1])
        elif origin in (list, tuple, Sequence) and get_args(branch):
            out.append(get_args(branch)[0])
    return out


def keys_at(root: type[BaseModel], path: Sequence[str]) -> list[str]:
    """The keys a config may have at ``path`` (a dotted location's parts), read off the schema."""
    current: list[Any] = [root]
    for part in path:
        current = [nxt for tp in current for nxt in _step(tp, part)]
    keys = {
        f.alias or name
        for tp in current
        for branch in _branches(tp)
        if isinstance(branch, type) and issubclass(branch, BaseModel)
        for name, f in branch.model_fields.items()
    }
    return sorted(keys)


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """`` did you mean 'x'?`` for the closest of ``known`` to a misspelt ``word``, or ``""``."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" did you mean '{close[0]}'?" if close else ""


def issue_from_pydantic(err: Mapping[str, Any], schema: type[BaseModel] | None = None) -> ConfigIssue:
    """One pydantic error as a ConfigIssue; with ``schema``, an unknown key names the closest known one."""
    loc = [str(part) for part in err.get("loc", ())]
    # Pydantic adds the union branch / validator names to locs; drop the noise.
    loc = [p for p in loc if not p.startswith(("function-", "literal[", "int", "constrained-"))]
    if len(loc) > 1 and loc[0] == "gpus" and loc[1] in ("auto", "cards"):
        del loc[1]  # the tag of the gpus union's branch (gpubroker.quotas.cards.GpusSection), not a key the user wrote
    path = ".".join(loc)
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    # cross-section checks name their field first ("models.*.quota.base: ...")
    named = re.match(r"^([a-z_][\w.*]*): (.*)$", msg, re.S)
    if named and "." in named.group(1):
        path = ".".join(p for p in (path, named.group(1)) if p)
        msg = named.group(2)
    fix = _FIXES.get(kind)
    if kind == "extra_forbidden":
        key = loc[-1] if loc else ""
        hint = did_you_mean(key, keys_at(schema, loc[:-1])) if schema is not None and loc else ""
        msg = f"unknown key '{key}';{hint or ' ' + str(fix)}"
    elif kind == "missing":
        msg = f"required field is missing; {fix}"
    value = err.get("input", MISSING) if kind != "missing" else MISSING
    if kind != "extra_forbidden" and (isinstance(value, dict) or (isinstance(value, list) and len(repr(value)) > 80)):
        value = MISSING  # whole-section (or long list) errors: the message names the fields
    return ConfigIssue(path=path, value=value, message=msg)


def duplicate_keys(text: str) -> list[ConfigIssue]:
    """Every key written twice in one mapping of the YAML ``text``, with its path and both lines
    (PyYAML keeps the last one silently: two models of one name and one of them disappears).
    The text must already parse."""
    issues: list[ConfigIssue] = []
    seen_nodes: set[int] = set()  # an anchor's node is walked once (and a recursive one ends)

    def walk(node: yaml.Node, path: str) -> None:
        if id(node) in seen_nodes:
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key_node, value_node in node.value:
                key = str(key_node.value)
                line = key_node.start_mark.line + 1
                where = f"{path}.{key}" if path else key
                if key in seen:
                    issues.append(
                        ConfigIssue(
                            where,
                            key,
                            f"written twice (lines {seen[key]} and {line}); YAML would keep only the second: "
                            "rename one or remove one",
                        )
                    )
                seen.setdefault(key, line)
                walk(value_node, where)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{path}.{i}")

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, "")
    return issues
