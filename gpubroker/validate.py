"""What ``gpubroker validate`` checks beyond the schema, and the card's budget it explains.

The schema (``gpubroker.quotas.config``) cannot see whether ``model: acme.models:Scorer`` imports, or
whether the class takes the options written under it: ``up`` would find out minutes later on a
replica. ``build_models`` imports every batch model's class and builds it with its options in a
child process (no Ray; the project directory appended to its path, as ``up`` imports it), under a
timeout, so a model that hangs or crashes in its constructor cannot take the command with it.
``check_llms`` checks each ``kind: llm`` model without starting it: its model on disk (a directory
or the local Hugging Face cache), its bounds, its deprecated option names (warnings), and its
``engine_kwargs`` against the installed vLLM's own argument list, read in a child process (importing
vLLM takes seconds and sets up its logging); where vLLM is not installed, a warning says the names
went unchecked and why.
``budget`` is the arithmetic of the quotas (docs/quotas.md: capacity, reserve, per-process CUDA context,
usable, each model's min/base/max) for ``validate --explain``, with the quota a model's
``profile:`` suggests for its SLO (``gpubroker.sizing.suggest_quota``; ``gpubroker calibrate`` measures the profile).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict

from gpubroker.quotas.config import FleetConfig, ModelSpec
from gpubroker.quotas.config_errors import MISSING, ConfigIssue, did_you_mean
from gpubroker.quotas.llm_spec import deprecated_options
from gpubroker.sim.profile import profile_for
from gpubroker.sizing import Footprint, QuotaSuggestion, kept_free_frac, runtime_bytes_for, suggest_quota

PROFILE_KEYS = ("a_ms", "c_ms", "token_ms", "weights_bytes", "bytes_per_item", "mean_tokens", "tokens_cv")

# The child: our packages first on the path, the project directory last (as `up` imports it).
_CHILD = """
import json, os, sys
sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())] + [os.getcwd()]
from gpubroker.validate import MARK, build_each
print("\\n" + MARK + json.dumps(build_each(json.load(sys.stdin))))
"""
MARK = "@@gpubroker-validate@@"  # the child's result line, whatever the user's code prints


class ModelToBuild(TypedDict):
    """One batch model as the child gets it (JSON on its stdin): what ``models.<name>`` says."""

    model: str  # the class: a built-in's name or 'pkg.module:Class'
    options: dict[str, Any]  # the keyword arguments the config passes it (the user's, any JSON value)


class BuildProblem(TypedDict):
    """Why a model did not build: the field under ``models.<name>`` and the message naming the fix."""

    field: str  # ``model`` or ``options.<key>``
    message: str


def build_each(models: Mapping[str, ModelToBuild]) -> dict[str, BuildProblem | None]:
    """In the child: model name -> None when its class imports and builds with its options, else
    the problem (the field under ``models.<name>``: ``model`` or ``options.<key>``)."""
    from gpubroker.deployments.models import ModelRefError, resolve_model  # noqa: PLC0415 - the child's import

    out: dict[str, BuildProblem | None] = {}
    for name, spec in models.items():
        ref, options = spec["model"], spec["options"]
        try:
            cls = resolve_model(ref)
        except ModelRefError as exc:
            out[name] = {"field": "model", "message": f"{exc}"}
            continue
        except Exception as exc:  # noqa: BLE001 - whatever the user's module raises on import
            out[name] = {"field": "model", "message": f"importing it raised {type(exc).__name__}: {exc}"}
            continue
        try:
            cls(**options)
            out[name] = None
        except TypeError as exc:
            out[name] = _option_error(ref, cls, options, exc)
        except Exception as exc:  # noqa: BLE001
            out[name] = {
                "field": "options",
                "message": f"building {ref} with these options raised {type(exc).__name__}: {exc}; "
                "fix the option values (or the class's __init__)",
            }
    return out


def _option_error(ref: str, cls: type, options: dict[str, Any], exc: TypeError) -> BuildProblem:
    """An option the class does not take, named with what it takes instead."""
    found = re.search(r"unexpected keyword argument '(\w+)'|unknown option\(s\) '(\w+)'", str(exc))
    key = next((g for g in (found.groups() if found else ()) if g), None)
    if key is None or key not in options:
        return {"field": "options", "message": f"building {ref} raised TypeError: {exc}; fix the options"}
    takes = ", ".join(_takes(cls)) or "no options"
    hint = (
        "; latency and memory figures for simulate go under the model's profile: key, not options"
        if key in PROFILE_KEYS
        else ""
    )
    return {
        "field": f"options.{key}",
        "message": f"{ref} takes no option '{key}' (it takes: {takes}); remove it or correct its spelling{hint}",
    }


def _takes(cls: type) -> list[str]:
    """The keyword options a model class takes: a built-in's OPTIONS, else its __init__'s parameters."""
    import inspect  # noqa: PLC0415

    known = getattr(cls, "OPTIONS", None)
    inner = getattr(cls, "user_class", None)
    if inner is not None and inner is not object:
        cls, known = inner, None
    if known:
        return sorted(known)
    try:
        params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]  # the class's own
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def build_models(cfg: FleetConfig, timeout_s: float = 60.0, cwd: Path | None = None) -> list[ConfigIssue]:
    """Import and build every batch model (``kind: llm`` engines are built-in) in a child
    process; one issue per model that fails, naming the field, the value and the fix."""
    models = {n: ModelToBuild(model=s.model, options=s.options) for n, s in cfg.models.items() if s.kind == "batch"}
    if not models:
        return []
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=json.dumps(models),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": _our_root() + os.pathsep + os.environ.get("PYTHONPATH", "")},
        )
    except subprocess.TimeoutExpired:
        return [
            ConfigIssue(
                "models",
                MISSING,
                f"importing and building the models took over {timeout_s:g} s (a constructor that loads "
                "weights or waits on the network?); raise --import-timeout, or skip this check with --no-import",
            )
        ]
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return [
            ConfigIssue(
                "models",
                MISSING,
                f"the process importing the models failed (exit {proc.returncode}): {' | '.join(tail)}; "
                "fix the error, or skip this check with --no-import",
            )
        ]
    found = [line[len(MARK) :] for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if not found:
        return [
            ConfigIssue("models", MISSING, f"the process importing the models gave no result: {proc.stdout[-300:]}")
        ]
    results = json.loads(found[-1])
    issues = []
    for name, bad in results.items():
        if bad is not None:
            field = bad["field"]
            value = _value_at(cfg.models[name], field)
            issues.append(ConfigIssue(f"models.{name}.{field}", value, bad["message"]))
    return issues


def _our_root() -> str:
    """The directory holding gpubroker's packages, so the child imports ours from a clone too."""
    return str(Path(__file__).resolve().parents[1])


def _value_at(spec: Any, field: str) -> Any:
    if field == "model":
        return spec.model
    if field.startswith("options."):
        return spec.options.get(field.partition(".")[2], MISSING)
    return MISSING


# ============================================================================ kind: llm engines
# The child that reads vLLM's engine arguments: the dataclass fields of AsyncEngineArgs (EngineArgs' and its own)
_VLLM_CHILD = """
import dataclasses, json
try:
    import vllm
except ImportError as exc:
    print("\\n" + MARK + json.dumps({"missing": str(exc)}))
    raise SystemExit(0)
from vllm.engine.arg_utils import AsyncEngineArgs
names = sorted(f.name for f in dataclasses.fields(AsyncEngineArgs) if not f.name.startswith("_"))
print("\\n" + MARK + json.dumps({"version": vllm.__version__, "names": names}))
""".replace("MARK", repr(MARK))


@dataclass(frozen=True)
class LlmCheck:
    """What ``check_llms`` found: issues refuse the config, warnings do not."""

    issues: list[ConfigIssue]
    warnings: list[str]
    checked: str  # one line for validate's summary: how the engine_kwargs were checked


def check_llms(cfg: FleetConfig, with_vllm: bool = True, timeout_s: float = 120.0) -> LlmCheck:
    """Every ``kind: llm`` model: its model on disk, its bounds, its old option names (warnings) and,
    with ``with_vllm``, its engine_kwargs' names against the installed vLLM."""
    from gpubroker.deployments.llm.engine_config import engine_options  # noqa: PLC0415 - no vLLM import
    from gpubroker.deployments.llm.model_source import ModelNotFound  # noqa: PLC0415

    llms = {n: s for n, s in cfg.models.items() if s.kind == "llm"}
    issues: list[ConfigIssue] = []
    warnings = [f"models.{n}.{w}" for n, s in llms.items() for w in deprecated_options(s.options)]
    for name, spec in llms.items():
        try:
            engine_options(dict(spec.options), dict(spec.engine_kwargs), spec.model, spec.llm, cfg.gpu.device, False)
        except ModelNotFound as exc:
            issues.append(ConfigIssue(f"models.{name}.model", spec.model, str(exc)))
        except ValueError as exc:
            named = re.match(r"^((?:options|engine_kwargs)\.\w+)", str(exc))
            where = named.group(1) if named else "engine_kwargs"
            issues.append(ConfigIssue(f"models.{name}.{where}", MISSING, str(exc)))
    written = {n: s.engine_kwargs for n, s in llms.items() if s.engine_kwargs}
    if not written:
        return LlmCheck(issues, warnings, "no engine_kwargs to check")
    if not with_vllm:
        return LlmCheck(issues, warnings, "engine_kwargs not checked against vLLM (--no-import)")
    names = vllm_argument_names(timeout_s)
    if isinstance(names, str):
        warnings.append(f"engine_kwargs of {', '.join(written)} not checked against vLLM's arguments: {names}")
        return LlmCheck(issues, warnings, "engine_kwargs not checked: see the warning")
    version, known = names
    for name, kwargs in written.items():
        for key in sorted(set(kwargs) - set(known)):
            issues.append(
                ConfigIssue(
                    f"models.{name}.engine_kwargs.{key}",
                    kwargs[key],
                    f"not an engine argument of vLLM {version} (vllm.engine.arg_utils.EngineArgs);"
                    f"{did_you_mean(key, known) or ' remove it or correct its spelling'}",
                )
            )
    return LlmCheck(issues, warnings, f"engine_kwargs checked against vLLM {version}'s arguments")


def vllm_argument_names(timeout_s: float = 120.0) -> tuple[str, list[str]] | str:
    """(vLLM's version, its engine argument names) from the vLLM installed beside this Python, or
    why there are none (vLLM not installed, or the child failed). A child reads them: an import
    of vLLM takes seconds and sets up its logging, none of which validate's process needs."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _VLLM_CHILD], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return f"reading vLLM's arguments took over {timeout_s:g} s; raise --import-timeout"
    found = [line[len(MARK) :] for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not found:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
        return f"importing vLLM failed (exit {proc.returncode}): {tail}"
    doc = json.loads(found[-1])
    if "missing" in doc:
        return (
            f"vLLM is not installed in this Python ({sys.executable}: {doc['missing']}); run validate in the "
            "environment the engines run in (in this repository: .venv-vllm, make venv-vllm)"
        )
    return str(doc["version"]), list(doc["names"])


# ============================================================================ budget (--explain)
@dataclass(frozen=True)
class ModelBudget:
    name: str
    replicas: int
    min_bytes: int
    base_bytes: int
    max_bytes: int
    suggested: QuotaSuggestion | None  # from the model's profile: (None without one)


@dataclass(frozen=True)
class CardBudget:
    """One card's memory as the ledger sees it: usable = capacity x (1 - reserve) - contexts."""

    device: str
    capacity_bytes: int | None  # None: gpu.capacity auto, measured at start
    reserve_frac: float
    reserve_bytes: int | None
    processes: int  # replica processes on the card, each with its own CUDA context
    context_bytes_each: int  # per process (0 on cpu)
    context_note: str  # where that figure comes from
    usable_bytes: int | None
    base_sum_bytes: int
    free_bytes: int | None  # usable - sum of base: what lending moves around beyond the bases
    models: tuple[ModelBudget, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def budget(cfg: FleetConfig) -> CardBudget:
    """The card's budget of a one-card fleet (a ``gpus:`` fleet's cards: ``gpubroker.quotas.placement``)."""
    gpu = cfg.gpu
    on_cuda = gpu.device.startswith("cuda")
    each = gpu.context_overhead_bytes(1, on_cuda)
    if gpu.context_overhead != "auto":
        note = "gpu.context_overhead"
    elif on_cuda:
        note = "auto: 512MiB a process on CUDA"
    else:
        note = "auto: 0 on cpu" + (" (512MiB a process if device auto finds CUDA)" if gpu.device == "auto" else "")
    cap = gpu.capacity_bytes
    usable = None if cap is None else cfg.usable_bytes(cap)
    base_sum = sum(m.quota.base for m in cfg.models.values())
    return CardBudget(
        device=gpu.device,
        capacity_bytes=cap,
        reserve_frac=gpu.reserve_frac,
        reserve_bytes=None if cap is None else cap - int(cap * (1.0 - gpu.reserve_frac)),
        processes=cfg.processes,
        context_bytes_each=each,
        context_note=note,
        usable_bytes=usable,
        base_sum_bytes=base_sum,
        free_bytes=None if usable is None else usable - base_sum,
        models=tuple(
            ModelBudget(n, m.replicas, m.quota.min, m.quota.base, m.quota.max, _suggested(cfg, n, m))
            for n, m in cfg.models.items()
        ),
    )


def _suggested(cfg: FleetConfig, name: str, spec: ModelSpec) -> QuotaSuggestion | None:
    """The quota the model's profile suggests, beside Ray Serve's runtime on host memory (the
    process's own measured part is calibrate's: a profile does not hold it)."""
    if spec.profile is None or spec.kind != "batch":
        return None
    p = profile_for(name, spec)  # the profile's blanks filled as simulate fills them
    footprint = Footprint(0, runtime_bytes_for(cfg.gpu.device))
    return suggest_quota(p.a_ms, p.c_ms, p.weights_bytes, p.bytes_per_item, spec, None, footprint, kept_free_frac(cfg))
