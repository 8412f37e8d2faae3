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
