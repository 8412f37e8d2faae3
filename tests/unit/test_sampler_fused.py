"""Fused Llama layers (services/sampler/fused.py): a bf16 merged copy scores as the unfused copy does.

Checked through the sampler's own scoring path (packed prefix trees, a prefix-cache hit, the lean
last row and prompt logprobs), layer by layer against transformers' ``LlamaDecoderLayer``, and that
anything not Llama-shaped is left alone. Fusion needs oneDNN's bf16 kernels (AVX-512 BF16 / AMX);
on a CPU without them there is nothing to fuse and the tests that compare numbers say so and skip.
"""

from __future__ import annotations

import copy

import pytest
import torch

from services.sampler.engine import Engine
from services.sampler.fused import FusedLlamaLayer, _Rope, fusable, fuse_llama, rms_scale
from services.sampler.merged import merged_copy, packable
from services.sampler.scoring import PrefixCache, Scorer
from services.sampler.settings import SamplerSettings
from tests.support.scoring import tiny  # noqa: F401 - fixture

needs_bf16 = pytest.mark.skipif(not packable(torch.bfloat16), reason="this CPU has no oneDNN bf16 kernels to fuse")


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 0.05) -> None:
    """Equal up to bf16 rounding: the largest difference is a small share of the largest value."""
    got, want = got.float(), want.float()
    assert got.shape == want.shape
    assert (got - want).abs().max() <= rel * want.abs().max(), (got - want).abs().max()


@needs_bf16
def test_each_fused_layer_is_its_decoder_layer_up_to_bf16_rounding(tiny):
    """A shared cached prefix, a tree mask (rows whose tokens see only their own branch) and rotary
    positions past the prefix: output and the keys/values left in the cache match the layer's."""
    from transformers import DynamicCache

    eng = Engine(tiny["base"], dtype="bfloat16")
    model = eng.model
    decoder = model.get_decoder()
    rows, width, m = 3, 5, 4
    torch.manual_seed(0)
    hidden = torch.randn(rows, width, model.config.hidden_size).to(torch.bfloat16)
    positions = torch.arange(m, m + width).repeat(rows, 1)
    positions[1, 3:] = torch.tensor([m + 1, m + 2])  # a second branch off token 1
    seen = torch.ones(rows, width, width).tril().bool()
    seen[1, 3:, 2] = False
    mask = torch.zeros(rows, 1, width, m + width, dtype=torch.bfloat16)
    mask[:, 0, :, m:].masked_fill_(~seen, torch.finfo(torch.bfloat16).min)
    cos_sin = decoder.rotary_emb(hidden, position_ids=positions)
    rope = _Rope()
    for i, layer in enumerate(decoder.layers):
        prefix = [torch.randn(1, model.config.num_key_value_heads, m, layer.self_attn.head_dim).to(torch.bfloat16)
                  for _ in range(2)]
        caches = []
        for _ in range(2):
            cache = DynamicCache(config=model.config)
            for j in range(i + 1):
                cache.update(*(t.expand(rows, -1, -1, -1) for t in prefix), j)
            caches.append(cache)
        with torch.inference_mode():
            want = layer(hidden, attention_mask=mask, position_embeddings=cos_sin, cache=caches[0])
            got = FusedLlamaLayer(copy.deepcopy(layer), rope)(
                hidden, attention_mask=mask, position_embeddings=cos_sin, cache=caches[1])
        _close(got, want)
        _close(caches[1].layers[i].keys, caches[0].layers[i].keys)
        _close(caches[1].layers[i].values, caches[0].layers[i].values)


def test_the_norm_scale_is_rmsnorm_without_its_weight():
    x = torch.randn(4, 7, 16)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(rms_scale(x, 1e-6), want, atol=1e-5)


@needs_bf16
def test_scoring_through_a_fused_copy_matches_the_unfused_copy(tiny):
    """The sampler's scorer, same prompts (a shared prefix cached by the first call, candidates of one
    query packed as a tree), once through a fused copy and once through a plain merged copy."""
    from services.sampler.fused import FoldedNorm

    eng = Engine(tiny["base"], dtype="bfloat16")
    eng.load_adapter("plain", tiny["a"])
    eng.load_adapter("fused", tiny["a"])
    eng.merge("plain", keep=2, fuse=False)
    eng.merge("fused", keep=2, fuse=True)
    fused = eng._merged["fused"]
    assert sum(isinstance(m, FusedLlamaLayer) for m in fused.modules()) == fused.config.num_hidden_layers
    assert isinstance(fused.get_decoder().norm, FoldedNorm)
    assert not any(isinstance(m, FusedLlamaLayer) for m in eng._merged["plain"].modules())
    eng.prefix_cache = PrefixCache(min_tokens=4)
    scorer = Scorer(eng, eng.prefix_cache, row_tokens=16)
    system = eng.encode("route this query to one provider of several: bio-dense bm25-all dense-all")
    queries = [eng.encode(q) for q in ("cells and wings", "a pump design method for a computer", "gut microbes")]
    prompts = [system + q + tail for q in queries for tail in (eng.encode(" bio"), eng.encode(" bm25"), [])]
    for _ in range(2):  # the second round reuses the cached system prefix
        want, _ = scorer.score(prompts, [3] * len(prompts), "plain")
        got, info = scorer.score(prompts, [3] * len(prompts), "fused")
        for g, w in zip(got, want):
            _close(g.row, w.row)
            assert [e[0][0] for e in g.prompt_logprobs[1:]] == [e[0][0] for e in w.prompt_logprobs[1:]]
            _close(torch.tensor([e[0][1] for e in g.prompt_logprobs[1:]]),
                   torch.tensor([e[0][1] for e in w.prompt_logprobs[1:]]))
        agree = sum(int(g.row.argmax() == w.row.argmax()) for g, w in zip(got, want))
        assert agree >= len(prompts) - 1
    assert info.cache == ["hit"]


def test_what_is_not_llama_shaped_or_bf16_is_left_unfused(tiny):
    """fp32, another activation, biases: ``fuse_llama`` changes nothing and says 0."""
    eng = Engine(tiny["base"], dtype="float32")
    assert not fusable(eng.model) and fuse_llama(eng.model) == 0
    assert not any(isinstance(m, FusedLlamaLayer) for m in eng.model.modules())
    bf16 = Engine(tiny["base"], dtype="bfloat16").model
    for change in ({"hidden_act": "gelu"}, {"attention_bias": True}, {"mlp_bias": True}):
        other = copy.deepcopy(bf16)
        for key, value in change.items():
            setattr(other.config, key, value)
        assert fuse_llama(other) == 0, change
        assert not any(isinstance(m, FusedLlamaLayer) for m in other.modules())


@needs_bf16
def test_fused_layers_follow_the_setting(tiny):
    eng = Engine(tiny["base"], dtype="bfloat16")
    assert SamplerSettings().fused_layers is True
    for fuse in (True, False):
        clone = merged_copy(eng.model, None, fuse=fuse)
        assert any(isinstance(m, FusedLlamaLayer) for m in clone.modules()) is fuse
