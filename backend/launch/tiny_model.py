"""The built-in tiny model: a Llama-shaped config plus a locally trained tokenizer, no download.

The engine runs it with random ("dummy") weights, so only the *shape* matters: it is small enough
for a 2-core CPU (hidden 256, 4 layers) and its tokenizer is real, so any client text encodes and
decodes exactly (byte-level BPE: every byte is in the alphabet) and benchmark clients can count
tokens with it (point them at the directory this module returns).

The directory is created once under a cache dir, atomically: it is built in a private temp dir
beside the target and renamed into place, so a concurrent caller either sees no directory or a
complete one. Its name carries :data:`FORMAT_VERSION`; bump it whenever the files change and the
next start builds the new format beside the old one.

This module must not import torch (the gateway imports it to locate or create the model);
``tokenizers`` is imported only when a model has to be built.

    python -m backend.launch.tiny_model [cache_dir]     # prints the model directory
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MODEL_DIR_NAME = f"tandem-tiny-v{FORMAT_VERSION}"
DEFAULT_CACHE_DIR = "~/.cache/tandem"

VOCAB_SIZE = 4096  # target size of the BPE vocabulary (the trainer may stop a little short)
CONTEXT_LEN = 4096  # max_position_embeddings, tokens
CORPUS_SEED = 20261121  # fixed: the same corpus, hence the same tokenizer, on every machine

BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"  # ends a chat turn, so chat completions stop where ChatML says
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, "<|im_start|>", EOS_TOKEN, PAD_TOKEN]  # ids 0..3, in this order

# ChatML. Message content may be a string or OpenAI-style parts (only text parts are rendered).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Seed words for the training corpus: common English, so English prompts get realistic token
# counts (about one token per short word), plus generated syllable words for the long tail.
_WORDS_TEXT = (
    "the of and to a in is you that it he was for on are as with his they I at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her would "
    "make like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part over "
    "new sound take only little work know place year live me back give most very after thing "
    "our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put "
    "end does another well large must big even such because turn here why ask went men read "
    "need land different home us move try kind hand picture again change off play spell air "
    "away animal house point page letter mother answer found study still learn should world "
    "model token request server engine latency batch queue tenant deadline memory cache "
    "prompt answer question summary document report data system user assistant please thanks"
)
_SYLLABLES_TEXT = (
    "ba be bi bo bu ca ce co cu da de di do du fa fe fi fo ga ge go ha he hi ho ja ka ke ki ko "
    "la le li lo lu ma me mi mo mu na ne ni no nu pa pe pi po pu ra re ri ro ru sa se si so su "
    "ta te ti to tu va ve vi vo wa we wi ya yo za ze zi zo an en in on un ar er ir or ur st th "
    "ch sh tr pr gr br cl pl ng nt"
)
_WORDS = _WORDS_TEXT.split()
_SYLLABLES = _SYLLABLES_TEXT.split()


def ensure_tiny_model(cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """The tiny model's directory under *cache_dir*, created if missing; safe to race."""
    root = Path(cache_dir).expanduser()
    target = root / MODEL_DIR_NAME
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.", dir=root))
    try:
        _write_model_dir(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; other users' benchmark clients read it
        try:
            tmp.rename(target)  # atomic; fails if another caller's rename won the race
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_context_length(model_dir: str | Path) -> int:
    """The model's context length in tokens (``max_position_embeddings`` of its config.json)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["max_position_embeddings"])


def training_corpus(num_lines: int = 20_000, seed: int = CORPUS_SEED) -> list[str]:
    """Deterministic English-like lines (words, numbers, punctuation, some code) to train on."""
    rng = random.Random(seed)
    invented = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(3000)
    ]
    lines = []
    for _ in range(num_lines):
        words = []
        for _ in range(rng.randint(4, 18)):
            roll = rng.random()
            if roll < 0.70:
                word = rng.choice(_WORDS)
            elif roll < 0.92:
                word = rng.choice(invented)
            else:
                word = str(rng.randint(0, 10_000))
            words.append(word.capitalize() if rng.random() < 0.1 else word)
        line = " ".join(words) + rng.choice([".", ".", ",", "?", "!", ":", ";"])
        if rng.random() < 0.05:
            line = f"def {rng.choice(invented)}(x, y):\n    return x + y  # {line}"
        lines.append(line)
    return lines


def _train_tokenizer() -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on :func:`training_corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # No normalizer (NFC/lowercasing would break the exact round trip); byte-level splitting
    # with the GPT-2 regex, and the full 256-byte alphabet so that no text is ever <unk>.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    return tokenizer


def _write_model_dir(out: Path) -> None:
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    bos_id, eos_id, pad_id = ids[BOS_TOKEN], ids[EOS_TOKEN], ids[PAD_TOKEN]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT_LEN,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # keeps decode(encode(text)) == text
        "model_max_length": CONTEXT_LEN,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, bos_id],  # <|endoftext|> also ends a plain completion
        "pad_token_id": pad_id,
    }
    for name, data in [
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens_map),
        ("generation_config.json", generation_config),
    ]:
        (out / name).write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m backend.launch.tiny_model [cache_dir]``: build if needed, print the directory."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print("usage: python -m backend.launch.tiny_model [cache_dir]", file=sys.stderr)
        return 2
    print(ensure_tiny_model(args[0] if args else DEFAULT_CACHE_DIR))
    return 0


if __name__ == "__main__":
    sys.exit(main())
