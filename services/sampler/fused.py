"""Fused Llama decoder layers for a merged bf16 scoring copy: fewer, larger CPU kernels per layer.

With the weights packed (:mod:`services.sampler.merged`), a batch of router decisions (20 queries,
~1,000 new tokens) still spent most of its forward in element-wise bf16 work between the matmuls:
RMSNorm's float32 round trip, rotary's slices and concatenation, SiLU, the gate product and two
residual adds a layer. Here each layer runs as four oneDNN linears with their element-wise work
fused in as post-ops — q/k/v as one matmul; ``o_proj`` + residual; ``gate_proj`` + SiLU;
``up_proj`` × gate; ``down_proj`` + residual — an RMSNorm whose weight is folded into the next
matmul's weight (so the norm itself is one reduction and one bf16 multiply), and rotary as one
multiply-add over q and k together. The products are the layer's own up to bf16 rounding (the norm's
scale is rounded to bf16 once; W·diag(w) is rounded once); ``tests/unit/test_sampler_fused.py``
checks each layer and the whole forward against the unfused copy.

Only Llama-shaped layers are fused (SmolLM2, the router's base): SiLU MLP, no biases, the decoder
layer and its parts of exactly the transformers classes; anything else keeps the unfused path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from services.sampler.merged import PackedLinear, pack_weight, packed_linear

BINARY = torch.ops.mkldnn._linear_pointwise.binary if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` with the sum of squares in float32 and the scale applied in ``x``'s dtype (the
    norm's weight is folded into the next matmul). One reduction and one multiply: a float32 round
    trip of the whole activation costs ~10× that in bf16 on CPU. The norm of ``x.float()`` is the
    same float32 result bit for bit as ``vector_norm(x, dtype=float32)``, in a quarter of its time
    (2 cores, 960 × 576: 65 against 290 µs)."""
    r = torch.linalg.vector_norm(x.float(), dim=-1, keepdim=True)
    r = r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    return x * r.to(x.dtype)


class _Rope:
    """Per forward, the rotary tables as ``x·cos + roll(x)·sin±`` needs them (computed once, shared by
    every layer: the model hands the same ``(cos, sin)`` tensors to each)."""

    def __init__(self) -> None:
        self._key: tuple[Any, Any] | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._key is None or self._key[0] is not cos or self._key[1] is not sin:
            half = sin.shape[-1] // 2
            signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
            self._tables = (cos.unsqueeze(2), signed.unsqueeze(2))  # [B, L, 1, D]: broadcast over heads
            self._key = (cos, sin)
        return self._tables


class FusedLlamaLayer(torch.nn.Module):
    """A ``LlamaDecoderLayer`` (bf16, weights packed) with its element-wise work fused into its matmuls."""

    def __init__(self, layer: Any, rope: _Rope) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.eps_in = layer.input_layernorm.variance_epsilon
        self.eps_post = layer.post_attention_layernorm.variance_epsilon
        w_in = layer.input_layernorm.weight.detach().float()
        w_post = layer.post_attention_layernorm.weight.detach().float()

        def folded(linear: torch.nn.Linear, w: torch.Tensor) -> torch.Tensor:
            return (linear.weight.detach().float() * w).to(linear.weight.dtype)

        self.qkv = pack_weight(torch.cat([folded(attn.q_proj, w_in), folded(attn.k_proj, w_in),
                                    folded(attn.v_proj, w_in)]))
        self.o = pack_weight(attn.o_proj.weight)
        self.gate, self.up = pack_weight(folded(mlp.gate_proj, w_post)), pack_weight(folded(mlp.up_proj, w_post))
        self.down = pack_weight(mlp.down_proj.weight)
        self._rope = rope

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: Any = None, past_key_values: Any = None, **_: Any) -> torch.Tensor:
        cache = cache if cache is not None else past_key_values
        b, length, _d = hidden_states.shape
        qkv = packed_linear(rms_scale(hidden_states, self.eps_in), self.qkv).view(b, length, -1, self.head_dim)
        cos, sin = self._rope.tables(*position_embeddings)
        qk = qkv[:, :, :self.heads + self.kv_heads]
        qk = torch.addcmul(qk * cos, qk.roll(self.head_dim // 2, dims=-1), sin)
        q = qk[:, :, :self.heads].transpose(1, 2)
        k = qk[:, :, self.heads:].transpose(1, 2)
        v = qkv[:, :, self.heads + self.kv_heads:].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, scale=self.scaling,
            is_causal=attention_mask is None and length > 1 and k.shape[2] == length,
            enable_gqa=self.heads != self.kv_heads)
        attn = attn.transpose(1, 2).reshape(b, length, -1)
        hidden_states = BINARY(attn, hidden_states, self.o, None, "add")  # o_proj(attn) + residual
        h = rms_scale(hidden_states, self.eps_post)
        gated = BINARY(h, packed_linear(h, self.gate, attr="swish"), self.up, None, "mul")  # up(h) · silu(gate(h))
        return BINARY(gated, hidden_states, self.down, None, "add")  # down(·) + residual


class FoldedNorm(torch.nn.Module):
    """The model's final RMSNorm with its weight folded into the (packed) output layer's weight."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_scale(hidden_states, self.eps)


def fusable(model: Any) -> bool:
    """Whether :func:`fuse_llama` applies: a bf16 transformers Llama with SiLU, no biases, plain layers."""
    from transformers.models.llama import modeling_llama as ml

    config = model.config
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    return (BINARY is not None and getattr(config, "model_type", None) == "llama" and model.dtype == torch.bfloat16
            and config.hidden_act == "silu" and not config.attention_bias and not getattr(config, "mlp_bias", False)
            and layers is not None and all(type(layer) is ml.LlamaDecoderLayer and type(layer.mlp) is ml.LlamaMLP
                                           and type(layer.self_attn) is ml.LlamaAttention for layer in layers)
            and type(decoder.norm) is ml.LlamaRMSNorm and type(model.get_output_embeddings()) is torch.nn.Linear)


def fuse_llama(model: Any) -> int:
    """Replace ``model``'s decoder layers with :class:`FusedLlamaLayer` and fold the final norm's
    weight into a packed output layer, in place; the number of layers fused (0: not :func:`fusable`)."""
    if not fusable(model):
        return 0
    decoder, rope = model.get_decoder(), _Rope()
    for i, layer in enumerate(decoder.layers):
        decoder.layers[i] = FusedLlamaLayer(layer, rope)
    head, norm = model.get_output_embeddings(), decoder.norm
    folded = torch.nn.Linear(head.in_features, head.out_features, bias=False, dtype=head.weight.dtype)
    folded.weight = torch.nn.Parameter((head.weight.detach().float() * norm.weight.detach().float())
                                       .to(head.weight.dtype), requires_grad=False)
    model.set_output_embeddings(PackedLinear(folded))
    decoder.norm = FoldedNorm(norm.variance_epsilon)
    return len(decoder.layers)
