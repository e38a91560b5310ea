"""Tokenizer files from a GGUF's metadata, without torch or transformers. Torch-free.

A GGUF has no ``tokenizer.json``: it stores the vocabulary, the merges, the special token
ids and the chat template as metadata under llama.cpp's key names. The gateway needs the
tokenizer long before (and without) any model, so we read only the metadata section with
``struct`` (the ``gguf`` package's reader parses the whole file and takes seconds) and write
a Hugging Face tokenizer folder that both ``tokenizers`` and transformers load.

Only the byte-level BPE flavour SmolLM2 uses is built; anything else is refused by name.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

GGUF_MAGIC = b"GGUF"
# llama.cpp's token types: 1 normal, 3 control (special), 4 user-defined (added, not special).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GGUF metadata value types -> struct format of one scalar.
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING = 8
_ARRAY = 9


class _Cursor:
    """Reads little-endian GGUF values from a buffer, front to back."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                values = list(struct.unpack_from(f"<{count}{fmt[1:]}", self.data, self.pos))
                self.pos += struct.calcsize(fmt) * count
                return values
            return [self.value(item_type) for _ in range(count)]
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type])
        raise ValueError(f"unknown GGUF metadata value type {value_type}")


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key/value of a GGUF file (the tensors are not touched)."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        cursor = _Cursor(data)
        cursor.pos = 4
        version = cursor.scalar("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (need 2 or later)")
        cursor.scalar("<Q")  # tensor count: not needed here
        kv_count = cursor.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("<I"))
        return metadata


def _smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm" pre-tokenizer: every digit alone, then GPT-2's split regex;
    # this is the Digits + ByteLevel sequence of SmolLM2's own tokenizer.json.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


# tokenizer.ggml.pre -> the pre-tokenizer that splits text the way the merges were learned.
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "smollm": _smollm_pre_tokenizer,
}


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF metadata."""
    model_kind = metadata.get("tokenizer.ggml.model")
    pre_kind = metadata.get("tokenizer.ggml.pre")
    if model_kind != "gpt2" or pre_kind not in PRE_TOKENIZERS:
        raise ValueError(
            f"cannot build a tokenizer for GGUF tokenizer {model_kind!r} with pre-tokenizer "
            f"{pre_kind!r}; supported: gpt2 with {sorted(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    # Byte-level tokens spell spaces as "Ġ", so a merge line splits on its one real space.
    merges = [tuple(line.split(" ", 1)) for line in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre_kind]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_TYPE_CONTROL
    ]
    added = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(added)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError("GGUF special tokens are not all in its vocabulary")
    return tokenizer


def _token(metadata: dict[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else str(metadata["tokenizer.ggml.tokens"][token_id])


def write_tokenizer_files(gguf_path: Path, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja and
    generation_config.json (eos/bos ids) for the GGUF's tokenizer into ``out_dir``."""
    metadata = read_gguf_metadata(gguf_path)
    tokenizer = build_tokenizer(metadata)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    architecture = metadata.get("general.architecture", "")
    config = {
        # The generic fast class loads tokenizer.json as written; a model-specific class
        # may rebuild the pre-tokenizer from vocab and merges and lose the digit split.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(metadata, "bos_token_id"),
        "eos_token": _token(metadata, "eos_token_id"),
        "unk_token": _token(metadata, "unknown_token_id"),
        "pad_token": _token(metadata, "padding_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get(f"{architecture}.context_length", 2048)),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        (out_dir / "chat_template.jinja").write_text(template)
    generation = {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
