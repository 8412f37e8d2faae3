"""A tiny, randomly initialised Llama-style causal LM, its tokenizer and LoRA adapters, built offline.

The byte-level BPE is trained in code on a small corpus (the router's system prompt, provider names,
the ordering punctuation and a few ChatML turns), so any text encodes; it carries SmolLM2's ChatML chat
template, so ``apply_chat_template``, padding and decoding behave as with the real model. The model is a
2-layer Llama with a 32-wide residual stream: it loads with ``AutoTokenizer`` /
``AutoModelForCausalLM.from_pretrained(dir)`` in well under a second and a training step takes
milliseconds.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = (
    "You route search queries to search providers. The providers are: bio-dense, bm25-all, "
    "dense-all, eng-bm25, lib-bm25, alpha, beta, gamma.",
    "Read the user's query and answer with every provider, best first, in one line: names "
    "separated by ' > ', equally good providers joined by ' = ' (for example: a > b = c). "
    "Answer with that line only.",
    "bm25-all = dense-all > eng-bm25 > lib-bm25 > bio-dense",
    "what is the effect of protein on cells in the heart of a mouse model study query search",
    "which search provider should answer this query about cells and proteins",
    "aerodynamics of a wing at supersonic speed; library indexing and retrieval",
    "Hello world! The quick brown fox jumps over the lazy dog. 0123456789",
    "<|im_start|>user\nwhat is a cell?<|im_end|>\n<|im_start|>assistant\nbio-dense<|im_end|>\n",
)


def build_tokenizer(vocab_size: int = 448):
    """A byte-level BPE fast tokenizer trained on :data:`CORPUS`, with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>",
                                   chat_template=CHAT_TEMPLATE)


def build_tiny_model(path: Path, *, hidden: int = 32, layers: int = 2, context: int = 1024,
                     init_std: float = 0.2, seed: int = 0) -> Path:
    """Write a tiny random Llama (config, safetensors weights, generation config, tokenizer) to ``path``
    (created) and return it; a ``path`` that already holds a model is returned as it is.

    ``context`` is ``max_position_embeddings`` (what a server reports as the context length);
    ``init_std`` gives the logits some scale, so a LoRA step shows in the loss and adapters move outputs.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, tie_word_embeddings=True, initializer_range=init_std,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               bos_token_id=tokenizer.bos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def build_lora_adapter(base_dir: Path, out_dir: Path, *, seed: int, r: int = 4,
                       targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj")) -> Path:
    """Save a PEFT LoRA adapter for the model in ``base_dir`` with random, non-zero A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), lora_dropout=0.0,
                     init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():  # peft's non-default init is small; make the adapter move outputs clearly
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    peft_model.save_pretrained(out_dir)
    return out_dir
