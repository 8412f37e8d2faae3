"""The SFT loss with the shared prompt prefix forwarded once equals the plain loss, value and gradient."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from services.trainer.data import IGNORE, Batch  # noqa: E402
from services.trainer.shared_prefix import MIN_SHARED, shared_prefix_len, target_loss  # noqa: E402
from tests.support.tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")),
                                                dtype=torch.float64)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                            init_lora_weights=False))  # B ≠ 0: the adapter moves the prefix's KV
    return model


def _batch(prefix_len: int, suffix_lens: list[int], answer: int, vocab: int, seed: int = 1) -> Batch:
    """Rows sharing ``prefix_len`` tokens, then their own suffix (the last ``answer`` tokens labelled), right-padded."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (prefix_len,), generator=g)
    T = prefix_len + max(suffix_lens)
    ids = torch.zeros(len(suffix_lens), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE)
    for b, n in enumerate(suffix_lens):
        row = torch.cat([prefix, torch.randint(3, vocab, (n,), generator=g)])
        ids[b, :len(row)], mask[b, :len(row)] = row, 1
        labels[b, len(row) - answer:len(row)] = row[len(row) - answer:]
    return Batch(ids, mask, labels)


def _plain_loss(model, batch: Batch):
    """The model's own loss (every position projected, the prefix forwarded per row)."""
    return model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT, labels=batch.labels_BT,
                 use_cache=False).loss


def _grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_loss_and_gradient_equal_the_plain_forward(lora_model) -> None:
    batch = _batch(prefix_len=20, suffix_lens=[7, 3, 11], answer=2, vocab=lora_model.config.vocab_size)
    assert shared_prefix_len(batch.input_ids_BT, batch.attention_mask_BT, batch.labels_BT) >= 20
    base = lora_model.get_base_model()
    shared_loss, shared_grads = _grads(lora_model, lambda: target_loss(base, batch))
    plain_loss, plain_grads = _grads(lora_model, lambda: _plain_loss(lora_model, batch))
    assert torch.allclose(shared_loss, plain_loss, rtol=0, atol=1e-7)
    assert len(shared_grads) == len(plain_grads) > 0
    for s, p in zip(shared_grads, plain_grads, strict=True):  # Llama's RMSNorm rounds in float32
        assert torch.allclose(s, p, rtol=1e-6, atol=1e-6)
    assert any(float(g.abs().max()) > 0 for g in shared_grads)


def test_the_shared_length_stops_at_the_first_difference_padding_or_target() -> None:
    batch = _batch(prefix_len=20, suffix_lens=[5, 5], answer=2, vocab=400)
    ids, mask, labels = batch.input_ids_BT, batch.attention_mask_BT, batch.labels_BT
    P = shared_prefix_len(ids, mask, labels)
    assert 20 <= P < ids.shape[1] - 1 and bool((ids[0, :P] == ids[1, :P]).all())
    early = labels.clone()
    early[:, 12] = ids[:, 12]  # a target inside the common prefix: its predicting position stays in the suffix
    assert shared_prefix_len(ids, mask, early) == 11
    assert shared_prefix_len(ids[:1], mask[:1], labels[:1]) == 0  # one row: nothing to share
    short = _batch(prefix_len=MIN_SHARED - 2, suffix_lens=[4, 4], answer=1, vocab=400)
    assert shared_prefix_len(short.input_ids_BT, short.attention_mask_BT, short.labels_BT) == 0


def test_no_shared_prefix_falls_back_to_one_forward(lora_model) -> None:
    batch = _batch(prefix_len=0, suffix_lens=[6, 9], answer=3, vocab=lora_model.config.vocab_size, seed=3)
    base = lora_model.get_base_model()
    with torch.no_grad():
        assert torch.allclose(target_loss(base, batch), _plain_loss(lora_model, batch), rtol=0, atol=1e-7)


def test_class_balance_weights() -> None:
    from services.trainer.data import balance_weights

    labels = ["biomed"] * 6 + ["aero"] * 3 + ["compsci"] + [None]
    assert balance_weights(labels, 0.0) == [1.0] * len(labels)
    full = balance_weights(labels, 1.0)
    per_label = {lab: sum(w for w, x in zip(full, labels, strict=True) if x == lab) for lab in ("biomed", "aero", "compsci")}
    assert max(per_label.values()) == pytest.approx(min(per_label.values()))  # equal total weight per label
    assert sum(full[:-1]) / 10 == pytest.approx(1.0) and full[-1] == 1.0
    half = balance_weights(labels, 0.5)
    assert half[0] < half[6] < half[9]  # rarer labels weigh more, monotonically


def test_weighted_loss_is_the_weighted_mean_of_row_losses(lora_model) -> None:
    batch = _batch(prefix_len=16, suffix_lens=[5, 8], answer=2, vocab=lora_model.config.vocab_size, seed=5)
    base = lora_model.get_base_model()
    rows = [Batch(batch.input_ids_BT[i:i + 1], batch.attention_mask_BT[i:i + 1], batch.labels_BT[i:i + 1])
            for i in range(2)]
    with torch.no_grad():
        row_losses = [float(target_loss(base, r)) for r in rows]  # each row has 2 target tokens
        weighted = Batch(batch.input_ids_BT, batch.attention_mask_BT, batch.labels_BT, torch.tensor([3.0, 1.0]))
        assert float(target_loss(base, weighted)) == pytest.approx((3 * row_losses[0] + row_losses[1]) / 4, abs=1e-5)
        ones = Batch(batch.input_ids_BT, batch.attention_mask_BT, batch.labels_BT, torch.ones(2))
        assert float(target_loss(base, ones)) == pytest.approx(float(target_loss(base, batch)), abs=1e-6)


def test_route_eval_name_scores_equal_a_plain_forward(lora_model) -> None:
    """The trainer's routing eval forwards the prompt once for all K names: same scores as K plain forwards."""
    import math

    from services.trainer.route_eval import RouteItem, name_scores

    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 400, (30,), generator=g).tolist()
    names = {"x": [5, 6], "y": [7], "z": [5, 9, 10]}
    seqs = tuple(tuple(prompt + ids) for ids in names.values())
    item = RouteItem("e", tuple(names), seqs, 30, None, {})
    got = name_scores(lora_model, item, pad_id=0)
    with torch.no_grad():
        for name, seq in zip(names, seqs, strict=True):
            logp = torch.log_softmax(lora_model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
            want = math.fsum(float(logp[t - 1, seq[t]]) for t in range(30, len(seq)))
            assert got[name] == pytest.approx(want, abs=1e-4)


def test_class_balance_out_of_range_is_refused_by_name() -> None:
    from pydantic import ValidationError

    from services.trainer.settings import SftRun

    for bad in (-0.1, 1.5):
        with pytest.raises(ValidationError, match="class_balance"):
            SftRun(class_balance=bad)
