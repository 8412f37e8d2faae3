"""Groups (stamp at start, advantage = reward - mean, uniform groups reported and counted, max_parallel and
its ceiling) and the router harness's reading of a replay task, against each real sandbox backend (bwrap, docker)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

from services.common.prompt import system_prompt
from services.common.stamps import MemoryStampStore
from services.episodes.tasks import build_task, instruction
from services.rollouts.group import UNIFORM, GroupRunner, advantages, ceiling_report
from services.rollouts.relay_client import Ended
from services.rollouts.sandbox import make_sandbox
from services.rollouts.settings import HARNESS_DIR, HarnessSettings, RolloutSettings
from tests.support.records import NOW, judged_trace, verdict_for

spec = importlib.util.spec_from_file_location("router_harness", HARNESS_DIR / "router.py")
harness_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(harness_mod)
PROVIDERS = ["bm25-all", "dense-all", "eng-bm25", "lib-bm25"]


def test_advantages_are_reward_minus_the_group_mean():
    mean, advs, uniform = advantages([1.0, 0.0, 0.5, 0.5])
    assert (mean, advs, uniform) == (0.5, [0.5, -0.5, 0.0, 0.0], False)
    assert advantages([0.7, 0.7]) == (pytest.approx(0.7), [0.0, 0.0], True)


def test_a_work_dir_too_long_for_the_relay_socket_is_refused_naming_the_field(tmp_path):
    """The socket path must fit AF_UNIX's 107 bytes; a long work_dir failed every rollout before."""
    from services.rollouts.settings import MAX_WORK_DIR_BYTES

    fits = "/" + "a" * (MAX_WORK_DIR_BYTES - 1)
    assert RolloutSettings(work_dir=fits).work_dir is not None
    with pytest.raises(ValueError, match="work_dir .* AF_UNIX"):
        RolloutSettings(work_dir=fits + "b")


def test_the_ceiling_is_reported_next_to_max_parallel():
    s = RolloutSettings(max_parallel=8, max_steps_off_policy=2, groups_per_batch=8, group_size=4)
    assert s.ceiling == 96 and "(2 + 1) x 8 x 4 = 96" in ceiling_report(s) and "over it" not in ceiling_report(s)
    assert "too stale" in ceiling_report(RolloutSettings(max_parallel=10, max_steps_off_policy=0, groups_per_batch=1,
                                                         group_size=2))
    with pytest.raises(ValueError, match="cannot outlive"):
        RolloutSettings(sandbox_timeout_s=10, command_timeout_s=20)


def test_the_harness_reads_the_task_and_asks_with_the_shared_router_prompt():
    text = instruction("what is `x` > y?", ["b`q", *PROVIDERS])
    query, names, answer = harness_mod.read_instruction(text)
    assert (query, sorted(names), answer) == ("what is `x` > y?", sorted(["b`q", *PROVIDERS]), "/app/answer.txt")
    for providers in (PROVIDERS, PROVIDERS[:2], ["solo"]):
        assert harness_mod.system_prompt(providers) == system_prompt(providers)
    with pytest.raises(ValueError):
        harness_mod.read_instruction("# not a task")


@pytest.mark.parametrize("reply, line", [
    ("bm25-all > eng-bm25 = dense-all > lib-bm25", "bm25-all > eng-bm25 = dense-all > lib-bm25"),
    ("```\nBM25-ALL = eng-bm25 > dense-all\n```", "bm25-all = eng-bm25 > dense-all"),
    ("1. eng-bm25\n2. bm25-all\n3. dense-all", "eng-bm25 > bm25-all > dense-all"),
    ("bm25-all > bm25-all > nope > lib-bm25", "bm25-all > lib-bm25"),
    ("I cannot decide", "I cannot decide"),
])
def test_the_harness_reads_the_reply_tolerantly(reply, line):
    assert harness_mod.ordering_line(reply, PROVIDERS) == line


class EndingAdmin:
    def __init__(self) -> None:
        self.ended: dict[str, float] = {}

    async def mint(self, trace_id: str, ttl_s: float) -> str:
        return "frt_x"

    async def revoke(self, token: str) -> None:
        return None

    async def end(self, trace_id: str, advantage: float) -> Ended:
        self.ended[trace_id] = advantage
        return Ended(note="no relay calls recorded for this rollout")


async def group_of(tmp_path: Path, backend, script: str, **kw):
    d = tmp_path / "h"
    d.mkdir(exist_ok=True)
    (d / "h.sh").write_text(script)
    settings = RolloutSettings(harness=HarnessSettings(name="scripted", directory=d, command=("bash", "/harness/h.sh")),
                               admin_token="x", work_dir=tmp_path, model_id="router", sandbox=backend, **kw)
    stamps = MemoryStampStore()
    for _ in range(3):
        await stamps.incr("router")
    admin = EndingAdmin()
    runner = GroupRunner(settings, make_sandbox(settings.sandbox, settings.harness), admin, stamps)
    group = await runner.run_group(build_task(judged_trace(), verdict_for("t-1"), now=NOW), "g-test")
    return group, runner, admin


async def test_a_group_is_stamped_and_gets_advantages_with_max_parallel_held(tmp_path, sandbox_backend):
    script = ('case "$FANROUTE_BASE_URL" in *-0) a="bm25-all = eng-bm25 > dense-all > lib-bm25";;'
              ' *-1) a="lib-bm25 > dense-all > bm25-all = eng-bm25";; *) a="nonsense";; esac\n'
              'echo "$a" > /app/answer.txt\n')
    group, runner, admin = await group_of(tmp_path, sandbox_backend, script, group_size=3, max_parallel=1)
    assert (group.adapter_version, group.model_id, group.sandbox, group.uniform) == (
        3, "router", sandbox_backend.type, False)
    rewards = group.rewards_G
    assert rewards[0] == 1.0 and 0 < rewards[1] < 1 and rewards[2] == 0.0
    assert group.reward_mean == pytest.approx(sum(rewards) / 3)
    assert [r.advantage for r in group.rollouts] == pytest.approx([x - group.reward_mean for x in rewards])
    assert admin.ended == {r.trace_id: r.advantage for r in group.rollouts}
    assert [r.rollout_id for r in group.rollouts] == ["g-test:0", "g-test:1", "g-test:2"]
    assert runner.metrics.peak_in_flight == 1 and runner.metrics.rollouts_by_outcome["completed"] == 3
    assert all("no relay calls" in r.reason for r in group.rollouts)  # this scripted harness never called


async def test_a_uniform_group_is_reported_and_counted(tmp_path, sandbox_backend, caplog):
    caplog.set_level(logging.INFO, logger="services.rollouts.group")
    group, runner, admin = await group_of(tmp_path, sandbox_backend, 'echo "bm25-all > eng-bm25" > /app/answer.txt\n',
                                          group_size=2)
    assert group.uniform and len(set(group.rewards_G)) == 1 and set(admin.ended.values()) == {0.0}
    assert runner.metrics.uniform_groups == 1 and runner.metrics.peak_in_flight == 2
    assert any(UNIFORM in r.getMessage() for r in caplog.records)
