"""The served model's tokenizer and chat template, on the gateway side (no torch).

The gateway tokenizes prompts itself so that it knows a request's prompt length before the
engine sees it (context-length checks, quotas, the scheduler's memory admission) and sends the
engine token ids. It uses the Rust `tokenizers` library on the model directory's
tokenizer.json and renders the chat template from tokenizer_config.json with a sandboxed Jinja
environment, as Hugging Face's `apply_chat_template` does.

Tokenizing holds the CPU for about a second per megabyte of text, so a long prompt must neither
reach the tokenizer when it cannot fit the context (`max_text_chars`: a text longer than that is
refused unread) nor be tokenized on the event loop (`encode_off_loop`: a worker thread, while the
Rust library has released the GIL) - otherwise one request freezes the gateway for every tenant
(issue 16).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2 import meta as jinja2meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.tools import ToolFamily, detect_family

DEFAULT_CONTEXT_LEN = 4096
GIL_FREE_MIN_CHARS = 2048
"""Texts at least this long are encoded through `encode_batch`, the tokenizers call that releases
the GIL while it works (`encode` holds it), so the event loop runs while a worker thread
tokenizes; shorter ones are faster the plain way."""
ENCODE_CHUNK_TEXTS = 256
"""Texts per `encode_batch` call when many are encoded (a batch file's lines)."""
TOKENIZER_THREADS = 2
"""Worker threads that tokenize long prompts off the event loop."""
NFC_SHRINK = 4
"""The most characters Unicode canonical composition (NFC, NFKC) turns into one: no character's
canonical decomposition is longer than 4 code points (e.g. U+1F82)."""


_pool: ThreadPoolExecutor | None = None
"""The tokenizing threads (created with the first long prompt)."""


class TemplateError(ValueError):
    """The chat template rejected the conversation (message names the reason)."""


class TextTooLong(ValueError):
    """A text that cannot fit the context however it is tokenized (checked before tokenizing)."""

    def __init__(self, chars: int, min_tokens: int, max_chars_per_token: int) -> None:
        super().__init__(f"{chars} characters make at least {min_tokens} tokens")
        self.chars = chars
        self.min_tokens = min_tokens
        """A lower bound of the text's length in tokens."""
        self.max_chars_per_token = max_chars_per_token


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
        self.max_chars_per_token: int | None = max_chars_per_token(_read_json(tokenizer_file))
        """The most characters of text one token ever stands for (None: the tokenizer may drop
        text, so no such bound holds): a text of n characters is at least n / this tokens."""
        self.max_text_chars: int | None = (
            self.context_len * self.max_chars_per_token
            if self.max_chars_per_token is not None
            else None
        )
        """Texts longer than this cannot fit the context: `encode` refuses them unread."""
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # HF allows named templates; take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self._template = _compile(template) if template else None
        self.declares_tools: bool = isinstance(template, str) and _declares_tools(template)
        """Whether the chat template renders a `tools` variable (Hugging Face's convention for
        a model trained to call tools). The built-in tiny model's does not."""
        self.tool_family: ToolFamily | None = (
            detect_family(template) if isinstance(template, str) and self.declares_tools else None
        )
        """The tool-call format the template teaches (None: none tandem parses, so the model's
        own choice of calls, `tool_choice: auto`, cannot be read back)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of *text*; raises TextTooLong, without tokenizing, for a text longer than
        `max_text_chars`."""
        self.check_length(text)
        if len(text) < GIL_FREE_MIN_CHARS:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        [encoding] = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def encode_many(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int] | TextTooLong]:
        """Token ids of each text (TextTooLong in its place for one too long), a chunk of texts
        per call that releases the GIL: for a worker thread tokenizing a whole batch file."""
        out: list[list[int] | TextTooLong] = []
        for start in range(0, len(texts), ENCODE_CHUNK_TEXTS):
            chunk = texts[start : start + ENCODE_CHUNK_TEXTS]
            results: list[list[int] | TextTooLong] = []
            fitting: list[str] = []
            for text in chunk:
                try:
                    self.check_length(text)
                except TextTooLong as exc:
                    results.append(exc)
                    continue
                results.append([])
                fitting.append(text)
            encodings = iter(
                self._tokenizer.encode_batch(fitting, add_special_tokens=add_special_tokens)
                if fitting
                else []
            )
            out.extend(
                r if isinstance(r, TextTooLong) else list(next(encodings).ids) for r in results
            )
        return out

    async def encode_off_loop(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """`encode` in one of the tokenizing threads (TOKENIZER_THREADS of them, shared by the
        process: long prompts wait for each other, never for the event loop or short prompts)."""
        self.check_length(text)  # refused at once, not after the long prompts queued before it
        global _pool
        if _pool is None:
            _pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            _pool, lambda: self.encode(text, add_special_tokens=add_special_tokens)
        )

    def check_length(self, text: str) -> None:
        """Raises TextTooLong when *text* is longer than `max_text_chars` (cheap: no tokenizing)."""
        bound, per_token = self.max_text_chars, self.max_chars_per_token
        if bound is not None and per_token is not None and len(text) > bound:
            raise TextTooLong(len(text), math.ceil(len(text) / per_token), per_token)

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for *messages* (OpenAI-style dicts with role and text content, an
        assistant's `tool_calls` with decoded arguments) and *tools* (`{"type": "function",
        "function": {...}}` each), as Hugging Face's `apply_chat_template` renders them."""
        if self._template is None:
            raise TemplateError("the model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template rejected the messages: {exc}") from None

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the rendered conversation, ready for generation. The template already
        holds any BOS token, so no special tokens are added again."""
        text = self.render_chat(messages, add_generation_prompt=True, tools=tools)
        return self.encode(text, add_special_tokens=False)


# Normalizers that never make a text shorter (in characters), and the shrink factor of those that
# may, by a bounded factor; pre-tokenizers that keep every character (a Split or Punctuation whose
# behavior is "Removed", or Whitespace, drop some). Anything else: no bound.
_SHRINK_BY_NORMALIZER = {
    "NFD": 1,
    "NFKD": 1,
    "Lowercase": 1,
    "Prepend": 1,
    "NFC": NFC_SHRINK,
    "NFKC": NFC_SHRINK,
}
_KEEPING_PRE_TOKENIZERS = {
    "ByteLevel",
    "Metaspace",
    "Digits",
    "UnicodeScripts",
    "Split",
    "Punctuation",
}


def max_chars_per_token(spec: dict[str, Any]) -> int | None:
    """From a tokenizer.json: the most characters of input text one token can stand for, or None
    when the pipeline may drop or fuse text (then no text is too long to try).

    A BPE token is a string of its vocabulary (or an added token), covering at most that many
    characters of the normalized, pre-tokenized text (with ByteLevel: bytes, never fewer than
    characters). That holds when nothing shrinks the text on the way: normalizers that may merge
    characters (NFC composes at most NFC_SHRINK into one) scale the bound, ones that may delete
    them (Strip, StripAccents, a regex Replace, Precompiled, BertNormalizer) void it, as do
    pre-tokenizers that remove characters, and an unknown-token that absorbs any run of
    characters (`fuse_unk` without byte fallback)."""
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None  # WordPiece, Unigram, WordLevel map a whole unknown word to one token
    if (
        model.get("unk_token") is not None
        and model.get("fuse_unk")
        and not model.get("byte_fallback")
    ):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        return None
    longest = max(len(token) for token in vocab)
    for added in spec.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("content"), str):
            longest = max(longest, len(added["content"]))
    return max(1, longest) * shrink


def _normalizer_shrink(normalizer: Any) -> int | None:
    if normalizer is None:
        return 1
    if not isinstance(normalizer, dict):
        return None
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers") or []:
            part_factor = _normalizer_shrink(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind == "Replace":  # a plain string replaced by one at least as long keeps the length
        pattern, content = normalizer.get("pattern"), normalizer.get("content")
        plain = pattern.get("String") if isinstance(pattern, dict) else None
        if isinstance(plain, str) and isinstance(content, str) and len(content) >= len(plain):
            return 1
        return None
    return _SHRINK_BY_NORMALIZER.get(str(kind))


def _keeps_characters(pre_tokenizer: Any) -> bool:
    if pre_tokenizer is None:
        return True
    if not isinstance(pre_tokenizer, dict):
        return False
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in pre_tokenizer.get("pretokenizers") or [])
    return kind in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _declares_tools(template: str) -> bool:
    """Whether *template* reads a `tools` variable."""
    env = ImmutableSandboxedEnvironment()
    try:
        return "tools" in jinja2meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def _compile(template: str) -> jinja2.Template:
    """The template in the environment Hugging Face's `apply_chat_template` renders it in, so
    the prompt is the one the model was trained on: loop controls, `raise_exception`,
    `strftime_now`, and `tojson` as `json.dumps` (Jinja's own escapes `<>&'` as HTML, which
    would change every tool schema and call argument that holds one)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | str | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`: Hugging Face marks the assistant's tokens with it
    (for training masks); rendering, it is its body unchanged. Without it such a template would
    not compile."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 reads the class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


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
