"""Policy-gradient losses over per-token arrays: importance sampling, PPO, CISPO, GSPO and DPPO.

Why one module: OPSD uses it now and RL next, and each loss must read the sampler's recorded
logprobs as the sampling policy (no second forward pass for it). Every function takes full-length
arrays of one shape, ``[B, T]`` (a single sequence may be ``[T]``): the trainer's logprobs of the
sampled tokens (with gradient), the sampler's logprobs of the same tokens, per-token advantages and
a 0/1 mask of the positions that count (the sampled tokens). Each returns the scalar loss to
minimise and detached metrics. The importance ratio is ``r = exp(logprobs - sampler_logprobs)``
(its log clamped to ±20, as verl and prime-rl do). Definitions (and their defaults):

- ``importance_sampling``: ``-r·A`` (Tinker's ``importance_sampling``; the REINFORCE estimator
  corrected for the sampler's policy);
- ``ppo``: ``-min(r·A, clip(r, 1-ε_lo, 1+ε_hi)·A)``, ε = 0.2 (Schulman et al. 2017);
- ``cispo``: ``-sg(clip(r, 1-ε_lo, 1+ε_hi))·A·logprobs``, no lower bound and ε_hi = 0.2 by default
  (MiniMax-M1: the clipped weight is detached, so every token keeps a gradient);
- ``gspo``: the sequence ratio ``s = exp(mean_t log r)`` in PPO's clipped objective, token-level
  form ``s_t = sg(s)·exp(logprobs - sg(logprobs))`` so per-token advantages work, ε = 3e-4 / 4e-4,
  averaged per sequence then over sequences (Zheng et al. 2025, GSPO-token);
- ``dppo``: ``-keep·r·A``, where a token is dropped when its probability moved past a trust region
  in the advantage's direction (``p - p_old > δ_hi`` with A > 0, ``< -δ_lo`` with A < 0), δ = 0.2
  (DPPO-Binary-TV, arXiv 2602.04879, as prime-rl's default loss).

Aggregation: token mean over the batch (sum of terms / number of masked tokens) unless
``normalizer`` is given (``normalizer=1`` is Tinker's sum); GSPO is sequence-mean of token-means (its
``normalizer`` counts sequences). A micro-batch passes the whole batch's count, so the gradients of its
micro-batches add up to the batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import ConfigError

LOG_RATIO_CLAMP = 20.0


@dataclass
class LossResult:
    """The scalar to minimise and detached figures about it (floats)."""

    loss: Any
    metrics: dict[str, float] = field(default_factory=dict)


def _as_bt(*arrays: Any) -> list[Any]:
    """``[T]`` arrays as ``[1, T]``; ``[B, T]`` as they are; the mask as the logprobs' float dtype."""
    out = [a.unsqueeze(0) if a.dim() == 1 else a for a in arrays]
    shape = out[0].shape
    for a in out[1:]:
        if a.shape != shape:
            raise ValueError(f"per-token arrays differ in shape: {tuple(a.shape)} vs {tuple(shape)}")
    out[-1] = out[-1].to(out[0].dtype)
    return out


def _log_ratio(logprobs_BT: Any, sampler_logprobs_BT: Any) -> tuple[Any, Any]:
    import torch

    log_ratio_BT = torch.clamp(logprobs_BT - sampler_logprobs_BT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio_BT, torch.exp(log_ratio_BT)


def _masked_mean(x_BT: Any, mask_BT: Any) -> float:
    n = float(mask_BT.sum())
    return float((x_BT.detach() * mask_BT).sum()) / n if n else 0.0


def _reduce(terms_BT: Any, mask_BT: Any, normalizer: float | None) -> Any:
    total = (terms_BT * mask_BT).sum()
    return total / (normalizer if normalizer is not None else mask_BT.sum().clamp(min=1.0))


def _common(log_ratio_BT: Any, ratio_BT: Any, mask_BT: Any) -> dict[str, float]:
    """The importance ratio's mean and the k3 estimate of KL(sampler ‖ trainer) on the masked tokens."""
    return {"ratio_mean": _masked_mean(ratio_BT, mask_BT),
            "mismatch_kl": _masked_mean(ratio_BT - log_ratio_BT - 1.0, mask_BT)}


def importance_sampling_loss(logprobs_BT: Any, sampler_logprobs_BT: Any, advantages_BT: Any, mask_BT: Any, *,
                             normalizer: float | None = None) -> LossResult:
    """``-r·A``: the policy gradient on samples of the sampler's policy, importance-weighted to ours."""
    logprobs_BT, sampler_logprobs_BT, advantages_BT, mask_BT = _as_bt(logprobs_BT, sampler_logprobs_BT,
                                                                      advantages_BT, mask_BT)
    log_ratio_BT, ratio_BT = _log_ratio(logprobs_BT, sampler_logprobs_BT)
    loss = _reduce(-ratio_BT * advantages_BT, mask_BT, normalizer)
    return LossResult(loss, _common(log_ratio_BT, ratio_BT, mask_BT))


def ppo_loss(logprobs_BT: Any, sampler_logprobs_BT: Any, advantages_BT: Any, mask_BT: Any, *,
             clip_low: float = 0.2, clip_high: float = 0.2, normalizer: float | None = None) -> LossResult:
    """``-min(r·A, clip(r, 1-ε_lo, 1+ε_hi)·A)``: no gain from moving a token's ratio past the clip range."""
    import torch

    logprobs_BT, sampler_logprobs_BT, advantages_BT, mask_BT = _as_bt(logprobs_BT, sampler_logprobs_BT,
                                                                      advantages_BT, mask_BT)
    log_ratio_BT, ratio_BT = _log_ratio(logprobs_BT, sampler_logprobs_BT)
    plain_BT = -ratio_BT * advantages_BT
    clipped_BT = -torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high) * advantages_BT
    loss = _reduce(torch.maximum(plain_BT, clipped_BT), mask_BT, normalizer)
    metrics = _common(log_ratio_BT, ratio_BT, mask_BT)
    metrics["clip_fraction"] = _masked_mean((clipped_BT > plain_BT).float(), mask_BT)
    return LossResult(loss, metrics)


def cispo_loss(logprobs_BT: Any, sampler_logprobs_BT: Any, advantages_BT: Any, mask_BT: Any, *,
               clip_low: float | None = None, clip_high: float = 0.2,
               normalizer: float | None = None) -> LossResult:
    """``-sg(clip(r))·A·logprobs``: the weight is clipped and detached, the token's gradient is kept."""
    import torch

    logprobs_BT, sampler_logprobs_BT, advantages_BT, mask_BT = _as_bt(logprobs_BT, sampler_logprobs_BT,
                                                                      advantages_BT, mask_BT)
    log_ratio_BT, ratio_BT = _log_ratio(logprobs_BT, sampler_logprobs_BT)
    low = None if clip_low is None else 1.0 - clip_low
    weight_BT = torch.clamp(ratio_BT, min=low, max=1.0 + clip_high).detach()
    loss = _reduce(-weight_BT * advantages_BT * logprobs_BT, mask_BT, normalizer)
    metrics = _common(log_ratio_BT, ratio_BT, mask_BT)
    metrics["clip_fraction"] = _masked_mean((weight_BT != ratio_BT.detach()).float(), mask_BT)
    return LossResult(loss, metrics)


def gspo_loss(logprobs_BT: Any, sampler_logprobs_BT: Any, advantages_BT: Any, mask_BT: Any, *,
              clip_low: float = 3e-4, clip_high: float = 4e-4, normalizer: float | None = None) -> LossResult:
    """PPO's clipped objective on the length-normalised sequence ratio (token-level form, seq-mean-token-mean)."""
    import torch

    logprobs_BT, sampler_logprobs_BT, advantages_BT, mask_BT = _as_bt(logprobs_BT, sampler_logprobs_BT,
                                                                      advantages_BT, mask_BT)
    log_ratio_BT, ratio_BT = _log_ratio(logprobs_BT, sampler_logprobs_BT)
    lengths_B = mask_BT.sum(-1).clamp(min=1.0)
    log_seq_ratio_B = (log_ratio_BT * mask_BT).sum(-1) / lengths_B
    log_seq_ratio_BT = logprobs_BT - logprobs_BT.detach() + log_seq_ratio_B.detach().unsqueeze(-1)
    seq_ratio_BT = torch.exp(torch.clamp(log_seq_ratio_BT, max=10.0))
    plain_BT = -seq_ratio_BT * advantages_BT
    clipped_BT = -torch.clamp(seq_ratio_BT, 1.0 - clip_low, 1.0 + clip_high) * advantages_BT
    terms_BT = torch.maximum(plain_BT, clipped_BT)
    has_B = (mask_BT.sum(-1) > 0).to(mask_BT.dtype)
    per_seq_B = (terms_BT * mask_BT).sum(-1) / lengths_B
    loss = (per_seq_B * has_B).sum() / (normalizer if normalizer is not None else has_B.sum().clamp(min=1.0))
    metrics = _common(log_ratio_BT, ratio_BT, mask_BT)
    metrics["clip_fraction"] = _masked_mean((clipped_BT > plain_BT).float(), mask_BT)
    metrics["seq_ratio_mean"] = float((torch.exp(log_seq_ratio_B.detach()) * has_B).sum() / has_B.sum().clamp(min=1.0))
    return LossResult(loss, metrics)


def dppo_loss(logprobs_BT: Any, sampler_logprobs_BT: Any, advantages_BT: Any, mask_BT: Any, *,
              clip_low: float = 0.2, clip_high: float = 0.2, normalizer: float | None = None) -> LossResult:
    """``-keep·r·A``: tokens whose probability left the trust region in the advantage's direction drop out."""
    import torch

    logprobs_BT, sampler_logprobs_BT, advantages_BT, mask_BT = _as_bt(logprobs_BT, sampler_logprobs_BT,
                                                                      advantages_BT, mask_BT)
    log_ratio_BT, ratio_BT = _log_ratio(logprobs_BT, sampler_logprobs_BT)
    moved_BT = (torch.exp(logprobs_BT) - torch.exp(sampler_logprobs_BT)).detach()
    positive_BT, negative_BT = advantages_BT > 0, advantages_BT < 0
    dropped_BT = (positive_BT & (moved_BT > clip_high)) | (negative_BT & (moved_BT < -clip_low))
    keep_BT = (~dropped_BT).to(mask_BT.dtype)
    loss = _reduce(-keep_BT * ratio_BT * advantages_BT, mask_BT, normalizer)
    metrics = _common(log_ratio_BT, ratio_BT, mask_BT)
    drop_BT = dropped_BT.to(mask_BT.dtype) * mask_BT
    metrics["masked_fraction"] = _masked_mean(drop_BT, mask_BT)
    metrics["masked_advantage_positive"] = _masked_mean(positive_BT.to(mask_BT.dtype), drop_BT)
    metrics["masked_advantage_negative"] = _masked_mean(negative_BT.to(mask_BT.dtype), drop_BT)
    return LossResult(loss, metrics)


LossFn = Callable[..., LossResult]

#: The losses by the name a run config gives (``importance_sampling`` is the default).
LOSSES: dict[str, LossFn] = {"importance_sampling": importance_sampling_loss, "ppo": ppo_loss,
                             "cispo": cispo_loss, "gspo": gspo_loss, "dppo": dppo_loss}
CLIPPED = {"ppo", "cispo", "gspo", "dppo"}


def policy_loss(name: str, logprobs_BT: Any, sampler_logprobs_BT: Any, advantages_BT: Any, mask_BT: Any, *,
                clip_low: float | None = None, clip_high: float | None = None,
                normalizer: float | None = None) -> LossResult:
    """The named loss, with clip bounds where given (None keeps the loss's own default)."""
    fn = LOSSES.get(name)
    if fn is None:
        raise ConfigError(f"unknown loss {name!r}; choose one of {', '.join(sorted(LOSSES))}")
    kw: dict[str, Any] = {} if normalizer is None else {"normalizer": normalizer}
    if name in CLIPPED:
        if clip_low is not None:
            kw["clip_low"] = clip_low
        if clip_high is not None:
            kw["clip_high"] = clip_high
    return fn(logprobs_BT, sampler_logprobs_BT, advantages_BT, mask_BT, **kw)
