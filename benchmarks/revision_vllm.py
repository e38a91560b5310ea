"""Engines pinned to a Hub model's revision (vLLM's ``--revision``) whose chat template
changed since, behind a gateway from each tree: do the gateway's keys find the blocks
vLLM cached?

    # a Hugging Face cache holding acme/smol twice: the pinned revision (SmolLM2-135M's
    # files) and main, whose template's default system prompt has since been reworded
    .venv/bin/python benchmarks/revision_vllm.py --make-cache /tmp/hf-cache
    # two engines: HF_HUB_CACHE=/tmp/hf-cache HF_HUB_OFFLINE=1 ... --model acme/smol
    # --revision PINNED (printed by --make-cache), --kv-events-config ...
    HF_HUB_CACHE=/tmp/hf-cache HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/revision_vllm.py \
        --model acme/smol --engine http://127.0.0.1:8100,5600,5610 \
        --engine http://127.0.0.1:8101,5601,5611 --tree before=DIR --tree after=.

Each tree's gateway takes the model's tokenizer as it finds it (the engines' model cards
name ``acme/smol``: the default branch), and, where it reads ``ID@REV``, ``--tokenizer
acme/smol=acme/smol@PINNED``, as a user who pinned the engines tells it. Conversations as
in benchmarks/special_tokens_vllm.py, without a system prompt of their own (the template
writes its default); ``--chats`` conversations of ``--turns`` turns, ``--wait-s`` apart.
Prints, over the turns after the first: those the engine holding the conversation
served, the cached tokens the routes predicted, the prompt tokens the engines read.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from special_tokens_vllm import chat_turns, parser, run

WAYS = ("chat without a system prompt",)
PINNED = "1111111111111111111111111111111111111111"
MAIN = "2222222222222222222222222222222222222222"
REPO = "acme/smol"


def request(way: str, model: str, turns: list[str]) -> tuple[str, dict[str, Any]]:
    body = {"model": model, "messages": chat_turns(turns)[1:], "max_tokens": 1}
    return "/v1/chat/completions", body


def make_cache(cache: Path) -> None:
    """``REPO`` in a Hugging Face cache: the pinned revision holds SmolLM2-135M's converted
    folder (its files hard-linked), main the same with the template's default system
    prompt reworded, as model repositories revise their templates after release."""
    from prefixgate.models import model_dir

    source = model_dir("smollm2-135m")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    for revision in (PINNED, MAIN):
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            target = snapshot / path.name
            if not target.exists():
                try:
                    target.hardlink_to(path)
                except OSError:
                    shutil.copy(path, target)
    template = repo / "snapshots" / MAIN / "chat_template.jinja"
    text = template.read_text()
    template.unlink()  # a hard link: the pinned revision keeps its own
    old = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    template.write_text(text.replace(old, "You are SmolLM, a helpful assistant."))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(MAIN)
    print(f"{REPO}: pinned revision {PINNED}, main {MAIN}, in {cache}")


def main() -> None:
    if sys.argv[1:2] == ["--make-cache"]:
        make_cache(Path(sys.argv[2]))
        return
    args = parser(__doc__, REPO).parse_args()
    engines = [e.split(",") for e in args.engine]
    for name, tree in [t.split("=", 1) for t in args.tree] or [["this", "."]]:
        reads_revisions = (
            "def hub_revision" in (Path(tree) / "prefixgate" / "models.py").read_text()
        )
        pinned = f"{REPO}@{PINNED}"
        gateway = ["--tokenizer", f"{REPO}={pinned}"] if reads_revisions else []
        bridge = ["--tokenizer", pinned] if reads_revisions else []
        print(f"{name}: gateway given {' '.join(gateway) or 'nothing'}")
        run(tree, name, engines, args, WAYS, request, gateway_args=gateway, bridge_args=bridge)


if __name__ == "__main__":
    main()
