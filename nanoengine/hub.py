"""Models from the Hugging Face Hub: which ids reach it, what a download fetches, and the folder of a
snapshot in its cache (downloaded once, or read from the cache alone with HF_HUB_OFFLINE=1). Chapter 00.
`assets.resolve_model` asks here after a local folder and an asset name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# what a Hub download fetches: configs, tokenizers (json, BPE merges, sentencepiece, tiktoken), chat
# templates, safetensors weights; never *.bin/*.pt/*.gguf/*.onnx copies of them (nanoengine loads safetensors)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # "org/name", as the Hub spells repo ids


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now: huggingface_hub reads it once, at its import."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or env.strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_snapshot(repo_id: str) -> Path:
    """Hub id -> the folder of its snapshot in the Hugging Face cache: downloaded (only HUB_PATTERNS) when
    online, the cached snapshot when offline; a ModelNotFoundError naming the id and the ways out when
    neither gives one."""
    from huggingface_hub import constants, snapshot_download

    from nanoengine.errors import ModelNotFoundError

    offline = hub_offline()
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=offline))
    except Exception as e:  # noqa: BLE001 - every way the Hub or its cache fails becomes the one error below
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        error = f"{type(e).__name__}: {detail}" if detail else type(e).__name__
        if offline:  # not cached at all, or cached in part (IncompleteSnapshotError: the error says what)
            where = f"the cache at {constants.HF_HUB_CACHE}"
            missing = type(e).__name__ == "LocalEntryNotFoundError"
            why = f"offline, HF_HUB_OFFLINE=1, and {f'not in {where}' if missing else f'{where}: {error}'}"
            fix = f"download it while online (`hf download {repo_id}`, or unset HF_HUB_OFFLINE)"
        else:
            why = error
            fix = ("check the id and your connection (a gated or private model needs `hf auth login` or "
                   "HF_TOKEN)")
        raise ModelNotFoundError(f"model {repo_id!r}: no local folder {repo_id!r}, and the Hugging Face "
                                 f"Hub could not give it ({why}); {fix}, or pass a local checkpoint "
                                 "folder") from e
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"model {repo_id!r}: its Hugging Face Hub snapshot ({folder}) has no "
                                 "config.json; nanoengine loads transformers checkpoints (config.json, "
                                 "tokenizer files, *.safetensors)")
    return folder
