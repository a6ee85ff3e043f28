"""A byte-level tokenizer and a tiny random-initialised Llama (no downloads).

The tokenizer maps UTF-8 bytes to ids 0..255 and keeps four special ids after them; the
model is ``LlamaForCausalLM`` built from a ``LlamaConfig`` with a fixed seed, so two builds
with the same options have the same weights. It generates noise, but noise with the right
shape: a real paged KV cache, real prefill and decode steps, real per-token cost.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

BYTE_VOCAB = 256
BOS_ID = 256  # beginning of sequence, prepended by encode()
EOS_ID = 257  # end of sequence: generation stops when the model emits it
PAD_ID = 258
SEP_ID = 259  # separates chat turns
VOCAB_SIZE = 260


class ByteTokenizer:
    """UTF-8 bytes as tokens. ``decode`` drops the special ids; bad byte runs become U+FFFD."""

    bos_id, eos_id, pad_id, sep_id, vocab_size = BOS_ID, EOS_ID, PAD_ID, SEP_ID, VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder()

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """(role, content) turns as ``role: content`` separated by SEP, then ``assistant: ``."""
        ids = [BOS_ID]
        for role, content in messages:
            ids += self.encode(f"{role}: {content}", add_bos=False) + [SEP_ID]
        return ids + self.encode("assistant: ", add_bos=False)


class StreamDecoder:
    """Incremental decoding: a multi-byte character split over two pieces comes out whole."""

    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: list[int] | tuple[int, ...], final: bool = False) -> str:
        return self._dec.decode(bytes(i for i in ids if 0 <= i < BYTE_VOCAB), final=final)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the tiny model. The defaults are small enough for a test on two CPU cores."""

    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    max_model_len: int = 256  # context length (max_position_embeddings)
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def kv_block_bytes(spec: TinyLlamaSpec, page_tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes of one KV block: ``page_tokens`` tokens of K and V for every layer."""
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * page_tokens * dtype_bytes


def build_tiny_llama(spec: TinyLlamaSpec):
    """The model, in float32 on cpu, eval mode, weights from ``spec.seed`` (the global RNG is left alone)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_model_len,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    return model.eval()
