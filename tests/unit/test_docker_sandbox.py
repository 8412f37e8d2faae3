"""The docker sandbox backend beyond what every backend passes (test_rollout_sandbox.py): bad settings refused
naming the field; FROM lines rewritten by ``base_images`` and the image tag following the rewritten text; on a
real daemon: the container's limits and isolation as configured, a harness over its memory limit crashing
with its output kept, one past ``command_timeout_s`` having its container killed with its output kept, an
image that will not build ending the rollout ``sandbox_failed``; and, with both backends, the relay reached
through the socket and nothing else, nothing a harness leaves behind reaching the verifier, the PID limit."""

from __future__ import annotations

import ipaddress
import json
import socket
import uuid

import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from schemas.task import Task
from services.rollouts.docker_sandbox import build_context, rewrite_from
from services.rollouts.sandbox import Workspace, make_sandbox
from services.rollouts.settings import DockerSandbox, RolloutSettings
from tests.support.docker_engine import BASE_IMAGE, TASK_BASE, docker_sandbox, sandbox_containers
from tests.support.records import NOW
from tests.support.sandboxes import harness, roll, task
from tests.support.serving import LoopbackServer


@pytest.mark.parametrize(("field", "value"), [
    ("pids_limit", 0), ("cpus", 0), ("memory_mb", 16), ("tmp_mb", 0), ("copy_out_mb", 0),
    ("base_images", {TASK_BASE: "Not An Image!"}), ("base_images", {"": BASE_IMAGE}),
    ("harness_layer", ["RUN true\nRUN false"]), ("network", "bridge"),
])
def test_bad_settings_are_refused_naming_the_field(field, value, monkeypatch):
    with pytest.raises(ValidationError) as err:
        DockerSandbox(**{field: value})
    assert field in str(err.value)
    monkeypatch.setenv("FANROUTE_SANDBOX", json.dumps({"type": "docker", field: value}))
    with pytest.raises(ValidationError, match=f"sandbox.docker.{field}"):
        RolloutSettings()


def test_from_lines_are_rewritten_and_the_tag_follows_the_text(tmp_path):
    dockerfile = (f"FROM --platform=linux/amd64 {TASK_BASE} AS build\r\nRUN true\n"
                  f"from {TASK_BASE}\nFROM build\nFROM debian:bookworm\nCOPY --from={TASK_BASE} /x /x\n")
    mapped = rewrite_from(dockerfile, {TASK_BASE: BASE_IMAGE})
    assert mapped == (f"FROM --platform=linux/amd64 {BASE_IMAGE} AS build\r\nRUN true\nfrom {BASE_IMAGE}\n"
                      f"FROM build\nFROM debian:bookworm\nCOPY --from={TASK_BASE} /x /x\n")
    env = tmp_path / "environment"
    env.mkdir()
    (env / "Dockerfile").write_text(dockerfile)
    tag, _ = build_context(env, {TASK_BASE: BASE_IMAGE}, ())
    assert tag == build_context(env, {TASK_BASE: BASE_IMAGE}, ())[0]
    assert tag != build_context(env, {}, ())[0] != build_context(env, {}, ("RUN true",))[0]
    assert tag != build_context(env, {TASK_BASE: "fanroute/debian:bookworm-local"}, ())[0]


@pytest.mark.docker
async def test_the_container_is_limited_and_isolated_as_configured(tmp_path, docker_harness_image):
    settings = RolloutSettings(harness=harness(tmp_path, "true\n"), work_dir=tmp_path,
                               sandbox=docker_sandbox(docker_harness_image, memory_mb=96, pids_limit=40, cpus=0.5))
    box, ws = make_sandbox(settings.sandbox, settings.harness), Workspace.create(task().files, tmp_path)
    try:
        await box.prepare(ws)
        host = box.containers[ws.root].attrs["HostConfig"]
        assert (host["Memory"], host["MemorySwap"], host["PidsLimit"], host["NanoCpus"]) == (
            96 << 20, 96 << 20, 40, 500_000_000)
        assert (host["NetworkMode"], host["ReadonlyRootfs"], host["CapDrop"], host["SecurityOpt"]) == (
            "none", True, ["ALL"], ["no-new-privileges"])
        assert [m for m in host["Mounts"] if m["Type"] == "bind"] == [  # the workspace's run/ only
            {"Type": "bind", "Source": str(ws.socket.parent), "Target": "/run/fanroute", "ReadOnly": True}]
    finally:
        await box.close(ws)
        await box.close(ws)  # idempotent
        ws.remove()
    assert not sandbox_containers(box.client, tmp_path)


@pytest.mark.docker
async def test_a_harness_over_its_memory_limit_crashes_with_its_output_kept(tmp_path, docker_harness_image):
    run = await roll(tmp_path, docker_sandbox(docker_harness_image, memory_mb=64),
                     'echo "bm25-all > eng-bm25" > /app/answer.txt; echo allocating\n'
                     'python3 -c "b = bytearray(512 << 20)"\n')
    assert (run.outcome, run.reward, run.reward_source, run.harness.exit_code) == ("harness_crashed", -1.0,
                                                                                    "terminal", 137)
    assert not run.harness.timed_out and run.verifier is None
    assert run.answer == "bm25-all > eng-bm25\n" and run.harness.stdout == "allocating\n"
    assert "memory limit (64 MiB) was hit" in run.harness.stderr and "memory limit" in run.reason


@pytest.mark.docker
async def test_a_harness_past_its_timeout_has_its_container_killed_with_its_output_kept(tmp_path,
                                                                                          docker_harness_image):
    script = ('trap "" TERM; echo started; echo "eng-bm25 > bm25-all" > /app/answer.txt; echo note > '
              '/logs/agent/note.txt; setsid sleep 300 & sleep 300\n')
    settings = RolloutSettings(harness=harness(tmp_path, script), work_dir=tmp_path,
                               sandbox=docker_sandbox(docker_harness_image))
    box, ws = make_sandbox(settings.sandbox, settings.harness), Workspace.create(task().files, tmp_path)
    try:
        await box.prepare(ws)
        run = await box.run(ws, "harness", settings.harness.command, {}, 1.5, 4096)
        container = box.containers[ws.root]
        container.reload()
        assert (container.status, container.attrs["State"]["ExitCode"]) == ("exited", 137)  # killed by the runner
        assert run.timed_out and run.exit_code is None and 1.5 <= run.duration_s < 10
        assert run.stdout == "started\n" and ws.answer() == "eng-bm25 > bm25-all\n"
        assert (ws.logs / "agent" / "note.txt").read_text() == "note\n"
    finally:
        await box.close(ws)
        await box.close(ws)
        ws.remove()
    assert not sandbox_containers(box.client, tmp_path)
    # the same through a rollout: the timed_out terminal reward, the answer kept, the container gone (roll)
    ro = await roll(tmp_path, settings.sandbox, script, command_timeout_s=1.5)
    assert (ro.outcome, ro.reward, ro.harness.timed_out, ro.answer) == ("timed_out", -0.5, True,
                                                                        "eng-bm25 > bm25-all\n")


@pytest.mark.docker
@pytest.mark.parametrize(("dockerfile", "why"), [
    ("FROM fanroute-test/no-such-image:1\n", "registry"),  # not mapped, cannot be pulled here
    (f"FROM {TASK_BASE}\nRUN echo broken-step && exit 3\n", "broken-step"),
])
async def test_an_image_that_will_not_build_fails_the_sandbox(tmp_path, docker_harness_image, dockerfile, why):
    t = task()
    broken = Task(task_id="unbuildable", trace_id=t.trace_id, created_at=NOW,
                  files={**t.files, "environment/Dockerfile": dockerfile})
    run = await roll(tmp_path, docker_sandbox(docker_harness_image), "true\n", broken)
    assert (run.outcome, run.reward, run.flagged, run.harness) == ("sandbox_failed", -1.0, True, None)
    assert "cannot build the task's image" in run.reason and why in run.reason and "base_images" in run.reason
    # with the harness's own image the task's Dockerfile is not built
    run = await roll(tmp_path, docker_sandbox(docker_harness_image), "echo 'bm25-all' > /app/answer.txt\n", broken,
                     image=docker_harness_image)
    assert (run.outcome, run.answer) == ("completed", "bm25-all\n")


@pytest.mark.docker
async def test_a_sandbox_slower_to_start_than_the_rollout_budget_times_out(tmp_path, docker_engine,
                                                                           docker_harness_image):
    t = task()
    dockerfile = f"FROM {TASK_BASE}\nRUN sleep 2 # {uuid.uuid4().hex}\n"  # a fresh build, longer than the budget
    slow = Task(task_id="slow", trace_id=t.trace_id, created_at=NOW,
                files={**t.files, "environment/Dockerfile": dockerfile})
    backend = docker_sandbox(docker_harness_image)
    env = tmp_path / "env"
    env.mkdir()
    (env / "Dockerfile").write_text(dockerfile)
    tag = build_context(env, backend.base_images, ())[0]
    try:
        run = await roll(tmp_path, backend, "true\n", slow, sandbox_timeout_s=1, command_timeout_s=1)
    finally:
        docker_engine.images.remove(tag, force=True)
    assert (run.outcome, run.reward, run.harness) == ("timed_out", -0.5, None)
    assert "ran out before the harness" in run.reason  # and roll saw no container left behind


def _host_address(backend) -> str:
    """An address of this host that the sandbox must not reach: the Docker bridge's gateway, or (bwrap) the
    address the host's default route leaves from."""
    if backend.type == "docker":
        import docker

        ipam = docker.from_env().networks.get("bridge").attrs["IPAM"]["Config"][0]
        return ipam.get("Gateway") or str(next(ipaddress.ip_network(ipam["Subnet"]).hosts()))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("1.1.1.1", 80))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


async def test_the_harness_reaches_the_relay_through_its_socket_and_nothing_else(tmp_path, sandbox_backend):
    listener = socket.create_server(("0.0.0.0", 0))
    port, host = listener.getsockname()[1], _host_address(sandbox_backend)
    socket.create_connection((host, port), timeout=3).close()  # reachable from the host itself
    relay = Starlette(routes=[Route("/tr/{trace}/ping",
                                    lambda req: PlainTextResponse(f"pong {req.path_params['trace']}"))])
    script = ("exec python3 - <<'EOF'\nimport os, socket, urllib.request\n"
              f"for target in (('1.1.1.1', 80), ('{host}', {port})):\n"
              "    try:\n        socket.create_connection(target, timeout=3)\n        print('reached', target[0])\n"
              "    except OSError as exc:\n        print('blocked', target[0], type(exc).__name__)\n"
              "print(urllib.request.urlopen(os.environ['FANROUTE_BASE_URL'] + '/ping', timeout=10).read().decode())\n"
              "EOF\n")
    try:
        with LoopbackServer(relay) as server:
            run = await roll(tmp_path, sandbox_backend, script, relay_url=server.url().rstrip("/"))
    finally:
        listener.close()
    lines = run.harness.stdout.splitlines()
    assert [ln.split()[:2] for ln in lines[:2]] == [["blocked", "1.1.1.1"], ["blocked", host]], run.harness
    assert lines[2] == "pong g-1-0" and run.relay_connections == 1


async def test_nothing_the_harness_leaves_behind_reaches_the_verifier(tmp_path, sandbox_backend):
    # an answer worth 0, a loop that keeps writing reward 1, a json module planted where the grader imports,
    # and a usercustomize in the user site-packages (under /root, which both phases share) that writes reward 1
    script = ('echo "no ordering" > /app/answer.txt\n'
              'mkdir -p /tests /logs/verifier 2>/dev/null; echo "raise SystemExit(0)" > /tests/json.py 2>/dev/null\n'
              'setsid bash -c "while :; do echo 1 > /logs/verifier/reward.txt; sleep 0.05; done" '
              '</dev/null >/dev/null 2>&1 &\n'
              'site=$(python3 -c "import site; print(site.getusersitepackages())"); mkdir -p "$site"\n'
              'echo "import os; open(\'/logs/verifier/reward.txt\', \'w\').write(\'1\'); os._exit(0)" '
              '> "$site/usercustomize.py"\nexit 0\n')
    run = await roll(tmp_path, sandbox_backend, script)
    assert (run.outcome, run.reward, run.reward_source) == ("completed", 0.0, "reward.txt"), run.verifier


@pytest.mark.docker
async def test_the_pid_limit_holds(tmp_path, docker_harness_image):
    script = ("exec python3 - <<'EOF'\nimport os, time\nn = 0\ntry:\n    for _ in range(200):\n"
              "        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
              "except BlockingIOError:\n    pass\nprint('forked', n)\nEOF\n")
    run = await roll(tmp_path, docker_sandbox(docker_harness_image, pids_limit=32), script)
    forked = int(run.harness.stdout.split()[1])
    assert 0 < forked < 32 and run.outcome == "completed"


@pytest.mark.parametrize("filters", [True, False], ids=["tarfile-filters", "python-3.11.2"])
def test_copied_out_files_stay_under_their_directory(tmp_path, monkeypatch, filters):
    """Outputs copied out of a container: regular files land under the workspace, a member climbing out
    (``../``) or a link is refused — with tarfile's ``data`` filter and where Python predates it (the
    local image's Debian 3.11.2, where the rollout runner runs in compose)."""
    import io
    import tarfile

    from services.rollouts.docker_sandbox import _FILTER_ERRORS, _extract

    if not filters:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("app/answer.txt", b"aero"), ("../evil.txt", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    dest = tmp_path / "out"
    dest.mkdir()
    refused = []
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        for member in tar:
            try:
                _extract(tar, member, dest)
            except (*_FILTER_ERRORS, OSError):
                refused.append(member.name)
    assert (dest / "app" / "answer.txt").read_bytes() == b"aero"
    assert refused == ["../evil.txt"] and not (tmp_path / "evil.txt").exists()
