"""The served model's tokenizer and chat template, on the gateway side (no torch).

The gateway tokenizes prompts itself so that it knows a request's prompt length before the
engine sees it (context-length checks, quotas, the scheduler's memory admission) and sends the
engine token ids. It uses the Rust `tokenizers` library on the model directory's
tokenizer.json and renders the chat template from tokenizer_config.json with a sandboxed Jinja
environment, as Hugging Face's `apply_chat_template` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

DEFAULT_CONTEXT_LEN = 4096


class TemplateError(ValueError):
    """The chat template rejected the conversation (message names the reason)."""


class ModelTokenizer:
    """Encodes text and renders chat conversations for one model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir}")
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        model_config = _read_json(model_dir / "config.json")
        self.bos_token: str = _token_text(tok_config.get("bos_token")) or ""
        self.eos_token: str = _token_text(tok_config.get("eos_token")) or ""
        self.context_len: int = int(
            model_config.get("max_position_embeddings")
            or tok_config.get("model_max_length")
            or DEFAULT_CONTEXT_LEN
        )
        self.vocab_size: int = _model_vocab_size(model_config) or int(
            self._tokenizer.get_vocab_size(with_added_tokens=True)
        )
        """The model's vocabulary, tokens: the rows of its embedding table, as the engine reads
        them (config.json's `vocab_size`; the tokenizer's size when the config has none). A
        prompt token id at or above it reads past the table and kills the engine."""
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # HF allows named templates; take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self._template = _compile(template) if template else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of *text*."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        """The prompt text for *messages* (OpenAI-style dicts with role and text content)."""
        if self._template is None:
            raise TemplateError("the model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template rejected the messages: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the rendered conversation, ready for generation. The template already
        holds any BOS token, so no special tokens are added again."""
        text = self.render_chat(messages, add_generation_prompt=True)
        return self.encode(text, add_special_tokens=False)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def _model_vocab_size(model_config: dict[str, Any]) -> int | None:
    # a multimodal model keeps its language model's settings under text_config
    for config in (model_config, model_config.get("text_config")):
        if isinstance(config, dict) and isinstance(config.get("vocab_size"), int):
            return int(config["vocab_size"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or {"content": ...} dicts
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None
