"""Model names from the Hugging Face hub (`org/name`, `org/name:QUANT` for one GGUF of a repository of GGUFs),
resolved through huggingface_hub into its standard cache: downloaded once when online, read from the cache when
offline (HF_HUB_OFFLINE=1). Every failure says what to do."""
from __future__ import annotations

import os
import re
from typing import Optional

HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<quant>[\w.-]+))?$")


def looks_like_hub_name(name: str) -> bool:
    return HUB_NAME.match(name) is not None and not name.startswith((".", "/", "~"))


def _offline() -> bool:
    from huggingface_hub import constants
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _pick_gguf(repo: str, files: list[str], quant: Optional[str], gguf_file: Optional[str] = None) -> Optional[str]:
    """The repository's one GGUF for quant (its name holds it, in any case) or the file gguf_file names, or None for
    a repository that is a model folder (config.json) and neither was asked for."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if gguf_file is not None:
        if quant is not None:
            raise ValueError(f"{repo}:{quant} and gguf_file={gguf_file!r} both pick a GGUF; give one of them")
        if gguf_file not in ggufs:
            raise ValueError(f"{repo} has no GGUF file {gguf_file!r}; the GGUF files there: "
                             f"{', '.join(ggufs) or 'none'}")
        return gguf_file
    if quant is None:
        if "config.json" in files or not ggufs:
            return None
        if len(ggufs) == 1:
            return ggufs[0]
        raise ValueError(f"{repo} holds {len(ggufs)} GGUF files; name one by its quantisation, as "
                         f"{repo}:Q4_K_M (these are there: {', '.join(ggufs)})")
    match = [f for f in ggufs if quant.lower() in os.path.basename(f).lower()]
    if len(match) != 1:
        there = ", ".join(ggufs) or "none"
        why = "no GGUF file" if not match else f"{len(match)} GGUF files"
        raise ValueError(f"{repo} has {why} matching {quant!r}; the GGUF files there: {there}")
    return match[0]


def resolve_hub_name(name: str, revision: Optional[str] = None, gguf_file: Optional[str] = None) -> str:
    """The local path of hub model `name` (a folder, or a .gguf file for org/name:QUANT or gguf_file, transformers'
    name for one file of a repository of GGUFs): from the cache when offline or cached, else downloaded into it. A
    ValueError that says what to do for anything that fails."""
    m = HUB_NAME.match(name)
    if m is None:
        raise ValueError(f"{name!r} is neither a local path nor a Hugging Face hub name (org/name or "
                         f"org/name:QUANT)")
    repo, quant = m.group("repo"), m.group("quant")
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    cache_dir = os.environ.get("HF_HUB_CACHE") or None    # read per call: the library reads it once, at import
    offline = _offline()

    def from_cache() -> str:
        folder = snapshot_download(repo, revision=revision, cache_dir=cache_dir, local_files_only=True)
        files = [os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs]
        gguf = _pick_gguf(repo, files, quant, gguf_file)
        return folder if gguf is None else os.path.join(folder, gguf)
    try:
        if offline:
            return from_cache()
        try:
            files = HfApi().list_repo_files(repo, revision=revision)
        except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError):
            raise
        except Exception:     # no network (whichever HTTP library the hub client uses), or the hub failed: the cache
            return from_cache()
        gguf = _pick_gguf(repo, files, quant, gguf_file)
        if gguf is not None:          # one file of a repository of GGUFs: only that file
            return hf_hub_download(repo, gguf, revision=revision, cache_dir=cache_dir)
        return snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except GatedRepoError:
        raise ValueError(f"{repo} is gated: accept its terms on huggingface.co, then log in (`hf auth login`, or "
                         f"set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{repo} is not a repository on the Hugging Face hub (or it is private: log in with "
                         f"`hf auth login`, or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"{repo} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        where = cache_dir or "the Hugging Face cache"
        if offline:
            raise ValueError(f"{repo}" + (f" at revision {revision!r}" if revision else "") + f" is not in {where} "
                             f"and HF_HUB_OFFLINE is set: fetch it once with a network (`tokenmill download {name}`), "
                             f"or give a local path") from None
        raise ValueError(f"{repo} could not be fetched (no network?) and is not in {where}; retry with a "
                         f"network, or give a local path") from None


def in_hub_cache(name: str) -> bool:
    """Whether the hub cache holds a repository for hub name `name`."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    m = HUB_NAME.match(name)
    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    return m is not None and os.path.isdir(os.path.join(cache, repo_folder_name(repo_id=m.group("repo"),
                                                                                   repo_type="model")))


def hub_name_of(path: str) -> Optional[str]:
    """org/name for a path inside the hub cache (models--org--name/snapshots/<commit>/...), else None."""
    parts = os.path.normpath(path).split(os.sep)
    for i, p in enumerate(parts[:-2]):
        if p.startswith("models--") and parts[i + 1] == "snapshots":
            return p[len("models--"):].replace("--", "/", 1)
    return None
