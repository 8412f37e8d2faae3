"""Continuous batching on the tiny model: the same tokens as decoding alone, logprobs of a plain forward."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import pytest

from services.sampler.decoding import DecodeRequest, Decoder, _settle
from services.sampler.engine import Engine, Generation, SamplingParams
from services.sampler.kvbatch import KVBatch
from tests.support.tiny_model import build_lora_adapter, build_tiny_model

TOL = 1e-4
PROMPTS = ["which search provider should answer", "what is a cell?",
           "aerodynamics of a wing at supersonic speed; library indexing and retrieval",
           "Hello", "the quick brown fox jumps over the lazy dog and the providers are alpha beta gamma"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    root = tmp_path_factory.mktemp("decoding")
    base = build_tiny_model(root / "base", context=256)
    eng = Engine(base)
    eng.load_adapter("a", build_lora_adapter(base, root / "lora-a", seed=1))
    eng.load_adapter("b", build_lora_adapter(base, root / "lora-b", seed=2, targets=("k_proj", "gate_proj")))
    return eng


def forward_logprobs(eng: Engine, slot: str | None, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each sampled token's log-softmax from one teacher-forced forward over prompt + tokens."""
    import torch

    with eng.lock, torch.inference_mode():
        eng._activate(slot)
        logits_TV = eng.model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    lp_TV = torch.log_softmax(logits_TV[len(prompt) - 1:-1], dim=-1)
    return lp_TV.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


async def decode_all(eng: Engine, jobs: list[tuple[str | None, list[int], SamplingParams]], max_num_seqs: int):
    """Decode ``jobs`` together, all queued before the decoding thread looks, so its rounds do not depend on timing."""
    decoder = Decoder(eng, lambda key: key, max_num_seqs=max_num_seqs)
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future] = []
    try:
        with decoder._cv:  # the thread admits under this lock: it sees every job pending in its first round
            for slot, ids, p in jobs:
                futures.append(loop.create_future())
                decoder.submit(DecodeRequest(slot, ids, p, partial(_told, loop, futures[-1])))
        return await asyncio.gather(*futures), decoder.stats
    finally:
        decoder.stop()


def _told(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Generation | BaseException) -> None:
    loop.call_soon_threadsafe(_settle, future, result)


async def test_greedy_batched_equals_each_request_decoded_alone(engine: Engine) -> None:
    jobs = [(slot, engine.encode(text), SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True))
            for i, text in enumerate(PROMPTS) for slot in (None, "a", "b")]
    batched, stats = await decode_all(engine, jobs, max_num_seqs=8)
    assert stats.mean_batch > 2  # rows really were decoded together (2.05 here: the rounds are deterministic)
    for (slot, ids, params), got in zip(jobs, batched):
        alone = engine.generate(ids, params, slot=slot)
        assert got.token_ids == alone.token_ids
        assert got.finish_reason == alone.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(got.logprobs, alone.logprobs)) < TOL
        assert max(abs(a - b) for a, b in zip(got.logprobs, forward_logprobs(engine, slot, ids, got.token_ids))) < TOL


async def test_sampled_rows_keep_their_seed_and_match_a_forward_pass(engine: Engine) -> None:
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True, logprobs=2)
              for s in range(6)]
    jobs = [("a", engine.encode(PROMPTS[i % len(PROMPTS)]), p) for i, p in enumerate(params)]
    batched, _ = await decode_all(engine, jobs, max_num_seqs=6)
    for (slot, ids, p), got in zip(jobs, batched):
        assert got.token_ids == engine.generate(ids, p, slot=slot).token_ids  # same seed, same draw
        expected = forward_logprobs(engine, slot, ids, got.token_ids)
        assert max(abs(a - b) for a, b in zip(got.logprobs, expected)) < TOL
        assert [step[0][0] for step in got.top_logprobs] == got.token_ids  # sampled first, then the top 2


async def test_rows_stop_on_their_own_and_leave_the_batch(engine: Engine) -> None:
    ids = engine.encode(PROMPTS[0])
    free = engine.generate(ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    stop_text = engine.decode(free.token_ids[3:5])
    jobs = [(None, ids, SamplingParams(max_tokens=1, temperature=0)),
            (None, ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                       stop_token_ids=(free.token_ids[2],))),
            (None, ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=(stop_text,))),
            (None, ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]
    (one, by_id, by_text, full), _ = await decode_all(engine, jobs, max_num_seqs=4)
    for (_, _, p), got in zip(jobs, (one, by_id, by_text, full)):
        alone = engine.generate(ids, p)
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (alone.token_ids, alone.text, alone.finish_reason, alone.stop_reason)
    assert len(one.token_ids) == 1 and by_id.stop_reason == free.token_ids[2] and by_text.stop_reason == stop_text
    assert full.token_ids == free.token_ids


async def test_requests_over_max_num_seqs_wait_and_all_finish(engine: Engine) -> None:
    jobs = [(None, engine.encode(t), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)) for t in PROMPTS]
    done, stats = await decode_all(engine, jobs, max_num_seqs=2)
    assert [len(g.token_ids) for g in done] == [4] * len(PROMPTS)
    assert stats.mean_batch <= 2


async def test_an_unknown_adapter_fails_its_requests_not_the_others(engine: Engine) -> None:
    jobs = [("nope", engine.encode(PROMPTS[0]), SamplingParams(max_tokens=3, temperature=0)),
            (None, engine.encode(PROMPTS[1]), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))]
    decoder = Decoder(engine, lambda key: key, max_num_seqs=4)
    try:
        bad, good = await asyncio.gather(*(decoder.generate(s, i, p) for s, i, p in jobs), return_exceptions=True)
    finally:
        decoder.stop()
    assert "not loaded" in str(bad) and len(good.token_ids) == 3


async def test_stop_fails_what_is_waiting(engine: Engine) -> None:
    decoder = Decoder(engine, lambda key: key, max_num_seqs=1)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    tasks = [asyncio.create_task(decoder.generate(None, engine.encode(t), long)) for t in PROMPTS[:3]]
    while not decoder.stats.steps:  # the first request is decoding
        await asyncio.sleep(0.01)
    await asyncio.to_thread(decoder.stop)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert any(isinstance(r, RuntimeError) and "stopping" in str(r) for r in results)


def test_kv_batch_pads_on_the_left_and_trims_what_no_row_uses(engine: Engine, tmp_path: Path) -> None:
    batch = KVBatch()
    for n in (3, 7, 5):
        cache, _ = engine.prefill(list(range(1, n + 1)), None)
        batch.add(cache, n)
    assert batch.lengths == [3, 7, 5] and batch.width == 7
    assert batch.mask_BT.sum(dim=1).tolist() == [3, 7, 5]
    assert batch.mask_BT[0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    batch.keep([0, 2])  # the longest leaves: two padding columns go
    assert batch.width == 5 and batch.lengths == [3, 5]
    keys = batch.cache.layers[0].keys
    assert keys.shape[0] == 2 and keys.shape[2] == 5


async def test_prefill_reuses_a_known_prefix_and_changes_nothing(engine: Engine) -> None:
    system = [{"role": "system", "content": "You route search queries to search providers. The providers are: "
                                            "bio-dense, bm25-all, dense-all, eng-bm25, lib-bm25, alpha, beta."}]
    prompts = [engine.chat_prompt([*system, {"role": "user", "content": q}]) for q in PROMPTS]
    prompts.append(prompts[0])  # a rollout group's second member: the whole prompt is known
    before = engine.prefill_tokens_reused
    jobs = [("a", ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)) for ids in prompts]
    done = []
    for job in jobs:  # one after another, so each prefill finds the ones before
        done += (await decode_all(engine, [job], max_num_seqs=1))[0]
    reused = engine.prefill_tokens_reused - before
    shared = min(len(p) for p in prompts) - 8
    assert reused >= shared * (len(prompts) - 1)  # the system turn, every time after the first
    for (slot, ids, p), got in zip(jobs, done):
        alone = engine.generate(ids, p, slot=slot)
        assert got.token_ids == alone.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, alone.logprobs)) < TOL
    engine.load_adapter("a", engine_adapter_dir(engine))  # reloading a slot forgets its prefixes
    assert not [k for k in engine._prefills if k[0] == "a"]


def engine_adapter_dir(engine: Engine) -> Path:
    return Path(engine._peft.peft_config["a"].base_model_name_or_path).parent / "lora-a"
