"""Merged serving copies: one adapter's LoRA folded into a copy of the model, its linear weights packed once.

A router decision is a short forward (tens of new tokens) through SmolLM2's 30 small layers, so on a
CPU its time is per-call overhead more than arithmetic: peft adds two matmuls to every adapted
projection (420 extra calls a forward), and a bf16 matmul lays its weight out again for oneDNN's
AMX / AVX-512 kernels on every call. A copy with W + ΔW in place, each weight laid out once, pays
neither. Only scoring uses it (prompt logprobs and one-token completions, the router's calls);
generation keeps going through peft. Its numbers are the adapter's up to the rounding of W + ΔW in
the engine's dtype; its prefix-cache entries are kept under their own key (:func:`cache_key`), so a
generation never reuses keys/values the copy computed.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

MERGED_SUFFIX = "+merged"


def cache_key(slot: str | None) -> str:
    """The prefix-cache key of what ``slot``'s merged copy computes (never the slot's own key)."""
    return f"{slot or ''}{MERGED_SUFFIX}"


def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pre-pack linear weights of ``dtype`` on this CPU (bf16 with AVX-512 BF16 / AMX)."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def has_amx_bf16() -> bool:
    """Whether this CPU has AMX bf16 tiles, where a bf16 matmul runs several times faster than fp32 (with
    AVX-512 BF16 alone it does not: measured ≈ 150 against ≈ 250 GFLOPS on a decision batch's shapes)."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        return bool(caps().get("amx_bf16", False))
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def scoring_dtype(choice: str, engine_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a merged copy for the setting ``merged_dtype``: ``same`` (the engine's), ``float32``,
    ``bfloat16``, or ``auto`` (bf16 where :func:`has_amx_bf16` and oneDNN can pack it, else the engine's)."""
    if choice == "same":
        return engine_dtype
    if choice == "auto":
        return torch.bfloat16 if has_amx_bf16() and packable(torch.bfloat16) else engine_dtype
    return getattr(torch, choice)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (bf16, [out, in]) laid out once for oneDNN's linear kernels."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  attr: str = "none") -> torch.Tensor:
    """``x @ W.T (+ bias)`` with a :func:`pack_weight` weight; ``attr`` fuses a oneDNN post-op ("swish", ...)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [None], "")


class PackedLinear(torch.nn.Module):
    """A bf16 ``nn.Linear`` whose weight oneDNN laid out once (the same products, no per-call reorder)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def _set(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def merged_copy(model: Any, slot: str | None, *, fuse: bool = True, dtype: torch.dtype | None = None) -> Any:
    """A copy of ``model`` (the engine's causal LM, peft layers injected or not) with ``slot``'s LoRA
    folded into the adapted weights (None: the base alone), in ``dtype`` (None: the model's), and every
    linear layer packed when :func:`packable` (``fuse``: its Llama layers fused,
    :func:`services.sampler.fused.fuse_llama`). ΔW = B·A·scaling is computed in float32 and added
    before the cast."""
    from peft.tuners.lora import LoraLayer

    clone = copy.deepcopy(model).eval()
    for name, module in list(clone.named_modules()):
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        if slot is not None and slot in module.lora_A:
            weight = base.weight.data
            delta = module.get_delta_weight(slot).float()
            base.weight.data = (weight.float() + delta).to(weight.dtype)
        _set(clone, name, base)
    if dtype is not None and dtype != clone.dtype:
        clone.to(dtype)
    if packable(clone.dtype):
        if fuse:
            from services.sampler.fused import fuse_llama

            fuse_llama(clone)
        for name, module in list(clone.named_modules()):
            if type(module) is torch.nn.Linear:
                _set(clone, name, PackedLinear(module))
    clone.requires_grad_(False)
    return clone
