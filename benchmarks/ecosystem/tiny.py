"""A tiny causal language model, its tokenizer and the data sets of the TRL / PEFT comparison, all made
offline and deterministically (nothing is downloaded).

The tokenizer reads one character per token (a WordLevel vocabulary over lower-case letters, digits,
space and a little punctuation, plus ``<pad> <s> </s> <unk>``), wrapped in transformers'
``PreTrainedTokenizerFast``. The model is a 2-layer Llama of width 32 whose weights come from a fixed
seed; both are saved with ``save_pretrained`` once, and every rank of every run loads the same files.
"""
from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.digits + " .,!?:")
WORDS = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "log", "big", "red", "fast", "slow", "and", "then"]


def build_tokenizer() -> Any:
    """A character-level fast tokenizer with bos/eos/pad/unk."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=64)


def build_model(vocab_size: int) -> Any:
    """The tiny Llama, initialised from seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config)


def save_tiny(directory: Path) -> Path:
    """Write the tokenizer and model to ``directory`` (once; later calls reuse the files)."""
    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.save_pretrained(directory)
    model.save_pretrained(directory)
    return directory


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def text_rows(n: int, seed: int = 1) -> dict[str, list[str]]:
    """SFT rows: ``{"text": [...]}``."""
    rng = random.Random(seed)
    return {"text": [sentence(rng, rng.randint(3, 6)) for _ in range(n)]}


def preference_rows(n: int, seed: int = 2) -> dict[str, list[str]]:
    """DPO rows: a prompt, a chosen and a rejected continuation."""
    rng = random.Random(seed)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        rows["prompt"].append(sentence(rng, 2) + " ")
        rows["chosen"].append(sentence(rng, 3))
        rows["rejected"].append(sentence(rng, 2))
    return rows


def prompt_rows(n: int, seed: int = 3) -> dict[str, list[str]]:
    """GRPO rows: prompts only."""
    rng = random.Random(seed)
    return {"prompt": [sentence(rng, 2) + " " for _ in range(n)]}


def count_a_reward(completions: list[str], **_: Any) -> list[float]:
    """GRPO's reward: how many letters 'a' a completion holds (deterministic, reads only the text)."""
    return [float(c.count("a")) for c in completions]
