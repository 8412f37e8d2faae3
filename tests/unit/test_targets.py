"""SFT target formats: the assistant turn reduced to the decision (first), the top tier, or kept whole."""

from __future__ import annotations

import pytest

from services.common.prompt import TARGETS, retarget
from tests.support.records import episode

PROVIDERS = ("aero", "biomed", "web-lexical")


def _answer(ep) -> str:
    return ep.messages[-1].content


@pytest.mark.parametrize(("target", "want"), [
    ("ordering", "aero = web-lexical > biomed"), ("first", "aero"), ("top-tier", "aero = web-lexical")])
def test_each_target_rewrites_only_the_assistant_turn(target: str, want: str) -> None:
    ep = episode("supersonic wing", "aero = web-lexical > biomed", PROVIDERS, ep_id="e1")
    out = retarget(ep, target)
    assert _answer(out) == want
    assert out.messages[:-1] == ep.messages[:-1] and out.episode_id == ep.episode_id  # same prompt, same id


def test_an_unreadable_answer_is_left_alone_and_an_unknown_target_refused() -> None:
    ep = episode("q", "", PROVIDERS, ep_id="e2")
    assert retarget(ep, "first") == ep
    with pytest.raises(ValueError, match="unknown target"):
        retarget(ep, "best")
    assert TARGETS == ("ordering", "first", "top-tier")


def test_the_trainer_trains_on_the_target_and_grades_on_the_whole_ordering(tmp_path) -> None:
    """plan_run rewrites the training split only; the eval split keeps the judge's ordering."""
    from services.common.dataset import write_jsonl
    from services.trainer.settings import SftRun, TrainerSettings
    from services.trainer.train import plan_run
    from tests.support.tiny_model import build_tiny_model

    eps = [episode(f"query number {i} about wings", "aero = web-lexical > biomed", PROVIDERS, ep_id=f"e{i:03d}")
           for i in range(40)]
    write_jsonl(eps, tmp_path / "eps.jsonl")
    base = build_tiny_model(tmp_path / "base")
    for target, want in (("first", "aero"), ("ordering", "aero = web-lexical > biomed")):
        settings = TrainerSettings(run=SftRun(target=target), base_model=str(base), episodes_file=tmp_path / "eps.jsonl",
                                   allow_uncalibrated=True, output_dir=tmp_path / target, eval_fraction=0.2)
        plan = plan_run(settings)
        assert plan.counts["target"] == target
        assert {_answer(e) for e in plan.train_episodes} == {want}
        assert {_answer(e) for e in plan.eval_episodes} == {"aero = web-lexical > biomed"}
    assert SftRun().target == "first"  # the decision is the default


def test_tie_smoothing_spreads_a_share_of_an_episode_over_its_top_tier() -> None:
    from services.common.prompt import tie_variants

    ep = episode("supersonic wing", "aero = web-lexical = biomed > physics", (*PROVIDERS, "physics"), ep_id="e1")
    out = tie_variants(ep, 0.3)
    assert [(_answer(v), v.episode_id) for v, _ in out] == [("aero", "e1"), ("web-lexical", "e1#web-lexical"),
                                                            ("biomed", "e1#biomed")]
    assert [w for _, w in out] == pytest.approx([0.8, 0.1, 0.1]) and sum(w for _, w in out) == pytest.approx(1.0)
    assert all(v.messages[:-1] == ep.messages[:-1] for v, _ in out)  # the same prompt for every variant
    alone = episode("q", "aero > web-lexical", PROVIDERS, ep_id="e2")  # no tie: the plain first-choice example
    assert tie_variants(alone, 0.3) == [(retarget(alone, "first"), 1.0)]
    assert tie_variants(ep, 0.0) == [(retarget(ep, "first"), 1.0)]
    assert tie_variants(episode("q", "", PROVIDERS, ep_id="e3"), 0.3)[0][1] == 1.0  # unreadable: left alone
    with pytest.raises(ValueError, match=r"smoothing must be in \[0, 1\)"):
        tie_variants(ep, 1.0)


def test_the_trainer_weighs_tie_variants_and_keeps_each_episode_in_one_batch(tmp_path) -> None:
    """Each episode's variants share a batch and their weights sum to 1 (times its class-balance weight),
    so the batch's weighted mean counts every episode once; smoothing another target is refused by name."""
    from pydantic import ValidationError

    from services.common.dataset import write_jsonl
    from services.trainer.settings import SftRun, TrainerSettings
    from services.trainer.train import plan_run
    from tests.support.tiny_model import build_tiny_model

    eps = [episode(f"query number {i} about wings", "aero = web-lexical > biomed" if i % 2 else "biomed > aero",
                   PROVIDERS, ep_id=f"e{i:03d}") for i in range(24)]
    write_jsonl(eps, tmp_path / "eps.jsonl")
    base = build_tiny_model(tmp_path / "base")
    settings = TrainerSettings(run=SftRun(tie_smoothing=0.4), base_model=str(base), episodes_file=tmp_path / "eps.jsonl",
                               allow_uncalibrated=True, output_dir=tmp_path / "out", eval_fraction=0.0, batch_size=4)
    plan = plan_run(settings)
    n_tied = sum(1 for e in plan.train_episodes if "aero" == _answer(e))
    assert plan.counts["tie_variants"] == n_tied == 12 and len(plan.examples) == 36
    weight = {e.episode_id: e.weight for e in plan.examples}
    assert weight["e001"] == pytest.approx(0.8) and weight["e001#web-lexical"] == pytest.approx(0.2)
    assert weight["e000"] == 1.0
    for batch in plan.batches:
        ids = [plan.examples[i].episode_id for i in batch]
        assert all(i.split("#")[0] in ids for i in ids)  # a variant's episode is in its batch
    assert sorted(i for b in plan.batches for i in b) == list(range(36))  # one pass: every example once
    assert len(plan.batches) == 6 and "one pass over 24 training episodes (36 examples" in plan.one_pass_line()
    with pytest.raises(ValidationError, match="tie_smoothing 0.4 applies to target first only"):
        SftRun(target="top-tier", tie_smoothing=0.4)
