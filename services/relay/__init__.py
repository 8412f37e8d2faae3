"""The relay: OpenAI and Anthropic APIs in, token ids to the sampler, every call recorded on ``calls``."""
