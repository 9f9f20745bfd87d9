"""The gateway's view of the model: its vocabulary size is the engine's (config.json's
`vocab_size`, the embedding table's rows), which token-id prompts are checked against."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from backend.launch.tiny_model import ensure_tiny_model
from gateway.tokenizer import ModelTokenizer


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
