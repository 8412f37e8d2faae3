"""Sandbox tests with each real backend (bubblewrap, and Docker: ``sandbox_backend`` in conftest): a harness
that reads /tests or a host path, dials the network, writes outside /app, runs past its timeout or crashes
ends the way the rules say (terminal rewards, every process it started killed, a grader crash scoring 0 and
flagged), and a good answer earns the verifier's reward. Docker-only checks: test_docker_sandbox.py."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from pathlib import Path

import pytest

from schemas.task import Task
from services.rollouts.rollout import run_rollout
from services.rollouts.sandbox import make_sandbox
from services.rollouts.settings import RolloutSettings
from tests.support.poll import eventually
from tests.support.records import NOW
from tests.support.sandboxes import FakeAdmin, harness, left_behind, roll, task


async def test_a_good_answer_earns_the_verifiers_reward_and_the_env_is_wired(tmp_path, sandbox_backend):
    run = await roll(tmp_path, sandbox_backend,
                     'set -e; env | sort > /logs/agent/env; cat /root/instruction.md >/dev/null\n'
                     'echo "bm25-all = eng-bm25 > dense-all > lib-bm25" > /app/answer.txt\n'
                     'echo "$OPENAI_BASE_URL $ANTHROPIC_BASE_URL $FANROUTE_BASE_URL $FANROUTE_MODEL"\n'
                     'test "$OPENAI_API_KEY" = "$FANROUTE_TRACE_TOKEN" -a "$ANTHROPIC_API_KEY" = '
                     '"$FANROUTE_TRACE_TOKEN"\n')
    assert (run.outcome, run.reward, run.reward_source, run.flagged) == ("completed", 1.0, "reward.txt", False)
    assert run.harness.stdout.split() == ["http://127.0.0.1:8020/tr/g-1-0/v1", "http://127.0.0.1:8020/tr/g-1-0",
                                          "http://127.0.0.1:8020/tr/g-1-0", "router"]
    assert run.answer.strip() == "bm25-all = eng-bm25 > dense-all > lib-bm25"
    assert run.verifier.exit_code == 0 and "reward 1.0" in run.verifier.stdout


async def test_tests_and_host_paths_are_not_visible_to_the_harness(tmp_path, sandbox_backend):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("do not read")
    run = await roll(tmp_path, sandbox_backend,
                     f'ls /tests; cat {secret}; ls {Path.cwd()}; cat /tests/fixtures/grades.json\n'
                     'cat ../tests/fixtures/grades.json; exit 0\n')
    err = run.harness.stderr
    assert "/tests" in err and "No such file or directory" in err and "do not read" not in run.harness.stdout
    assert str(secret) in err and str(Path.cwd()) in err
    assert '"grades"' not in run.harness.stdout
    # no answer was written: the verifier (which does see /tests) scores the missing answer 0
    assert (run.outcome, run.reward, run.answer) == ("completed", 0.0, None)


async def test_the_harness_reaches_no_network_not_even_the_hosts_loopback(tmp_path, sandbox_backend):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        run = await roll(tmp_path, sandbox_backend,
                         f'exec python3 -c "\nimport socket\n'
                         f'for host, port in ((\'127.0.0.1\', {port}), (\'1.1.1.1\', 53)):\n'
                         f'    socket.create_connection((host, port), timeout=3)\n"\n')
    finally:
        listener.close()
    assert run.outcome == "harness_crashed" and run.reward == -1.0
    assert "ConnectionRefusedError" in run.harness.stderr  # its own loopback has nothing on the host's port


async def test_the_system_is_read_only(tmp_path, sandbox_backend):
    run = await roll(tmp_path, sandbox_backend,
                     'grep -q "^CapEff:[[:space:]]*0*$" /proc/self/status || echo has-capabilities; '
                     'mount -t tmpfs x /app 2>/dev/null || echo no-mount; '
                     'touch /usr/x || echo usr-ro; touch /etc/x || echo etc-ro; '
                     f'touch {Path(__file__)} || echo host-invisible; echo ok > /tmp/t && echo tmp-rw\n'
                     'exit 4\n')
    assert run.harness.stdout.split() == ["no-mount", "usr-ro", "etc-ro", "host-invisible", "tmp-rw"]
    assert run.harness.stderr.count("Read-only file system") == 2 and "No such file or directory" in run.harness.stderr
    assert (run.outcome, run.reward, run.harness.exit_code) == ("harness_crashed", -1.0, 4)
    assert "exited with status 4" in run.reason


async def test_a_harness_past_its_timeout_is_killed_with_its_whole_group(tmp_path, sandbox_backend):
    marker = f"fanroute-sleeper-{tmp_path.name}"
    run = await roll(tmp_path, sandbox_backend,
                     f'(exec -a {marker} sleep 300) & setsid bash -c "exec -a {marker} sleep 300" &\n'
                     'echo started; sleep 300\n', command_timeout_s=2)
    assert (run.outcome, run.reward, run.reward_source) == ("timed_out", -0.5, "terminal")
    assert run.harness.timed_out and run.harness.exit_code is None and run.harness.stdout.strip() == "started"
    assert run.verifier is None  # never reached

    def gone() -> bool:
        return marker not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout

    await eventually(gone, timeout_s=10, what="every process of the sandbox killed")


async def test_the_rollout_budget_bounds_the_harness_too(tmp_path, sandbox_backend):
    run = await roll(tmp_path, sandbox_backend, "sleep 300\n", sandbox_timeout_s=1.5, command_timeout_s=1.5)
    assert run.outcome == "timed_out" and run.harness.timeout_s <= 1.5


async def test_a_crash_scores_the_terminal_reward_with_its_output_kept(tmp_path, sandbox_backend):
    run = await roll(tmp_path, sandbox_backend,
                     'echo "about to fail"; python3 -c "raise SystemExit(\'boom: no model\')"\n')
    assert (run.outcome, run.reward, run.flagged) == ("harness_crashed", -1.0, False)
    assert "about to fail" in run.harness.stdout and "boom: no model" in run.harness.stderr
    assert "boom: no model" in run.reason


async def test_context_exhausted_scores_its_own_terminal_reward(tmp_path, sandbox_backend):
    run = await roll(tmp_path, sandbox_backend, "echo 'prompt too long' >&2; exit 3\n")
    assert (run.outcome, run.reward) == ("context_exhausted", -0.25)


async def test_a_grader_crash_scores_zero_and_is_flagged(tmp_path, sandbox_backend):
    t = task()
    files = dict(t.files)
    files["tests/fixtures/grades.json"] = "{not json"
    broken = Task(task_id="broken", trace_id=t.trace_id, created_at=NOW, files=files)
    run = await roll(tmp_path, sandbox_backend, "echo 'bm25-all > eng-bm25' > /app/answer.txt\n", broken)
    assert (run.outcome, run.reward, run.flagged) == ("grader_crashed", 0.0, True)
    assert "Traceback" in run.verifier.stderr and "crashed" in run.reason


def _priced(costs: dict[str, float]) -> Task:
    """The test task with its recorded candidates priced per call."""
    import json

    from services.common.rewards import CANDIDATES_FILE

    t = task()
    files = dict(t.files)
    files[CANDIDATES_FILE] = json.dumps([c | {"cost_usd": costs[c["provider"]]}
                                         for c in json.loads(files[CANDIDATES_FILE])])
    return Task(task_id="priced", trace_id=t.trace_id, created_at=NOW, files=files)


@pytest.mark.parametrize(("answer", "ndcg", "chosen_cost"), [
    ("bm25-all = eng-bm25 > dense-all > lib-bm25", 1.0, 0.001),  # a tie on top: the cheaper one is the route
    ("eng-bm25 > bm25-all > dense-all > lib-bm25", 1.0, 0.001),
    ("bm25-all > eng-bm25 > dense-all > lib-bm25", 1.0, 0.004),  # as good, but routed to the dearer provider
    ("no ordering here", 0.0, 0.004),  # unparseable: charged the dearest provider, never cheaper than answering
])
async def test_the_cost_aware_reward_charges_the_first_choice(tmp_path, sandbox_backend, answer, ndcg, chosen_cost):
    costs = {"bm25-all": 0.004, "eng-bm25": 0.001, "dense-all": 0.002, "lib-bm25": 0.003}
    run = await roll(tmp_path, sandbox_backend, f"echo '{answer}' > /app/answer.txt\n", _priced(costs),
                     reward="ndcg_cost", cost_weight=50.0)
    assert run.outcome == "completed" and not run.flagged
    assert run.rewards["ndcg"] == pytest.approx(ndcg) and run.rewards["first_cost_usd"] == chosen_cost
    assert run.reward == run.rewards["ndcg_cost"] == pytest.approx(ndcg - 50.0 * chosen_cost)


async def test_the_cost_aware_reward_of_a_task_without_costs_is_flagged_not_guessed(tmp_path, sandbox_backend):
    from services.common.rewards import CANDIDATES_FILE

    t = task()
    files = {k: v for k, v in t.files.items() if k != CANDIDATES_FILE}
    bare = Task(task_id="bare", trace_id=t.trace_id, created_at=NOW, files=files)
    run = await roll(tmp_path, sandbox_backend, "echo 'bm25-all > eng-bm25' > /app/answer.txt\n", bare,
                     reward="ndcg_cost", cost_weight=50.0)
    assert run.outcome == "completed" and run.flagged and "ndcg_cost not computed" in run.reason
    assert "ndcg_cost" not in run.rewards and run.reward == run.rewards["reward"] > 0  # the verifier's, kept


def test_reward_settings_are_bounded():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="reward"):
        RolloutSettings(reward="ndcg_minus_latency")
    with pytest.raises(ValidationError, match="cost_weight"):
        RolloutSettings(cost_weight=-1)


async def test_output_is_capped(tmp_path, sandbox_backend):
    run = await roll(tmp_path, sandbox_backend, "head -c 200000 /dev/zero | tr '\\0' x; exit 0\n",
                     output_limit_bytes=4096)
    assert len(run.harness.stdout) == 4096 and run.harness.truncated


async def test_sandboxes_run_side_by_side(tmp_path, sandbox_backend):
    settings = RolloutSettings(harness=harness(tmp_path, 'echo "$FANROUTE_BASE_URL" > /app/answer.txt\n'),
                               admin_token="x", work_dir=tmp_path, sandbox=sandbox_backend)
    box = make_sandbox(settings.sandbox, settings.harness)
    runs = await asyncio.gather(*(run_rollout(settings, box, FakeAdmin(), task(), f"g-3-{i}", i) for i in range(3)))
    assert [r.answer.strip().rsplit("/", 1)[1] for r in runs] == ["g-3-0", "g-3-1", "g-3-2"]  # private /app each
    assert not left_behind(box, tmp_path)
