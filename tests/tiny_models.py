"""Tiny random Hugging Face decoder models and a tokenizer, built in code for fast tests.

``save_tiny_model(family, path)`` writes a loadable model directory (config, safetensors,
tokenizer with a chat template), so the engine loads it exactly like a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
VOCAB_SIZE = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching keeps every slot of the GPU busy.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Redis streams deliver each entry to one consumer of a group.",
    "héllo wörld, naïve café, 日本語のテキスト, emoji 🙂 and ünïcödé.",
    "Write a haiku about the sea. What is the capital of France? Explain gravity.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; : ' \"",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a small in-code corpus, with a chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(family: str, vocab_size: int, eos_token_id: int) -> PretrainedConfig:
    """A 2-layer, GQA (where the family has it) config of the given family."""
    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=eos_token_id, pad_token_id=0)
    if family == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=1024, **common)
    if family == "qwen2":
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=1, max_position_embeddings=1024, use_sliding_window=False, **common)
    if family == "mistral":
        return MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=2, max_position_embeddings=1024, sliding_window=None, **common)
    if family == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common)
    raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")


def save_tiny_model(family: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Build a random tiny model of ``family`` and save it (with tokenizer) under ``path``."""
    tokenizer = build_tokenizer()
    eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    config = tiny_config(family, len(tokenizer), eos_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init has near-flat logits; a larger scale gives decisive, varied greedy choices.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
