"""The policy-gradient losses: hand-computed values, and gradients against finite differences on a tiny model."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from services.common.errors import ConfigError
from services.trainer.losses import (
    LOSSES,
    cispo_loss,
    dppo_loss,
    gspo_loss,
    importance_sampling_loss,
    policy_loss,
    ppo_loss,
)
from tests.support.tiny_model import build_tiny_model

D = torch.float64


def _arrays(p, q, a, m):
    return (torch.log(torch.tensor(p, dtype=D)), torch.log(torch.tensor(q, dtype=D)),
            torch.tensor(a, dtype=D), torch.tensor(m, dtype=D))


# Trainer p, sampler q, advantages A, mask: ratios r = 0.5/0.4 = 1.25, 0.3/0.5 = 0.6, 1 (masked out).
P, Q, A, M = [0.5, 0.3, 0.6], [0.4, 0.5, 0.6], [1.0, -2.0, 0.5], [1, 1, 0]


def test_importance_sampling_by_hand():
    out = importance_sampling_loss(*_arrays(P, Q, A, M))
    assert float(out.loss) == pytest.approx((-1.25 * 1.0 + -0.6 * -2.0) / 2)
    assert out.metrics["ratio_mean"] == pytest.approx((1.25 + 0.6) / 2)
    k3 = ((1.25 - math.log(1.25) - 1) + (0.6 - math.log(0.6) - 1)) / 2
    assert out.metrics["mismatch_kl"] == pytest.approx(k3)
    assert float(importance_sampling_loss(*_arrays(P, Q, A, M), normalizer=1.0).loss) == pytest.approx(-0.05)


def test_ppo_by_hand():
    # token 1 (A=1): min(1.25, 1.2) = 1.2; token 2 (A=-2): min(0.6·-2, 0.8·-2) = -1.6 → loss terms -1.2, 1.6
    out = ppo_loss(*_arrays(P, Q, A, M))
    assert float(out.loss) == pytest.approx((-1.2 + 1.6) / 2)
    assert out.metrics["clip_fraction"] == 1.0
    wide = ppo_loss(*_arrays(P, Q, A, M), clip_low=0.5, clip_high=0.5)  # nothing clipped: equals IS
    assert float(wide.loss) == pytest.approx(float(importance_sampling_loss(*_arrays(P, Q, A, M)).loss))
    assert wide.metrics["clip_fraction"] == 0.0


def test_cispo_by_hand():
    # weights sg(clip(r)) with no lower bound and 1.2 above: 1.2, 0.6; terms -w·A·log p
    out = cispo_loss(*_arrays(P, Q, A, M))
    assert float(out.loss) == pytest.approx((-1.2 * 1.0 * math.log(0.5) - 0.6 * -2.0 * math.log(0.3)) / 2)
    assert out.metrics["clip_fraction"] == 0.5
    low = cispo_loss(*_arrays(P, Q, A, M), clip_low=0.2)  # now 0.6 is raised to 0.8
    assert float(low.loss) == pytest.approx((-1.2 * math.log(0.5) - 0.8 * -2.0 * math.log(0.3)) / 2)


def test_gspo_by_hand_is_a_mean_of_sequence_means():
    lp, lq, a, m = _arrays([P, [0.2, 0.2, 0.2]], [Q, [0.2, 0.2, 0.2]], [A, [1.0, 1.0, 1.0]], [M, [1, 0, 0]])
    s = math.sqrt(1.25 * 0.6)  # exp of the mean log ratio over row 0's two tokens = 0.866, clipped to 0.9997
    row0 = (-min(s * 1.0, (1 - 3e-4) * 1.0) + -min(s * -2.0, (1 - 3e-4) * -2.0)) / 2
    row1 = -1.0
    out = gspo_loss(lp, lq, a, m)
    assert float(out.loss) == pytest.approx((row0 + row1) / 2)
    assert out.metrics["seq_ratio_mean"] == pytest.approx((s + 1.0) / 2)


def test_dppo_by_hand():
    # p - q: 0.1 (A>0, inside δ=0.2: kept), -0.25 (A<0, past -δ: dropped)
    out = dppo_loss(*_arrays(P, [0.4, 0.55, 0.6], A, M))
    assert float(out.loss) == pytest.approx((-1.25 * 1.0 + 0.0) / 2)
    assert out.metrics["masked_fraction"] == 0.5
    assert out.metrics["masked_advantage_negative"] == 1.0 and out.metrics["masked_advantage_positive"] == 0.0
    none_dropped = dppo_loss(*_arrays(P, Q, A, M))  # -0.2 is not past -0.2
    assert float(none_dropped.loss) == pytest.approx(float(importance_sampling_loss(*_arrays(P, Q, A, M)).loss))


def test_one_sequence_of_shape_T_and_bad_shapes():
    out = policy_loss("ppo", *_arrays(P, Q, A, M), clip_low=0.5, clip_high=0.5)
    assert float(out.loss) == pytest.approx(-0.025)
    lp, lq, a, m = _arrays(P, Q, A, M)
    with pytest.raises(ValueError, match="differ in shape"):
        importance_sampling_loss(lp, lq[:2], a, m)
    with pytest.raises(ConfigError, match="unknown loss 'grpo'.*cispo"):
        policy_loss("grpo", lp, lq, a, m)


# ----------------------------------------------------------------------------- gradients on a tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")), dtype=D).eval()
    for m in model.modules():  # Llama's RMSNorm computes in float32: keep the whole forward in float64
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = lambda x, m=m: m.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
    ids_BT = torch.randint(3, model.config.vocab_size, (3, 9))
    mask_BT = torch.zeros(3, 8, dtype=D)
    mask_BT[0, 3:] = 1
    mask_BT[1, 5:] = 1
    mask_BT[2, 2:6] = 1
    return model, ids_BT, mask_BT


def _logprobs(model, ids_BT):
    logits_BTV = model(input_ids=ids_BT).logits[:, :-1]
    return torch.log_softmax(logits_BTV, -1).gather(-1, ids_BT[:, 1:, None])[..., 0]


def _directional(model, ids_BT, f, h=1e-5):
    """(autograd gradient · v, central finite difference of f along v) for one random unit direction v;
    the tests check that no clip or mask decision flips within the step."""
    params = [p for p in model.parameters()]
    gen = torch.Generator().manual_seed(1)
    vs = [torch.randn(p.shape, generator=gen, dtype=D) for p in params]
    norm = math.sqrt(sum(float((v * v).sum()) for v in vs))
    vs = [v / norm for v in vs]
    model.zero_grad()
    f(_logprobs(model, ids_BT)).backward()
    analytic = sum(float((p.grad * v).sum()) for p, v in zip(params, vs))
    values, shifted = [], []
    with torch.no_grad():
        for sign in (1, -1):
            for p, v in zip(params, vs):
                p.add_(sign * h * v)
            shifted.append(_logprobs(model, ids_BT))
            values.append(float(f(shifted[-1])))
            for p, v in zip(params, vs):
                p.sub_(sign * h * v)
    return analytic, (values[0] - values[1]) / (2 * h), shifted


def _setting(model, ids_BT, mask_BT, per_sequence_advantage=False):
    """Sampler logprobs off the trainer's by ±0.05 or ±0.6 (well inside / well outside a 0.2 clip)."""
    with torch.no_grad():
        lp0 = _logprobs(model, ids_BT)
    gen = torch.Generator().manual_seed(2)
    sign_BT = torch.where(torch.rand(lp0.shape, generator=gen) < 0.5, -1.0, 1.0).to(D)
    size_BT = torch.where(torch.rand(lp0.shape, generator=gen) < 0.5, 0.05, 0.6).to(D)
    sampler_BT = lp0 + sign_BT * size_BT
    if per_sequence_advantage:
        adv_BT = torch.tensor([[1.0], [-0.5], [2.0]], dtype=D).expand_as(lp0).clone()
    else:
        adv_BT = torch.randn(lp0.shape, generator=gen, dtype=D)
    return lp0, sampler_BT, adv_BT


def _same_decisions(decide, lp0, shifted, mask_BT):
    """The clip/mask decisions at θ0 hold at θ0 ± h·v on the masked tokens (finite differences see no kink)."""
    keep = mask_BT > 0
    for lp in shifted:
        assert torch.equal(decide(lp0)[keep], decide(lp)[keep]), "a clip or mask decision flips within the step"


def _ppo_clipped(sampler_BT, adv_BT):
    def decide(lp):
        r = torch.exp(lp - sampler_BT)
        return (torch.clamp(r, 0.8, 1.2) * adv_BT) < (r * adv_BT)
    return decide


def _dppo_dropped(sampler_BT, adv_BT, delta):
    def decide(lp):
        moved = torch.exp(lp) - torch.exp(sampler_BT)
        return ((adv_BT > 0) & (moved > delta)) | ((adv_BT < 0) & (moved < -delta))
    return decide


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "dppo"])
def test_gradient_equals_finite_differences(tiny, name):
    model, ids_BT, mask_BT = tiny
    lp0, sampler_BT, adv_BT = _setting(model, ids_BT, mask_BT)
    # the tiny model's probabilities are small: DPPO's δ at the median probability move drops about half
    moved = (torch.exp(lp0) - torch.exp(sampler_BT)).abs()[mask_BT > 0].sort().values
    delta = float(moved[len(moved) // 2 - 1] + moved[len(moved) // 2]) / 2
    kw = {"clip_low": delta, "clip_high": delta} if name == "dppo" else {}
    analytic, numeric, shifted = _directional(
        model, ids_BT, lambda lp: LOSSES[name](lp, sampler_BT, adv_BT, mask_BT, **kw).loss)
    if name == "ppo":
        _same_decisions(_ppo_clipped(sampler_BT, adv_BT), lp0, shifted, mask_BT)
        assert 0 < ppo_loss(lp0, sampler_BT, adv_BT, mask_BT).metrics["clip_fraction"] < 1
    if name == "dppo":
        _same_decisions(_dppo_dropped(sampler_BT, adv_BT, delta), lp0, shifted, mask_BT)
        assert 0 < dppo_loss(lp0, sampler_BT, adv_BT, mask_BT, **kw).metrics["masked_fraction"] < 1
    assert analytic != 0.0
    assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-9)


def test_cispo_gradient_is_the_detached_weights_surrogate(tiny):
    model, ids_BT, mask_BT = tiny
    lp0, sampler_BT, adv_BT = _setting(model, ids_BT, mask_BT)
    weight_BT = torch.clamp(torch.exp(lp0 - sampler_BT), max=1.2)  # frozen at the evaluation point

    def frozen(lp):
        return -(weight_BT * adv_BT * lp * mask_BT).sum() / mask_BT.sum()

    analytic, _, _ = _directional(model, ids_BT, lambda lp: cispo_loss(lp, sampler_BT, adv_BT, mask_BT).loss)
    _, numeric, _ = _directional(model, ids_BT, frozen)
    assert analytic != 0.0
    assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-9)


def test_gspo_gradient_is_the_sequence_ratio_gradient(tiny):
    # With one advantage per sequence, GSPO-token's gradient is that of the sequence-level objective,
    # whose value gspo_loss computes: finite differences of the value must match autograd.
    model, ids_BT, mask_BT = tiny
    _, sampler_BT, adv_BT = _setting(model, ids_BT, mask_BT, per_sequence_advantage=True)
    f = lambda lp: gspo_loss(lp, sampler_BT, adv_BT, mask_BT, clip_low=0.5, clip_high=0.5).loss
    analytic, numeric, _ = _directional(model, ids_BT, f)
    assert analytic != 0.0
    assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_micro_batches_add_up_to_the_one_pass_gradient(tiny, name):
    from services.trainer.policy import Accumulator

    model, ids_BT, mask_BT = tiny
    lp0, sampler_BT, adv_BT = _setting(model, ids_BT, mask_BT)
    entropy_BT = torch.zeros_like(mask_BT)
    grads, figures = [], []
    for chunks in ([slice(0, 3)], [slice(0, 1), slice(1, 3)], [slice(0, 2), slice(2, 3)]):
        model.zero_grad()
        acc = Accumulator(name, float(mask_BT.sum()), 3.0, clip_low=None, clip_high=None)
        for c in chunks:
            acc.add(_logprobs(model, ids_BT[c]), sampler_BT[c], adv_BT[c], mask_BT[c], entropy_BT[c])
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        figures.append((acc.loss, acc.gap / acc.tokens))
    assert float(grads[0].abs().max()) > 0
    for g, f in zip(grads[1:], figures[1:]):
        assert torch.allclose(g, grads[0], rtol=1e-9, atol=1e-12)
        assert f == pytest.approx(figures[0], rel=1e-9)
