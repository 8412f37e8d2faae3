"""A tiny randomly initialised Llama-style causal LM and a byte-level BPE tokenizer, built offline.

The tokenizer is trained in code on a small corpus (the episode system prompt, provider names,
ordering punctuation) and carries SmolLM2's ChatML chat template, so ``apply_chat_template``,
padding and decoding behave as with the real model while a training step takes milliseconds.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You route search queries to search providers. The providers are: bio-dense, bm25-all, "
    "dense-all, eng-bm25, lib-bm25, alpha, beta, gamma.",
    "Read the user's query and answer with every provider, best first, in one line: names "
    "separated by ' > ', equally good providers joined by ' = ' (for example: a > b = c). "
    "Answer with that line only.",
    "bm25-all = dense-all > eng-bm25 > lib-bm25 > bio-dense",
    "what is the effect of protein on cells in the heart of a mouse model study query search",
]


def build_tokenizer(vocab_size: int = 400):
    """A byte-level BPE fast tokenizer with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>",
                                   chat_template=CHAT_TEMPLATE)


def build_tiny_model(path: Path, *, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """Write a tiny random Llama (config, safetensors weights, tokenizer) to ``path``; return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         initializer_range=0.2,  # logits with some scale, so a LoRA step shows in the loss
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
