"""Rollout runner settings: the relay, the group shape, timeouts, terminal rewards, the harness and the sandbox.

The sandbox backend is a discriminated union on ``type``: ``bwrap`` (bubblewrap, no daemon needed) or
``docker`` (a container built from the task's Dockerfile through the docker SDK; needs a daemon).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints, model_validator

from schemas.adapter import MODEL_ID_PATTERN
from services.common.rewards import DEFAULT_COST_WEIGHT, RewardComponent
from services.common.settings import ServiceSettings

HARNESS_DIR = Path(__file__).resolve().parent / "harness"
#: The longest work_dir whose rollouts' sockets (``/fanroute-rollout-XXXXXXXX/run/relay.sock``) fit in
#: an AF_UNIX path (107 bytes and a NUL).
MAX_WORK_DIR_BYTES = 107 - len("/fanroute-rollout-XXXXXXXX/run/relay.sock")


class HarnessSettings(BaseModel):
    """What runs in the sandbox: a directory (bound read-only at ``/harness`` by bwrap, copied there by docker)
    and a command, launched with stdin closed and the instruction at ``/root/instruction.md``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(default="router", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$",
                      description="The harness's name on the rollout records")
    directory: Path = Field(default=HARNESS_DIR,
                            description="The harness's files, at /harness (bwrap binds them read-only, docker copies)")
    image: str | None = Field(default=None, min_length=1, max_length=512,
                              description="docker: run in this image instead of building the task's Dockerfile")
    command: tuple[str, ...] = Field(default=("python3", "/harness/router.py"), min_length=1, max_length=64,
                                     description="argv inside the sandbox (PATH holds the interpreter's bin)")
    max_tokens: int = Field(default=48, ge=1, le=8192,
                            description="Fixed max_tokens the router harness asks for (FANROUTE_HARNESS_MAX_TOKENS)")
    temperature: float = Field(default=1.0, ge=0, le=2, description="Sampling temperature the router harness asks for")
    request_timeout_s: float = Field(default=60.0, gt=0, le=3600,
                                     description="The router harness's own timeout per model call")
    context_exhausted_exit_code: int = Field(
        default=3, ge=1, le=255,
        description="A harness exiting with this status ran out of context (the router harness does so when the "
                    "relay refuses a prompt as too long)")


RelayPort = Annotated[int, Field(ge=1, le=65535, description="The loopback port inside the sandbox that forwards "
                                                             "to the relay (sandbox_init.py listens on it)")]


class BwrapSandbox(BaseModel):
    """bubblewrap: new mount, PID, network, IPC, UTS (and user, where allowed) namespaces, a read-only system."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["bwrap"] = "bwrap"
    bwrap: str = Field(default="bwrap", min_length=1, max_length=512, description="The bwrap executable")
    system_ro_binds: tuple[str, ...] = Field(
        default=("/usr", "/etc"), max_length=64,
        description="Host paths bound read-only at the same place (plus /bin, /lib, /lib64, /sbin as links into "
                    "/usr and the Python interpreter's prefix, so the harness's interpreter runs)")
    extra_ro_binds: tuple[str, ...] = Field(default=(), max_length=64,
                                            description="More host paths bound read-only at the same place")
    python_prefix: Path | None = Field(
        default=None, description="The interpreter prefix bound read-only (default: this process's sys.base_prefix "
                                  "and sys.prefix); its bin/ is first on the sandbox's PATH")
    memory_mb: int = Field(default=4096, ge=0, le=1_048_576,
                           description="RLIMIT_AS of the sandbox's processes in MiB (0 = unlimited)")
    file_size_mb: int = Field(default=256, ge=0, le=1_048_576,
                              description="RLIMIT_FSIZE: the largest file a sandboxed process may write (0 = unlimited)")
    relay_port: RelayPort = 8020


# A Docker image reference: [host[:port]/]path[:tag][@sha256:digest], as the engine's reference grammar has it.
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?/)?"
IMAGE_REF_PATTERN = rf"^{_HOST}{_PATH_PART}(?:/{_PATH_PART})*(?::\w[\w.-]{{0,127}})?(?:@sha256:[0-9a-f]{{64}})?$"
ImageRef = Annotated[str, StringConstraints(pattern=IMAGE_REF_PATTERN, max_length=255)]
DockerfileLine = Annotated[str, StringConstraints(pattern=r"^[^\r\n]+$", max_length=4096)]


class DockerSandbox(BaseModel):
    """One container per rollout built from the task's ``environment/Dockerfile`` (docker_sandbox.py): no network
    but the relay's socket, memory/swap, PID and CPU limits, every capability dropped, a read-only root."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    type: Literal["docker"] = "docker"
    base_url: str | None = Field(default=None, max_length=512,
                                 description="Docker daemon URL (default: DOCKER_HOST or the local socket)")
    base_images: dict[ImageRef, ImageRef] = Field(
        default_factory=dict, max_length=64,
        description='FROM-line substitutions applied to the task\'s Dockerfile before it is built, e.g. '
                    '{"python:3.11-slim": "fanroute/python:3.11-local"} where the official images cannot be '
                    'pulled (images are never pulled at build time); the image tag\'s hash covers the rewritten text')
    harness_layer: tuple[DockerfileLine, ...] = Field(
        default=(), max_length=64,
        description="Dockerfile lines appended to the task's Dockerfile for the harness's own dependencies (the "
                    "router harness needs only `openai`, e.g. RUN pip install --no-cache-dir 'openai>=1.40'); "
                    "empty: the (mapped) base image must already have them")
    relay_port: RelayPort = 8020
    memory_mb: int = Field(default=1024, ge=64, le=1_048_576,
                           description="The container's memory limit in MiB, swap included (memswap = memory)")
    pids_limit: int = Field(default=512, ge=16, le=4_194_304,
                            description="The most processes and threads the container may hold at once")
    cpus: float = Field(default=1.0, ge=0.05, le=1024, description="CPU cores' worth of time the container may use")
    tmp_mb: int = Field(default=256, ge=1, le=1_048_576, description="Size of the container's /tmp (a tmpfs) in MiB")
    copy_out_mb: int = Field(default=64, ge=1, le=4096,
                             description="The most of /app or of /logs/<phase> copied back out of the container "
                                         "after a command (a larger tree is not copied, and the run says so)")


SandboxSettings = Annotated[BwrapSandbox | DockerSandbox, Field(discriminator="type")]


class TerminalRewards(BaseModel):
    """Rewards of rollouts that never reached the verifier (the guide's defaults: all 0)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    context_exhausted: float = Field(default=0.0, ge=-100, le=100, description="The harness ran out of context")
    timed_out: float = Field(default=0.0, ge=-100, le=100, description="The harness or the rollout timed out")
    harness_crashed: float = Field(default=0.0, ge=-100, le=100,
                                   description="The harness exited non-zero (or by a signal), or the sandbox failed")


class RolloutSettings(ServiceSettings):
    """``FANROUTE_`` env vars, e.g. ``FANROUTE_GROUP_SIZE=4``, ``FANROUTE_SANDBOX='{"type":"bwrap"}'``."""

    group_id: str = Field(default="rollouts", min_length=1, max_length=128, pattern=r"^[a-z0-9._-]+$",
                          description="Consumer group on tasks (and the adapters group's prefix)")
    relay_url: str = Field(default="http://127.0.0.1:8020", pattern=r"^http://[^\s/]+$", max_length=512,
                           description="The relay (host side; the sandbox reaches it through a forwarded socket)")
    admin_token: SecretStr | None = Field(
        default=None, description="The relay's FANROUTE_ADMIN_TOKEN: mints one-episode credentials and ends episodes")
    model_id: str = Field(default="router", pattern=MODEL_ID_PATTERN,
                          description="The adapter whose Redis stamp a group is stamped with (the relay's "
                                      "FANROUTE_ADAPTER_MODEL_ID); FANROUTE_MODEL in the sandbox")
    group_size: int = Field(default=4, ge=1, le=256, description="Rollouts per task (one group)")
    max_parallel: int = Field(default=8, ge=1, le=4096, description="Sandboxes in flight at once, all groups together")
    max_steps_off_policy: int = Field(default=2, ge=0, le=1000,
                                      description="The trainer's staleness bound (only for the ceiling report)")
    groups_per_batch: int = Field(default=8, ge=1, le=4096,
                                  description="The trainer's groups per step (only for the ceiling report)")
    sandbox_timeout_s: float = Field(default=600.0, gt=0, le=86_400,
                                     description="Budget of one rollout: harness and verifier together")
    command_timeout_s: float = Field(default=300.0, gt=0, le=86_400,
                                     description="Budget of one command in the sandbox (the harness, the verifier)")
    reward: RewardComponent = Field(
        default="ndcg", description="The reward advantages are taken from: ndcg (the verifier's), or ndcg_cost = "
                                    "ndcg − cost_weight · cost per call of the answer's first choice")
    cost_weight: float = Field(default=DEFAULT_COST_WEIGHT, ge=0, le=1e6,
                               description="λ of the ndcg_cost reward, per USD (the gateway's FANROUTE_ROUTING__"
                                           "COST_WEIGHT; set both alike to train for the trade-off it routes by)")
    terminal_rewards: TerminalRewards = Field(default_factory=TerminalRewards,
                                              description="Rewards of rollouts that never reached the verifier")
    output_limit_bytes: int = Field(default=65_536, ge=1024, le=16_777_216,
                                    description="stdout and stderr kept per command (the rest is dropped)")
    credential_ttl_s: float = Field(default=3600.0, gt=0, le=7 * 86_400,
                                    description="Lifetime of a rollout's one-episode credential (revoked at its end)")
    relay_timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Timeout of one admin call to the relay")
    harness: HarnessSettings = Field(default_factory=HarnessSettings, description="What runs in the sandbox")
    sandbox: SandboxSettings = Field(default_factory=BwrapSandbox, description="The sandbox backend")
    work_dir: Path | None = Field(default=None, description="Where sandboxes' directories are made (default: TMPDIR)")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus port (0 = off)")

    @property
    def ceiling(self) -> int:
        """The algorithmic ceiling: rollouts that can usefully be in flight, (max_steps_off_policy + 1) ×
        groups_per_batch × group_size; past it, extra rollouts are too stale for the trainer."""
        return (self.max_steps_off_policy + 1) * self.groups_per_batch * self.group_size

    @model_validator(mode="after")
    def _socket_path_fits(self) -> RolloutSettings:
        """Each rollout's relay socket is ``<work_dir>/fanroute-rollout-XXXXXXXX/run/relay.sock``: refuse a
        work_dir that would put it past the 107 bytes an AF_UNIX path may have (every rollout would fail)."""
        if self.work_dir is not None and len(str(self.work_dir).encode()) > MAX_WORK_DIR_BYTES:
            raise ValueError(f"work_dir {str(self.work_dir)!r} is {len(str(self.work_dir).encode())} bytes: the "
                             f"relay socket under it would pass the AF_UNIX limit (at most {MAX_WORK_DIR_BYTES})")
        return self

    @model_validator(mode="after")
    def _command_fits(self) -> RolloutSettings:
        if self.command_timeout_s > self.sandbox_timeout_s:
            raise ValueError(f"command_timeout_s ({self.command_timeout_s}) is over sandbox_timeout_s "
                             f"({self.sandbox_timeout_s}): one command cannot outlive its rollout")
        return self
