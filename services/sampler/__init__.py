"""The CPU sampler: a vLLM-compatible subset (completions with token ids + logprobs, chat, runtime LoRA)."""
