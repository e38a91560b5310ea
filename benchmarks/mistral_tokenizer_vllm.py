"""A model in Mistral's own format, behind a gateway from each tree: do the gateway's keys
find the blocks vLLM cached, when vLLM encodes its chats with Mistral's tokenizer?

    # a small random model in Mistral's format (config.json, consolidated.safetensors and
    # mistral_common's tokenizer.model.v7, as Mistral's repositories hold them)
    .venv/bin/python benchmarks/mistral_tokenizer_vllm.py --make-model /tmp/mistral-model
    # two engines on it (vLLM picks Mistral's tokenizer by itself: --tokenizer-mode auto),
    # --model /tmp/mistral-model --served-model-name mistral-model, --kv-events-config ...
    .venv/bin/python benchmarks/mistral_tokenizer_vllm.py \
        --engine http://127.0.0.1:8100,5600,5610 --engine http://127.0.0.1:8101,5601,5611 \
        --tree before=DIR --tree after=.
    # one engine: an agent's request on each API, asked twice 35 s apart
    .venv/bin/python benchmarks/mistral_tokenizer_vllm.py --apis TREE \
        http://127.0.0.1:8100,5600,5610

vLLM 0.32 encodes a chat for such a model with ``mistral_common``, never a template. The
gateway takes the model's tokenizer from the engines' model cards (their ``root``).
Conversations as in benchmarks/special_tokens_vllm.py: plain chats, and an agent's (two
tools in every request, each earlier turn a tool call with an OpenAI-style id and its
result); ``--chats`` conversations of ``--turns`` turns, ``--wait-s`` apart. Prints, over
the turns after the first: those the engine holding the conversation served, the cached
tokens the routes predicted, the prompt tokens the engines read from their cache.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from hub_models_vllm import Stack, documents, reset
from reasoning_vllm import KEY_TOKENS, ask
from special_tokens_vllm import chat_turns, run_trees
from tool_use_template_vllm import TOOLS

WAYS = ("chat", "agent with tools")
TOKENIZER = "mistral_instruct_tokenizer_241114.model.v7"  # in mistral_common's package data


def agent_turns(turns: list[str]) -> list[dict[str, Any]]:
    """An agent's chat: a system prompt, then per turn the user's text and, for each turn
    but the latest, the assistant's tool call and the tool's result."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You keep notes."}]
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(turns) - 1:
            call_id = f"call_{i:02d}a1b2c3d4e5f6"  # OpenAI's ids are longer than Mistral's 9
            call = {"name": "add_note", "arguments": json.dumps({"q": f"part {i + 1}"})}
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": call_id, "type": "function", "function": call}],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": "saved"})
    return messages


def request(way: str, model: str, turns: list[str]) -> tuple[str, dict[str, Any]]:
    if way == "chat":
        body: dict[str, Any] = {"model": model, "messages": chat_turns(turns), "max_tokens": 1}
    else:
        body = {"model": model, "messages": agent_turns(turns), "tools": TOOLS, "max_tokens": 1}
    return "/v1/chat/completions", body


def api_requests(model: str, doc: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """An agent's step on each API (a tool call and its result in the history), and a
    plain Responses request. The Responses call id has Mistral's nine characters: vLLM's
    Responses API hands longer ones to mistral_common uncut, which refuses them (400)."""
    fn = TOOLS[0]["function"]
    call = {"name": fn["name"], "arguments": json.dumps({"q": "x"})}
    long_id = "call_0123456789abcdef"
    chat = [
        {"role": "system", "content": doc},
        {"role": "user", "content": "Note it."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": long_id, "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": long_id, "content": "saved"},
        {"role": "user", "content": "Done?"},
    ]
    responses = [
        {"role": "user", "content": "Note it."},
        {"type": "function_call", "call_id": "abc123xyz", **call},
        {"type": "function_call_output", "call_id": "abc123xyz", "output": "saved"},
        {"role": "user", "content": "Done?"},
    ]
    use = {"type": "tool_use", "id": "toolu_01ABCDEFGHIJK", "name": fn["name"], "input": {"q": "x"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_01ABCDEFGHIJK", "content": "saved"}
    messages = [
        {"role": "user", "content": "Note it."},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result, {"type": "text", "text": "Done?"}]},
    ]
    anthropic_tool = {
        "name": fn["name"],
        "description": fn["description"],
        "input_schema": fn["parameters"],
    }
    base = {"model": model, "store": False, "instructions": doc, "max_output_tokens": 1}
    return {
        "chat": (
            "/v1/chat/completions",
            {"model": model, "max_tokens": 1, "tools": TOOLS, "messages": chat},
        ),
        "responses": (
            "/v1/responses",
            {**base, "tools": [{"type": "function", **fn}], "input": responses},
        ),
        "responses, text": ("/v1/responses", {**base, "input": "Summarise."}),
        "messages": (
            "/v1/messages",
            {
                "model": model,
                "max_tokens": 1,
                "system": doc,
                "tools": [anthropic_tool],
                "messages": messages,
            },
        ),
    }


def apis(tree: str, engine: list[str], model: str = "mistral-model") -> None:
    """Each API's request asked, then again 35 s later (past the router's record of where
    it sent them): the cached tokens the second's route predicted, and the engine read."""
    ways = api_requests(model, documents(1, 500, 3)[0])
    with tempfile.TemporaryDirectory() as work:
        stack = Stack(tree, [engine], Path(work))
        try:
            reset([engine], model)
            for path, body in ways.values():
                ask(stack.url, path, body)
            time.sleep(35)  # the record's 30 s, not a wait for a server
            for name, (path, body) in ways.items():
                _, route, prompt, cached = ask(stack.url, path, body)
                found = re.search(r"matched=(\d+)/(\d+)", route)
                predicted = int(found.group(1)) * KEY_TOKENS if found else 0
                print(
                    f"{name}: prompt {prompt} tokens; predicted {predicted}, engine read {cached}"
                )
        finally:
            stack.stop()


def make_model(folder: Path) -> None:
    """A random 2-layer Mistral in Mistral's format: ``config.json`` (vLLM reads it),
    ``consolidated.safetensors`` (Mistral's weight names) and ``tokenizer.model.v7``; no
    ``tokenizer.json``, as in Mistral's recent repositories."""
    import mistral_common
    import torch
    from safetensors.torch import save_file

    hidden, layers, heads, kv_heads, head_dim, ffn, vocab = 256, 2, 4, 2, 64, 512, 32768
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weights = {"tok_embeddings.weight": rand(vocab, hidden), "output.weight": rand(vocab, hidden)}
    weights["norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    for i in range(layers):
        p = f"layers.{i}."
        weights[p + "attention.wq.weight"] = rand(heads * head_dim, hidden)
        weights[p + "attention.wk.weight"] = rand(kv_heads * head_dim, hidden)
        weights[p + "attention.wv.weight"] = rand(kv_heads * head_dim, hidden)
        weights[p + "attention.wo.weight"] = rand(hidden, heads * head_dim)
        weights[p + "feed_forward.w1.weight"] = rand(ffn, hidden)
        weights[p + "feed_forward.w2.weight"] = rand(hidden, ffn)
        weights[p + "feed_forward.w3.weight"] = rand(ffn, hidden)
        weights[p + "attention_norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        weights[p + "ffn_norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(weights, str(folder / "consolidated.safetensors"))
    data = Path(mistral_common.__file__).parent / "data"
    shutil.copy(data / TOKENIZER, folder / "tokenizer.model.v7")


def main() -> None:
    if sys.argv[1:2] == ["--make-model"]:
        make_model(Path(sys.argv[2]))
        return
    if sys.argv[1:2] == ["--apis"]:
        apis(sys.argv[2], sys.argv[3].split(","))
        return
    run_trees(__doc__, "mistral-model", WAYS, request)


if __name__ == "__main__":
    main()
