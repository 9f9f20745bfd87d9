"""The model's weights are loaded, or refused, never silently replaced (issue 17).

* A model directory without weight files was served with random weights and no word: now
  `tandem serve` refuses it in one line naming the directory and what it lacks, unless
  `model.random_weights` asks for random weights (the built-in tiny model has them explicitly).
* The real loading path: a small Llama made here with transformers (fixed seed, saved as
  safetensors beside the tiny model's tokenizer; nothing downloaded) is launched the way tandem
  launches engines, and SGLang's greedy output on CPU is token for token the output of a greedy
  loop over the same weights in transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.launch.sglang import server_argv
from backend.launch.tiny_model import ensure_tiny_model
from common.config import EngineConfig
from common.sockets import free_port
from tests.functional.engine_fixtures import EngineServer, post_json, running_engine

pytestmark = pytest.mark.slow

SEED = 20261127
NEW_TOKENS = 24
PROMPT_IDS = [17, 301, 5, 942, 77, 1203, 64, 9, 2048, 311, 12, 400]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_small_llama(out: Path, tokenizer_dir: Path) -> None:
    """A 2-layer, 64-wide Llama with seeded random weights, saved as safetensors, with the tiny
    model's tokenizer. The weights are drawn wide (initializer_range 0.5) so that the greedy
    choice never hangs on a near tie that rounding could flip."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from backend.launch.tiny_model import model_context_length

    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    tiny = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=tiny["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=min(model_context_length(tokenizer_dir), 1024),
        rms_norm_eps=1e-5,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=tiny["bos_token_id"],
        eos_token_id=tiny["eos_token_id"],
        pad_token_id=tiny["pad_token_id"],
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def greedy_reference(model_dir: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding in transformers on CPU: argmax of the last position, step by step."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new_tokens):
            next_id = int(model(ids).logits[0, -1].argmax())
            out.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("small-llama")
    model_dir = workdir / "model"
    model_dir.mkdir()
    write_small_llama(model_dir, ensure_tiny_model(workdir / "cache"))
    return model_dir


@pytest.fixture(scope="module")
def small_llama_engine(
    small_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    with running_engine(tmp_path_factory.mktemp("small-llama-engine"), small_llama) as engine:
        yield engine


def test_the_engine_serves_the_saved_weights(
    small_llama: Path, small_llama_engine: EngineServer
) -> None:
    assert list(small_llama.glob("*.safetensors"))
    status, body = post_json(
        small_llama_engine.base_url,
        "/generate",
        {
            "input_ids": PROMPT_IDS,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": NEW_TOKENS,
                "ignore_eos": True,
            },
        },
    )
    assert status == 200, body
    served = list(body["output_ids"])
    expected = greedy_reference(small_llama, PROMPT_IDS, NEW_TOKENS)
    assert served == expected
    assert len(set(expected)) > 1  # not a degenerate model that repeats one token


def test_a_model_without_weights_is_refused(tmp_path: Path, small_llama: Path) -> None:
    bare = tmp_path / "bare-model"
    bare.mkdir()
    for path in small_llama.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy(path, bare / path.name)
    env = dict(
        os.environ,
        TANDEM_ADMIN_TOKEN="weights-admin-token",
        TANDEM_GATEWAY__PORT=str(free_port()),
        TANDEM_ENGINE__PORT=str(free_port()),
        TANDEM_DATABASE__URL=f"sqlite:///{tmp_path / 'serve.db'}",
        TANDEM_MODEL__PATH=str(bare),
        TANDEM_ENGINE__SKIP_PROFILE="true",
    )
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # before: it started the engine on random weights and served on
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"model.path: {bare} holds no weight files" in lines[0]
    assert "model.random_weights" in lines[0]
    # asked for explicitly, random weights are what the engine is told to load
    argv = server_argv(EngineConfig(), bare, "m", random_weights=True)
    assert argv[argv.index("--load-format") + 1] == "dummy"
    with pytest.raises(ValueError, match="holds no weight files"):
        server_argv(EngineConfig(), bare, "m")
