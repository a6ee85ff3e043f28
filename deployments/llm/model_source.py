"""Where a ``kind: llm`` model's weights are: a local Hugging Face directory, or a model id found in
the local Hugging Face cache. Nothing is downloaded: an engine starts from files already on disk
(the engine also runs with ``HF_HUB_OFFLINE=1``), so ``gpubroker validate`` refuses a model id
that is not in the cache, naming the folder it looked in.

Stdlib only: ``gpubroker validate`` resolves models without vLLM or ``huggingface_hub``. The cache
layout is the hub's: ``<cache>/models--<org>--<name>/refs/<revision>`` holds a commit and
``snapshots/<commit>/`` the files.
"""

from __future__ import annotations

import os
from pathlib import Path

PATH_PREFIXES = ("/", "./", "../", "~")


class ModelNotFound(ValueError):
    """A model that is neither a directory in Hugging Face layout nor in the local cache."""


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as ``huggingface_hub`` finds it: HF_HUB_CACHE, HF_HOME/hub,
    XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def cache_entry(model_id: str, cache: Path | None = None) -> Path:
    """The cache folder of ``model_id`` (whether or not it exists)."""
    return (cache or hf_cache_dir()) / ("models--" + model_id.replace("/", "--"))


def resolve_model(ref: str, base: Path | None = None, revision: str | None = None, cache: Path | None = None) -> Path:
    """The local directory of ``ref``: a directory (relative to ``base``, default the current one)
    holding ``config.json``, else ``ref`` as a model id in the Hugging Face cache at ``revision``
    (default ``main``). Raises ``ModelNotFound`` saying where it looked and what to do."""
    path = Path(ref).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"directory {path} has no config.json: not a model in Hugging Face layout")
        return path
    if ref.startswith(PATH_PREFIXES):
        raise ModelNotFound(f"directory {path} does not exist; write an existing model directory")
    entry = cache_entry(ref, cache)
    rev = revision or "main"
    ref_file = entry / "refs" / rev
    commit = ref_file.read_text(encoding="utf-8").strip() if ref_file.is_file() else rev
    snapshot = entry / "snapshots" / commit
    if (snapshot / "config.json").is_file():
        return snapshot
    raise ModelNotFound(
        f"'{ref}' is not a directory under {base or Path.cwd()} and not in the local Hugging Face cache "
        f"(looked in {snapshot}); weights are never downloaded at run time: fetch it first "
        f"(`huggingface-cli download {ref}`, HF_HUB_CACHE picks the cache) or write its directory"
    )


def context_length(config: dict[str, object]) -> int | None:
    """The model's context length as its config.json gives it (the keys vLLM reads first), or None."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    text = config.get("text_config")
    return context_length(text) if isinstance(text, dict) else None
