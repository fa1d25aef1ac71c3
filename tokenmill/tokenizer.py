"""Tokenizer loading (HF folder or GGUF file) and chat-template rendering.

We lean on transformers for both: its GGUF tokenizer converter rebuilds a fast tokenizer
(and the chat template) from GGUF metadata, as vLLM does, and it runs fully offline.
For GGUF we call PreTrainedTokenizerFast directly: AutoTokenizer would first parse the whole
file again just to pick a class (seconds for a 49k vocabulary), and the tokenizer a GGUF
describes is fully built by the converter anyway (same result, checked in tests).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def _gguf_in_folder(folder: Path) -> Path | None:
    """A folder with no tokenizer files but exactly one .gguf file stands for that file."""
    if any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    ggufs = sorted(folder.glob("*.gguf"))
    return ggufs[0] if len(ggufs) == 1 else None


def load_tokenizer(model_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a Hugging Face model folder or of a .gguf file, without network."""
    path = Path(model_path)
    if not path.exists():
        raise ValueError(f"model path not found: {str(model_path)!r}")
    if path.is_dir() and (gguf := _gguf_in_folder(path)) is not None:
        path = gguf
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"expected a model folder or a .gguf file, got {str(path)!r}")
        from tokenmill.executor.loader.gguf import check_gguf_file

        check_gguf_file(path)  # a clear ValueError for a file that is not GGUF
        try:
            return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        except Exception as e:  # e.g. a tokenizer model transformers cannot rebuild from GGUF
            raise ValueError(f"could not build a tokenizer from GGUF metadata of {str(path)!r}: {e}") from e
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {str(path)!r}: {e}") from e


def check_chat_template(template: str) -> None:
    """A ValueError that says what is wrong when `template` is not a Jinja chat template (a path that is not there
    reads as one without a single tag)."""
    import jinja2
    if "{{" not in template and "{%" not in template:
        raise ValueError(f"chat template {template[:80]!r} is neither a file nor a Jinja template (it has no {{{{ }}}} "
                         f"or {{% %}} tags)")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Render messages with the model's chat template and tokenize, with at most one BOS. tools (OpenAI's tool
    dicts) go to templates that render them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this tokenizer has no chat template; use a plain prompt (completions) "
            "or a model whose tokenizer_config.json / GGUF metadata has one")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    # Templates usually write the BOS text themselves; adding special tokens would double it.
    bos = tokenizer.bos_token
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add_special))
