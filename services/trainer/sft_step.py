"""One SFT optimiser step: the loss on the assistant positions, forwarded in micro-batches that fit memory."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from services.trainer.data import IGNORE, Example, collate, micro_batches
from services.trainer.shared_prefix import plain_head, target_loss


def _target_loss(model: Any, batch: Any, denom: float | None = None) -> Any:
    """Mean next-token cross-entropy over the labelled (assistant) positions.

    The same number as ``model(..., labels=...).loss``, but the vocabulary projection runs only on
    the positions that have a target, and the prompt prefix every row shares is forwarded once
    (:mod:`services.trainer.shared_prefix`). Models whose logits are more than ``lm_head(hidden)`` go
    through the model's own loss.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not plain_head(base):
        loss = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT,
                     labels=batch.labels_BT, use_cache=False).loss
        return loss if denom is None else loss * _n_targets(batch) / denom
    return target_loss(base, batch, denom)


def _n_targets(batch: Any) -> int:
    return int((batch.labels_BT[:, 1:] != IGNORE).sum())


def train_step(model: Any, optimizer: Any, scheduler: Any, examples: list[Example], pad_id: int,
                max_grad_norm: float, trainable: list[Any] | None = None,
                micro_batch_tokens: int = 0) -> dict[str, float]:
    """One optimiser step on one batch; the step's metrics. A batch larger than ``micro_batch_tokens``
    (padded) is forwarded in parts whose gradients accumulate: the same step, a bounded peak memory."""
    import torch

    t0 = time.perf_counter()
    lr = scheduler.get_last_lr()[0]
    parts = micro_batches(examples, micro_batch_tokens)
    weighted = any(e.weight != 1.0 for e in examples)
    denom = sum((e.weight if weighted else 1.0) * e.n_target for e in examples) if len(parts) > 1 else None
    loss, tokens, padded = 0.0, 0, 0
    for part in parts:
        batch = collate(part, pad_id)
        if weighted and batch.weight_B is None:  # a part whose weights are all 1 still counts against the batch's
            batch = dataclasses.replace(batch, weight_B=torch.ones(len(part)))
        part_loss = _target_loss(model, batch, denom)
        part_loss.backward()
        loss += float(part_loss.detach())
        tokens, padded = tokens + batch.tokens, padded + batch.attention_mask_BT.numel()
    if trainable is None:
        trainable = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    return {"loss": loss, "grad_norm": float(grad_norm), "lr": lr, "tokens": tokens, "tokens_per_s": tokens / dt,
            "nonpad_fraction": tokens / padded, "step_time_s": dt, "batch_size": len(examples),
            "micro_batches": len(parts)}
