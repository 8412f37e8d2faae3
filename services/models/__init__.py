"""Base models the trainer and sampler start from: the embedded SmolLM2 and any Hugging Face directory."""
