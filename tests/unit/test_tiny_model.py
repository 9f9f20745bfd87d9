"""The built-in tiny model: built once, atomically, with a tokenizer that round-trips any text."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backend.launch import tiny_model
from backend.launch.tiny_model import ensure_tiny_model, model_context_length

TEXTS = [
    "Hello, world! How are you today?",
    "  two leading spaces, a tab\tand a newline\n",
    "ünïcødé, emoji 😀 and 漢字 survive too",
    "def f(x):\n    return x ** 2  # code",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def test_dir_holds_a_llama_config_sized_to_the_tokenizer(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == tokenizer.get_vocab_size()
    assert 3000 <= config["vocab_size"] <= 4096
    assert config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    assert model_context_length(model_dir) == 4096
    assert model_dir.name.endswith(f"-v{tiny_model.FORMAT_VERSION}")
    for name in ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        assert (model_dir / name).is_file()


@pytest.mark.parametrize("text", TEXTS)
def test_any_text_round_trips(model_dir: Path, text: str) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text


def test_english_costs_about_one_token_per_word(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "the people could find the answer to this question in the document"
    assert len(tokenizer.encode(text).ids) <= len(text.split()) + 2


def test_chat_template_renders_chatml(model_dir: Path) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = ImmutableSandboxedEnvironment().from_string(config["chat_template"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not template.render(messages=messages).endswith("assistant\n")


def test_second_call_is_a_no_op(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def must_not_build(out: Path) -> None:
        raise AssertionError("rebuilt an existing model")

    monkeypatch.setattr(tiny_model, "_write_model_dir", must_not_build)
    assert ensure_tiny_model(model_dir.parent) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_concurrent_builders_agree(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_tiny_model(tmp_path)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temp dirs left behind


def test_builds_are_identical(model_dir: Path, tmp_path: Path) -> None:
    other = ensure_tiny_model(tmp_path)
    for path in model_dir.iterdir():
        assert (other / path.name).read_bytes() == path.read_bytes(), path.name


def test_module_cli_prints_the_dir_without_importing_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from backend.launch.tiny_model import main; main([sys.argv[1]]);"
        "assert 'torch' not in sys.modules, 'tiny_model imported torch'"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert Path(out.stdout.strip()) == tmp_path / tiny_model.MODEL_DIR_NAME
