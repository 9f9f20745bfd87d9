"""The gateway's view of the model: its vocabulary size is the engine's (config.json's
`vocab_size`, the embedding table's rows), which token-id prompts are checked against."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.launch.tiny_model import ensure_tiny_model
from gateway.tokenizer import NFC_SHRINK, ModelTokenizer, TextTooLong, max_chars_per_token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def with_config(model_dir: Path, tmp_path: Path, config: dict[str, Any]) -> Path:
    """A copy of the tiny model directory whose config.json is *config*."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_vocab_size_is_the_model_configs(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert ModelTokenizer(model_dir).vocab_size == config["vocab_size"]


def test_a_padded_embedding_table_counts_not_the_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    # many models round the embedding table up (e.g. to a multiple of 64): ids up to it are rows
    config = {**json.loads((model_dir / "config.json").read_text()), "vocab_size": 5000}
    assert ModelTokenizer(with_config(model_dir, tmp_path, config)).vocab_size == 5000


def test_a_multimodal_config_gives_its_text_models_vocabulary(
    model_dir: Path, tmp_path: Path
) -> None:
    config = {"text_config": {"vocab_size": 4100}, "max_position_embeddings": 512}
    assert ModelTokenizer(with_config(model_dir, tmp_path, config)).vocab_size == 4100


def test_without_a_config_vocab_size_the_tokenizers_size_counts(
    model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = ModelTokenizer(with_config(model_dir, tmp_path, {}))
    expected = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert tokenizer.vocab_size == expected


# -- the length bound: a text too long for the context is refused before it is tokenized -------

# Unicode text of every kind, long runs of one character included (the tokenizer merges those
# into its longest tokens). Lone surrogates excluded, as from `st.text`: no JSON body the
# gateway accepts carries one (msgspec refuses `"\ud800"`), and the Rust tokenizer takes only
# valid Unicode (it raises TypeError on one).
_TEXTS = st.one_of(
    st.text(max_size=400),
    st.builds(lambda c, n: c * n, st.characters(codec="utf-8"), st.integers(1, 400)),
    st.lists(st.sampled_from(["=", " ", "\n", "<|endoftext|>", "ab", "é", "😀"]), max_size=200).map(
        "".join
    ),
)


@settings(max_examples=300, deadline=None)
@given(text=_TEXTS)
def test_no_token_stands_for_more_characters_than_the_bound(model_dir: Path, text: str) -> None:
    """The bound refuses no text that could fit: n characters are at least n / bound tokens."""
    tokenizer = _tokenizer(model_dir)
    assert tokenizer.max_chars_per_token is not None
    for add_special_tokens in (True, False):
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert len(ids) * tokenizer.max_chars_per_token >= len(text)


_TOKENIZERS: dict[Path, ModelTokenizer] = {}


def _tokenizer(model_dir: Path) -> ModelTokenizer:
    if model_dir not in _TOKENIZERS:
        _TOKENIZERS[model_dir] = ModelTokenizer(model_dir)
    return _TOKENIZERS[model_dir]


def test_a_text_longer_than_the_bound_is_refused_unread(model_dir: Path) -> None:
    tokenizer = _tokenizer(model_dir)
    assert tokenizer.max_chars_per_token is not None and tokenizer.max_text_chars is not None
    assert tokenizer.max_text_chars == tokenizer.context_len * tokenizer.max_chars_per_token
    tokenizer.check_length("x" * tokenizer.max_text_chars)  # at the bound: tokenized
    with pytest.raises(TextTooLong) as info:
        tokenizer.encode("x" * (tokenizer.max_text_chars + 1))
    assert info.value.min_tokens > tokenizer.context_len


def test_long_texts_encode_as_short_ones_do(model_dir: Path) -> None:
    """Texts past GIL_FREE_MIN_CHARS go through encode_batch (it releases the GIL): same ids."""
    tokenizer = _tokenizer(model_dir)
    text = "the quick brown fox, 12345 " * 200
    plain = list(tokenizer._tokenizer.encode(text).ids)
    assert tokenizer.encode(text) == plain
    assert tokenizer.encode_many(["a", text]) == [tokenizer.encode("a"), plain]


@pytest.mark.parametrize(
    ("change", "bounded"),
    [
        ({"normalizer": {"type": "NFC"}}, True),
        ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFD"}]}}, True),
        ({"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}}, False),
        ({"normalizer": {"type": "BertNormalizer"}}, False),
        ({"pre_tokenizer": {"type": "Whitespace"}}, False),
        ({"pre_tokenizer": {"type": "Split", "behavior": "Removed"}}, False),
        ({"model": {"type": "WordPiece", "vocab": {"a": 0}}}, False),
    ],
)
def test_tokenizers_that_may_drop_text_have_no_bound(
    model_dir: Path, change: dict[str, Any], bounded: bool
) -> None:
    spec = {**json.loads((model_dir / "tokenizer.json").read_text()), **change}
    bound = max_chars_per_token(spec)
    assert (bound is not None) == bounded
    if change.get("normalizer", {}).get("type") == "NFC":
        assert bound == NFC_SHRINK * max_chars_per_token({**spec, "normalizer": None})  # type: ignore[operator]


HERMES_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
)


def test_the_built_in_models_template_declares_no_tools_and_a_hermes_one_does(
    model_dir: Path, tmp_path: Path
) -> None:
    assert not ModelTokenizer(model_dir).declares_tools  # so tools are refused, saying so
    copy = tmp_path / "tool-model"
    shutil.copytree(model_dir, copy)
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = HERMES_LIKE_TEMPLATE
    config_path.write_text(json.dumps(config))
    assert ModelTokenizer(copy).declares_tools
