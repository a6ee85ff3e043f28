"""A run's JSON reduced to what the docs read: its aggregates, with every time series summarised.

A benchmark run writes its per-run figures (goodput, attainment, percentiles, counts per arm and
model) beside traces with one entry per tick or per event (an LLM arm's ``bounds_trace``, its
``quota_moves``, the live burst's ``series``, ``decisions`` and ``status_gpu``). The figures are what
the docs quote; the traces are what an investigation reads once. The repository keeps the reduced
file; the full run stays in the git history (``bench/results/README.md`` names the commit).

    python -m bench.reduce_run RUN.json [--out OUT.json] [--command CMD] [--commit SHA]

``--command`` and ``--commit`` record what wrote the run where its file predates those fields;
they are marked as recorded at reduction. Reducing a reduced file changes nothing.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

TRACES = ("bounds_trace", "quota_moves", "decisions", "status_gpu", "series")


def _span(values: list[Any]) -> list[Any] | None:
    """``[min, max]`` of a numeric series (None samples skipped); None when it has no number."""
    nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return [min(nums), max(nums)] if nums else None


def bounds_summary(trace: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per engine and bound (``max_num_seqs``, ``kv_blocks``, ...): ``[min, max]`` over the run's ticks."""
    engines: dict[str, dict[str, list[Any]]] = {}
    for tick in trace:
        for engine, bounds in tick.items():
            for field, value in (bounds or {}).items():
                engines.setdefault(engine, {}).setdefault(field, []).append(value)
    return {
        "ticks": len(trace),
        "span": "[min, max]",
        "engines": {e: {f: _span(v) for f, v in fields.items()} for e, fields in sorted(engines.items())},
    }


def series_summary(series: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
    """Per model and field of a sampled series: its sample count and ``[min, max]``."""
    return {
        m: {"samples": len(fields.get("t_s") or []), **{f: _span(v) for f, v in fields.items() if f != "t_s"}}
        for m, fields in series.items()
    }


def dumps(doc: Any, depth: int = 0) -> str:
    """JSON with one line per object or list that holds no other container: readable and short."""
    if not isinstance(doc, dict | list) or not any(isinstance(v, dict | list) for v in _values(doc)):
        return json.dumps(doc, ensure_ascii=False)
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(doc, list):
        body = ",\n".join(inner + dumps(v, depth + 1) for v in doc)
        return f"[\n{body}\n{pad}]"
    body = ",\n".join(f"{inner}{json.dumps(k, ensure_ascii=False)}: {dumps(v, depth + 1)}" for k, v in doc.items())
    return f"{{\n{body}\n{pad}}}"


def _values(doc: dict[str, Any] | list[Any]) -> list[Any]:
    return list(doc.values()) if isinstance(doc, dict) else doc


def _summarise(key: str, value: Any) -> tuple[str, Any]:
    if key == "bounds_trace":
        return "bounds_summary", bounds_summary(value)
    if key == "series":
        return "series_summary", series_summary(value)
    if key == "quota_moves":
        return "quota_moves_by_kind", dict(sorted(Counter(m.get("move") for m in value).items()))
    if key == "decisions":
        return "decisions_by_kind", dict(sorted(Counter(d.get("kind") for d in value).items()))
    return "status_samples", len(value)  # status_gpu


def reduce_doc(doc: Any, dropped: set[str] | None = None) -> Any:
    """``doc`` with every trace replaced by its summary; ``dropped`` collects the keys replaced."""
    if isinstance(doc, list):
        return [reduce_doc(v, dropped) for v in doc]
    if not isinstance(doc, dict):
        return doc
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in TRACES and isinstance(value, list | dict):
            if dropped is not None:
                dropped.add(key)
            name, summary = _summarise(key, value)
            out[name] = summary
        else:
            out[key] = reduce_doc(value, dropped)
    return out


def reduce_run(doc: dict[str, Any], source: str, command: str | None, commit: str | None) -> dict[str, Any]:
    """The reduced document, with a ``reduced`` record of what was dropped and what was filled in."""
    dropped: set[str] = set()
    out = reduce_doc(doc, dropped)
    filled = []
    if out.get("command") is None and command:
        out["command"], filled = command, [*filled, "command"]
    if not (out.get("code") or {}).get("commit") and commit:
        out["code"], filled = {**(out.get("code") or {}), "commit": commit}, [*filled, "code.commit"]
    prior = doc.get("reduced") or {}
    out["reduced"] = {
        "by": f"python -m bench.reduce_run {source}",
        "traces_summarised": sorted(dropped | set(prior.get("traces_summarised", []))),
        "recorded_at_reduction": sorted(set(filled) | set(prior.get("recorded_at_reduction", []))),
    }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.reduce_run", description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a run's JSON as a benchmark wrote it")
    p.add_argument("--out", type=Path, help="where to write the reduced JSON (default: over RUN)")
    p.add_argument("--command", help="the command that wrote RUN, where its file does not say")
    p.add_argument("--commit", help="the commit RUN ran on, where its file does not say")
    a = p.parse_args(argv)
    doc = json.loads(a.run.read_text(encoding="utf-8"))
    if not isinstance(doc, dict):
        raise SystemExit(f"{a.run}: expected a JSON object at the top, got {type(doc).__name__}")
    out = reduce_run(doc, str(a.run), a.command, a.commit)
    (a.out or a.run).write_text(dumps(out) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
