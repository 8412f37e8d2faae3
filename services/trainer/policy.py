"""The policy-gradient step OPSD and RL share: per-token logprobs of sampled tokens, the loss, one AdamW step.

Why one module: both run kinds train on tokens a sampler produced, with the sampler's recorded logprobs
as the sampling policy (:mod:`services.trainer.losses`), so the forward pass over the completion
positions, the clipping, the optimizer step and the mismatch/entropy figures must be the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def completion_logprobs(model: Any, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                        pad_id: int, *, length: int | None = None, width: int | None = None) -> tuple[Any, Any, Any]:
    """The trainer's logprob (with gradient) and entropy (detached) of each token after ``prompt_lens[b]``,
    ``[B, C]`` arrays with their mask; the output layer runs only on those positions. ``length`` and
    ``width`` pad T and C to fixed sizes (so batch shapes repeat)."""
    import torch

    from services.trainer.shared_prefix import plain_head

    B = len(sequences)
    T = max(length or 0, max(len(s) for s in sequences))
    C = max(width or 0, max(len(s) - p for s, p in zip(sequences, prompt_lens)))
    ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
    att_BT = torch.zeros((B, T), dtype=torch.long)
    pos_BC = torch.zeros((B, C), dtype=torch.long)
    mask_BC = torch.zeros((B, C), dtype=torch.float32)
    for b, (seq, p) in enumerate(zip(sequences, prompt_lens)):
        ids_BT[b, :len(seq)] = torch.tensor(list(seq))
        att_BT[b, :len(seq)] = 1
        n = len(seq) - p
        pos_BC[b, :n] = torch.arange(p - 1, p - 1 + n)  # position t predicts token t + 1
        mask_BC[b, :n] = 1
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if plain_head(base):
        hidden_BTD = base.get_decoder()(input_ids=ids_BT, attention_mask=att_BT, use_cache=False).last_hidden_state
        picked_BCD = hidden_BTD.gather(1, pos_BC[..., None].expand(-1, -1, hidden_BTD.shape[-1]))
        logits_BCV = base.get_output_embeddings()(picked_BCD).float()
    else:
        logits_BTV = model(input_ids=ids_BT, attention_mask=att_BT, use_cache=False).logits.float()
        logits_BCV = logits_BTV.gather(1, pos_BC[..., None].expand(-1, -1, logits_BTV.shape[-1]))
    logp_BCV = torch.log_softmax(logits_BCV, dim=-1)
    targets_BC = ids_BT.gather(1, (pos_BC + 1).clamp(max=T - 1))
    logprobs_BC = logp_BCV.gather(-1, targets_BC[..., None])[..., 0] * mask_BC
    with torch.no_grad():
        entropy_BC = -(logp_BCV.exp() * logp_BCV).sum(-1) * mask_BC
    return logprobs_BC, entropy_BC, mask_BC


def padded(rows: Sequence[Sequence[float]], C: int) -> Any:
    """Float rows as one zero-padded ``[B, C]`` tensor."""
    import torch

    out = torch.zeros((len(rows), C), dtype=torch.float32)
    for b, r in enumerate(rows):
        out[b, :len(r)] = torch.tensor(list(r), dtype=torch.float32)
    return out


def policy_step(model: Any, optimizer: Any, scheduler: Any, loss_name: str, trainer_lp_BC: Any, sampler_lp_BC: Any,
                advantages_BC: Any, mask_BC: Any, entropy_BC: Any, *, clip_low: float | None,
                clip_high: float | None, max_grad_norm: float) -> dict[str, float]:
    """One step of the named loss on per-token arrays (``mask_BC`` = the positions that count); the loss, grad
    norm, LR, mismatch (mean |sampler - trainer| logprob), its max, entropy and the loss's own figures."""
    acc = Accumulator(loss_name, float(mask_BC.sum()), float((mask_BC.sum(-1) > 0).sum()),
                      clip_low=clip_low, clip_high=clip_high)
    acc.add(trainer_lp_BC, sampler_lp_BC, advantages_BC, mask_BC, entropy_BC)
    return acc.step(model, optimizer, scheduler, max_grad_norm)


class Accumulator:
    """Gradient accumulation over micro-batches of one batch, then one optimizer step.

    Why: a batch of hundreds of rows does not fit a forward pass with gradients in memory; each micro-batch's
    loss is divided by the whole batch's token count (sequence count for GSPO), so the summed gradients equal
    the one-pass batch's exactly, and the figures are the batch's, weighted by tokens.
    """

    def __init__(self, loss_name: str, tokens: float, sequences: float, *, clip_low: float | None,
                 clip_high: float | None) -> None:
        self.loss_name, self.clip_low, self.clip_high = loss_name, clip_low, clip_high
        self.tokens = max(tokens, 1.0)
        self.normalizer = max(sequences, 1.0) if loss_name == "gspo" else self.tokens
        self.loss = self.gap = self.entropy = 0.0
        self.gap_max = 0.0
        self.metrics: dict[str, float] = {}

    def add(self, trainer_lp_BC: Any, sampler_lp_BC: Any, advantages_BC: Any, mask_BC: Any, entropy_BC: Any) -> None:
        """Backward of one micro-batch's share of the batch loss; its figures added to the batch's."""
        from services.trainer.losses import policy_loss

        result = policy_loss(self.loss_name, trainer_lp_BC, sampler_lp_BC, advantages_BC, mask_BC,
                             clip_low=self.clip_low, clip_high=self.clip_high, normalizer=self.normalizer)
        result.loss.backward()
        share = float(mask_BC.sum()) / self.tokens
        gap_BC = (sampler_lp_BC - trainer_lp_BC.detach()).abs() * mask_BC
        self.loss += float(result.loss.detach())
        self.gap += float(gap_BC.sum())
        self.gap_max = max(self.gap_max, float(gap_BC.max()))
        self.entropy += float((entropy_BC * mask_BC).sum())
        for k, v in result.metrics.items():
            self.metrics[k] = self.metrics.get(k, 0.0) + v * share

    def step(self, model: Any, optimizer: Any, scheduler: Any, max_grad_norm: float) -> dict[str, float]:
        """Clip, one AdamW step, zero the gradients; the batch's figures."""
        import torch

        lr = scheduler.get_last_lr()[0]
        trainable = [p for p in model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": self.loss, "grad_norm": float(grad_norm), "lr": lr, "mismatch": self.gap / self.tokens,
                "mismatch_max": self.gap_max, "entropy": self.entropy / self.tokens,
                **{f"loss/{k}": v for k, v in self.metrics.items()}}
