"""A tiny, randomly initialised Llama-style causal LM, its tokenizer and LoRA adapters, built offline.

Byte-level BPE trained in code on a few strings (so any text encodes), a ChatML chat template like
SmolLM2's, and a 2-layer Llama with a 32-wide residual stream: it loads with ``AutoTokenizer`` /
``AutoModelForCausalLM.from_pretrained(dir)`` in well under a second, which is what unit tests need.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = (
    "which search provider should answer this query about cells and proteins",
    "the router names one provider: bm25-all, dense-all, bio-dense, lib-bm25 or eng-bm25",
    "aerodynamics of a wing at supersonic speed; library indexing and retrieval",
    "Hello world! The quick brown fox jumps over the lazy dog. 0123456789",
    "<|im_start|>user\nwhat is a cell?<|im_end|>\n<|im_start|>assistant\nbio-dense<|im_end|>\n",
)


def build_tokenizer(out_dir: Path, vocab_size: int = 384):
    """Train a byte-level BPE on :data:`CORPUS`, wrap it for transformers and save it to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_lm(out_dir: Path, *, seed: int = 0) -> Path:
    """Save a tiny random Llama + tokenizer to ``out_dir`` (created); returns ``out_dir``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, initializer_range=0.5,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out_dir)
    return out_dir


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
