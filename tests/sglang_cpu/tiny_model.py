"""Make the real-SGLang tests' model offline: a tiny random Llama and a byte-level BPE tokenizer (no hub).

    python tests/sglang_cpu/tiny_model.py OUT_DIR        # in the SGLang venv (transformers, tokenizers, torch)

``LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
num_key_value_heads=2)`` in bf16, seeded, so the weights and therefore greedy outputs are the same on every run. The
vocabulary is :data:`VOCAB_SIZE` (32,000) so that every token id btbctl's tools send (``btbctl bench --prompt ids``
draws ids below 32,000, Llama 2's vocabulary) is a valid embedding row; the tokenizer itself knows a few hundred
tokens, and ids above it decode to nothing, as padded vocabularies do. About 4.2M parameters, 8 MB on disk.
KV: 2 layers x 2 KV heads x 16 dims x 2 (K and V) x 2 bytes = 256 bytes per token.
"""

from __future__ import annotations

import os
import random
import sys

VOCAB_SIZE = 32000
SEED = 0
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def _corpus(n: int = 400) -> list[str]:
    rng = random.Random(SEED)
    words = ["label", "extract", "system", "prompt", "agent", "burst", "prefix", "cache", "token", "page", "the"]
    words += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def make(out: str) -> None:
    """Write the model and tokenizer to ``out`` (created; an existing model there is overwritten)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py OUT_DIR")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    make(sys.argv[1])
