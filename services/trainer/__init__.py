"""The trainer: LoRA fine-tuning of the student router on the episode dataset (run kind ``sft``)."""
