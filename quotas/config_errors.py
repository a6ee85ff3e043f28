"""Config errors that name the field path, the bad value and the fix (from pydantic's errors)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConfigIssue:
    path: str  # dotted field path, e.g. models.minilm.quota.base
    value: Any  # the bad value as written ("" when the whole section is at fault)
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        shown = "" if self.value is _MISSING else f" (got {self.value!r})"
        return f"{self.path or '<root>'}{shown}: {self.message}"


_MISSING = object()


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


def _issue_from_pydantic(err: dict[str, Any]) -> ConfigIssue:
    loc = [str(part) for part in err.get("loc", ())]
    # Pydantic adds the union branch / validator names to locs; drop the noise.
    loc = [p for p in loc if not p.startswith(("function-", "literal[", "int", "constrained-"))]
    if len(loc) > 1 and loc[0] == "gpus" and loc[1] in ("auto", "cards"):
        del loc[1]  # the tag of the gpus union's branch (quotas.cards.GpusSection), not a key the user wrote
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
        msg = f"unknown key '{loc[-1] if loc else ''}'; {fix}"
    elif kind == "missing":
        msg = f"required field is missing; {fix}"
    value = err.get("input", _MISSING) if kind != "missing" else _MISSING
    if kind != "extra_forbidden" and (isinstance(value, dict) or (isinstance(value, list) and len(repr(value)) > 80)):
        value = _MISSING  # whole-section (or long list) errors: the message names the fields
    return ConfigIssue(path=path, value=value, message=msg)
