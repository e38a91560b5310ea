"""Model resolution, the build-once cache and loading onto a device."""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from prefixgate.models import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    ModelNotFoundError,
    cache_dir,
    ensure_tokenizer_dir,
    model_dir,
    publish_dir,
)
from prefixgate.tokenizer import ChatTokenizer
from replica.models import (
    BUILDERS,
    LoadedModel,
    build_tiny_random,
    ensure_model_dir,
    load_model,
    resolve_dtype,
)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def test_names_and_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Every model the replica can build is a name the gateway knows, the default among them.
    assert DEFAULT_MODEL in BUILDERS and set(BUILDERS) <= set(BUILTIN_MODELS)
    monkeypatch.setenv("PREFIXGATE_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    assert model_dir("tiny-random").parent == tmp_path / "cache" / "models"
    assert not model_dir("tiny-random").exists()  # model_dir does no work
    assert model_dir(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(ModelNotFoundError, match="neither a builtin model"):
        model_dir("no-such-model")
    with pytest.raises(ModelNotFoundError, match=r"no tokenizer\.json"):
        ensure_tokenizer_dir(str(tmp_path))
    monkeypatch.delenv("PREFIXGATE_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "prefixgate"


def test_tiny_random_shape_and_forward(tiny: LoadedModel) -> None:
    assert (tiny.num_layers, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim) == (4, 4, 2, 16)
    assert tiny.max_context == 8192 and tiny.vocab_size == tiny.tokenizer.vocab_size == 49152
    assert tiny.dtype == torch.float32 and tiny.device == torch.device("cpu")
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())
    ids = tiny.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    with torch.inference_mode():
        logits = tiny.model(torch.tensor([ids])).logits  # [1, S, V]
    assert logits.shape == (1, len(ids), tiny.vocab_size)
    assert torch.isfinite(logits).all()


def test_tiny_random_is_deterministic(tmp_path: Path, tiny: LoadedModel) -> None:
    """Two independent builds write the same weights, and they are the cached ones."""
    first, second = tmp_path / "a", tmp_path / "b"
    build_tiny_random(first)
    build_tiny_random(second)
    a = load_file(str(first / "model.safetensors"))
    b = load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    cached = tiny.model.state_dict()
    assert torch.equal(cached["model.embed_tokens.weight"], a["model.embed_tokens.weight"])
    again = load_model("tiny-random")
    assert all(
        torch.equal(x, y)
        for x, y in zip(again.model.parameters(), tiny.model.parameters(), strict=True)
    )


def test_replica_and_gateway_tokenize_alike(tiny: LoadedModel) -> None:
    gateway = ChatTokenizer.for_model("tiny-random")
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "Q 12 ü 🎉"}]
    assert tiny.tokenizer.encode_chat(chat) == gateway.encode_chat(chat)
    assert tiny.tokenizer.eos_token_ids == gateway.eos_token_ids == [2]


def test_local_folder_and_dtype(tiny: LoadedModel) -> None:
    local = load_model(str(tiny.path), dtype="bfloat16")
    assert local.name == str(tiny.path) and local.path == tiny.path
    assert local.dtype == torch.bfloat16
    assert next(local.model.parameters()).dtype == torch.bfloat16
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def _count_and_fill(out: Path) -> None:
    # Appending to a log outside the staging folder counts how many builders ran.
    with (out.parent.parent / "builds.log").open("a") as log:
        log.write("built\n")
    # A conversion takes a while; without the lock, every process would be building now.
    time.sleep(0.2)
    (out / "weights").write_text("complete")


def _publish(final: str, start: Barrier) -> None:
    start.wait()  # all processes ask at the same moment, as replicas started together do
    publish_dir(Path(final), _count_and_fill)


def test_publish_dir_builds_once_across_processes(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "model"
    final.parent.mkdir(parents=True)
    context = multiprocessing.get_context("fork")
    start = context.Barrier(4)
    workers = [context.Process(target=_publish, args=(str(final), start)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert (final / "weights").read_text() == "complete"
    assert (tmp_path / "builds.log").read_text() == "built\n"
    assert [p.name for p in final.parent.iterdir() if p.is_dir()] == ["model"]  # no staging left


def test_publish_dir_failure_leaves_nothing_and_race_loser_yields(tmp_path: Path) -> None:
    final = tmp_path / "model"

    def broken(out: Path) -> None:
        (out / "half").write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish_dir(final, broken)
    assert not final.exists()
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []

    def loses_race(out: Path) -> None:
        # Another process (not honouring the lock) publishes while we build.
        final.mkdir()
        (final / "weights").write_text("winner")
        (out / "weights").write_text("loser")

    assert publish_dir(final, loses_race) == final
    assert (final / "weights").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["model"]


def test_tiny_random_honours_prefixgate_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PREFIXGATE_CACHE", str(tmp_path))
    path = ensure_model_dir("tiny-random")
    assert path.parent == tmp_path / "models"
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in path.iterdir()
    }
    assert (tmp_path / "tokenizers").is_dir()


@pytest.mark.slow
def test_smollm2_converts_once_and_answers(capsys: pytest.CaptureFixture[str]) -> None:
    """Uses the default cache, so a fresh machine converts once and later runs reuse it."""
    first = load_model("smollm2-135m")
    capsys.readouterr()
    second = load_model("smollm2-135m")
    assert "converting" not in capsys.readouterr().err  # loaded from the converted folder
    assert second.path == first.path
    assert (second.num_layers, second.num_heads, second.num_kv_heads, second.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert second.tokenizer.eos_token_ids == [second.tokenizer.token_to_id("<|im_end|>")]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = second.tokenizer.encode_chat(chat)
    assert ids == ChatTokenizer.for_model("smollm2-135m").encode_chat(chat)
    model: Any = second.model  # generate() is untyped in transformers
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=second.tokenizer.eos_token_ids,
        )
    answer = second.tokenizer.decode(out[0, len(ids) :].tolist())
    assert "Paris" in answer, answer
