"""A tiny random Llama and its byte-level tokenizer, written to a local directory (no downloads).

vLLM loads a model from a directory in Hugging Face layout: ``config.json``, safetensors
weights, a tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a chat template).
``ensure_tiny_llama(dir)`` writes one: a ``LlamaForCausalLM`` built from a seeded config (2
layers, hidden 128, 2 heads: head_dim 64, the smallest vLLM's CPU attention takes) and a
tokenizer whose ids 0..255 are the UTF-8 bytes, with four special ids after them. It generates
noise, with the right shape: real prefill and decode steps over a real paged KV cache.
``make`` and the tests build it once under ``build/``; the same options give the same weights.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

BYTE_VOCAB = 256
BOS_ID = 256  # beginning of sequence, prepended by encode()
EOS_ID = 257  # end of sequence: generation stops when the model emits it
PAD_ID = 258
SEP_ID = 259  # separates chat turns
VOCAB_SIZE = 260
SPECIAL_TOKENS = {"<s>": BOS_ID, "</s>": EOS_ID, "<pad>": PAD_ID, "<sep>": SEP_ID}

# the chat template: ``role: content<sep>`` per turn after <s>, then ``assistant: `` (ByteTokenizer.encode_chat)
CHAT_TEMPLATE = (
    "<s>{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<sep>{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "build" / "tiny-llama"


class ByteTokenizer:
    """The same ids in pure Python (tests, the benchmark's prompts). ``decode`` drops the special ids."""

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
    """Shape of the tiny model. head_dim = hidden_size / num_heads must be 64 or more for vLLM on CPU."""

    num_layers: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 2
    num_kv_heads: int = 2
    max_model_len: int = 2048  # max_position_embeddings; the engine's context may be set lower
    seed: int = 0

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 64:
            raise ValueError(
                f"hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a whole head_dim >= 64 "
                "(vLLM's CPU attention refuses smaller heads): raise hidden_size or lower num_heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def kv_block_bytes(spec: TinyLlamaSpec, block_tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes of one KV block: ``block_tokens`` tokens of K and V for every layer."""
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * block_tokens * dtype_bytes


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of a ByteLevel pre-tokenizer."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_tokenizer():
    """A ``PreTrainedTokenizerFast`` whose ids are the UTF-8 bytes (a BPE with no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()} | SPECIAL_TOKENS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


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


def ensure_tiny_llama(directory: str | Path = DEFAULT_DIR, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write the model and tokenizer to ``directory`` unless a build of the same ``spec`` is there."""
    out = Path(directory)
    stamp = out / "gpubroker-spec.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("digest") == spec.digest():
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_llama(spec).save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    stamp.write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=1))
    return out


if __name__ == "__main__":  # python -m gpubroker.deployments.llm.tiny_model [DIR]: what `make` runs
    import sys

    print(ensure_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
