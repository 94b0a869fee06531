"""`model.path` as a Hugging Face hub id (`org/name`): fetched through huggingface_hub's cache."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("inferx.startup")

# What a checkpoint directory needs: config, safetensors weights and their index, the tokenizer
# files. PyTorch .bin weights and other formats' files are left on the hub.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(source: str) -> bool:
    """`org/name` that is not a path on this machine."""
    return bool(_REPO_ID.match(source)) and not Path(source).exists()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def resolve(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of `repo_id`: from the cache, downloading what is missing."""
    from inferx_core.executor import LoadError

    try:
        import huggingface_hub
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise LoadError(
            f"model.path {repo_id} is not a local path, and reading it from the Hugging Face hub "
            "needs huggingface_hub: pip install huggingface_hub"
        ) from None
    if offline():
        log.info("looking up %s in the Hugging Face cache (HF_HUB_OFFLINE is set)", repo_id)
    else:
        log.info("downloading %s from the Hugging Face hub (or its cache)", repo_id)
    try:
        path = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS
        )
    except RepositoryNotFoundError:
        raise LoadError(
            f"model.path {repo_id}: no such local path, and the Hugging Face hub has no such "
            "model (or it is gated: log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        if offline():
            raise LoadError(
                f"model.path {repo_id} is not in the Hugging Face cache and HF_HUB_OFFLINE is "
                "set: download it where there is a network (`hf download "
                f"{repo_id}`), or unset HF_HUB_OFFLINE, or give a local directory"
            ) from None
        raise LoadError(
            f"model.path {repo_id}: the Hugging Face hub could not be reached and the model is "
            "not in its cache; with no network, download it elsewhere and give its directory, "
            "or set HF_HUB_OFFLINE=1 to use only the cache"
        ) from None
    except OSError as exc:  # network errors that huggingface_hub passes on as they are
        raise LoadError(
            f"model.path {repo_id}: download from the Hugging Face hub failed: {exc}"
        ) from None
    return Path(path)
