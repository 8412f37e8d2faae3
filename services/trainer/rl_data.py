"""RL's data side: the replay task set, its eval split, the feeder that keeps tasks in flight, the staleness
triage of finished groups, and the packing of their datums into per-token arrays.

Why here and not in the runner: the trainer decides what is trained on. It publishes tasks on ``tasks``
(the runner rolls each into a group), takes the first ``groups_per_batch`` groups back from ``rollouts``,
and requeues a group more than ``max_steps_off_policy`` steps behind by publishing its task again, so the
runner re-rolls it under the current adapter. A group is ours when its model id is the run's and its task
was published by this run no later than the group started (older groups on the topic are ignored).
"""

from __future__ import annotations

import hashlib
import math
import random
import tomllib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from schemas.rollout import RolloutGroup
from schemas.task import Task, task_id_of
from services.common.errors import ConfigError
from services.common.splits import normalise_query

EVAL_SALT = "fanroute-rl-eval"


def load_tasks(root: Path, *, contested_only: bool = False, limit: int | None = None) -> list[Task]:
    """The tasks under ``root`` (one directory of files each), sorted by id; each id is checked against its files."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"tasks_dir {root} is not a directory")
    tasks = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        files = {str(f.relative_to(d)): f.read_text() for f in sorted(d.rglob("*")) if f.is_file()}
        if "task.toml" not in files:
            continue
        meta = tomllib.loads(files["task.toml"]).get("metadata", {})
        if contested_only and "contested" not in meta.get("tags", ()):
            continue
        task_id = task_id_of(files)
        if task_id != d.name:
            raise ConfigError(f"task {d}: its files hash to {task_id}, not its directory's name (edited by hand?)")
        tasks.append(Task(task_id=task_id, trace_id=str(meta.get("trace_id") or d.name),
                          created_at=datetime.now(UTC), files=files))
    if limit is not None:
        tasks = tasks[:limit]
    if not tasks:
        raise ConfigError(f"no replay tasks under {root}" + (" tagged contested" if contested_only else ""))
    return tasks


def task_query(task: Task) -> str:
    """The task's query (the fenced block under ``## Query`` of its instruction), normalised for matching."""
    text = task.files.get("instruction.md", "")
    block = text.split("## Query", 1)[-1].split("## Providers", 1)[0].strip().splitlines()
    inner = block[1:-1] if len(block) >= 2 and block[0].startswith(("```", "~~~")) else block
    return normalise_query("\n".join(inner))


def split_tasks(tasks: Sequence[Task], eval_fraction: float) -> tuple[list[Task], list[Task]]:
    """(train, eval): a task is held out when the salted hash of its id falls under ``eval_fraction``."""
    def held(t: Task) -> bool:
        h = int.from_bytes(hashlib.sha256(f"{EVAL_SALT}:{t.task_id}".encode()).digest()[:8], "big")
        return h < eval_fraction * 2**64
    train = [t for t in tasks if not held(t)]
    if not train:
        raise ConfigError(f"eval_fraction {eval_fraction} holds out every one of the {len(tasks)} tasks")
    return train, [t for t in tasks if held(t)]


Triage = Literal["fresh", "stale"]


@dataclass
class Feeder:
    """Which tasks are out with the runner (and since when), in what order the next ones go, and triage."""

    model_id: str
    train: list[Task]
    seed: int = 0
    cursor: int = 0
    out: dict[str, deque[tuple[datetime, str]]] = field(default_factory=dict)  # task id -> (published at, kind)
    by_id: dict[str, Task] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_id = {t.task_id: t for t in self.train}
        self.claimed: set[str] = set()  # group ids already counted

    def next_tasks(self, n: int) -> list[Task]:
        """The next ``n`` training tasks: every epoch the whole set, in a seeded order of its own."""
        picked = []
        for _ in range(n):
            epoch, i = divmod(self.cursor, len(self.train))
            order = list(range(len(self.train)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            picked.append(self.train[order[i]])
            self.cursor += 1
        return picked

    def sent(self, task: Task, kind: str = "train", at: datetime | None = None) -> None:
        """Record that ``task`` went out on ``tasks`` (``kind``: train or eval)."""
        self.by_id.setdefault(task.task_id, task)
        self.out.setdefault(task.task_id, deque()).append((at or datetime.now(UTC), kind))

    @property
    def in_flight(self) -> int:
        return sum(len(q) for q in self.out.values())

    def claim(self, group: RolloutGroup) -> str | None:
        """The kind of the outstanding request this group answers (removing it); ``"duplicate"`` for a
        group id already claimed (the runner re-ran a record it had published: dropped, it answers
        nothing); None: not ours."""
        if group.group_id in self.claimed:
            return "duplicate"
        q = self.out.get(group.task_id)
        if group.model_id != self.model_id or not q:
            return None
        match = next((i for i, (at, _) in enumerate(q) if at <= group.started_at), None)
        if match is None:
            return None
        self.claimed.add(group.group_id)
        _, kind = q[match]
        del q[match]
        if not q:
            del self.out[group.task_id]
        return kind


def steps_behind(group: RolloutGroup, step: int, step_of: dict[int, int]) -> float:
    """How many optimizer steps behind ``step`` the group's adapter version is (inf: a version before the run)."""
    at = step_of.get(group.adapter_version)
    return math.inf if at is None else float(step - at)


def triage(group: RolloutGroup, step: int, step_of: dict[int, int], max_steps_off_policy: int) -> Triage:
    """``fresh`` (train on it) or ``stale`` (requeue it): more than ``max_steps_off_policy`` steps behind."""
    return "stale" if steps_behind(group, step, step_of) > max_steps_off_policy else "fresh"


@dataclass(frozen=True)
class Rows:
    """A batch's datums as rows: token sequences, where the trained part starts, and its per-token arrays."""

    sequences: list[list[int]]
    starts: list[int]
    weights: list[list[float]]
    logprobs: list[list[float]]
    advantages: list[list[float]]
    truncated: int
    dropped: int

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def pack(groups: Sequence[RolloutGroup], max_tokens: int) -> Rows:
    """Every datum of the non-uniform groups as a row: the sequence, from its first sampled token on (the prompt
    before it is context) the weights, sampler logprobs and advantages. Rows longer than ``max_tokens`` are cut
    at the end; a datum with no sampled token left is dropped."""
    seqs, starts, ws, lps, advs, truncated, dropped = [], [], [], [], [], 0, 0
    for g in groups:
        if g.uniform:
            continue
        for ro in g.rollouts:
            for d in ro.datums:
                tokens, lfi = d.tokens(), d.loss_fn_inputs
                first = next((i for i, w in enumerate(lfi.weights) if w == 1.0), None)
                if len(tokens) > max_tokens:
                    tokens, truncated = tokens[:max_tokens], truncated + 1
                if first is None or first + 1 >= len(tokens):
                    dropped += 1
                    continue
                end = len(tokens) - 1  # positions first..end-1 predict tokens first+1..end
                seqs.append(tokens)
                starts.append(first + 1)
                ws.append(list(lfi.weights[first:end]))
                lps.append(list(lfi.logprobs[first:end]))
                advs.append(list(lfi.advantages[first:end]))
    return Rows(seqs, starts, ws, lps, advs, truncated, dropped)


def bucket(n: int, multiple: int, cap: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``, at most ``cap`` (and never below ``n``)."""
    return max(n, min(cap, -(-n // multiple) * multiple))


def reward_stats(groups: Sequence[RolloutGroup], prefix: str = "reward") -> dict[str, float]:
    """Mean, min, quartiles, max and std of the rollouts' rewards, and the share of rewards at 0 and 1."""
    r = sorted(x for g in groups for x in g.rewards_G)
    if not r:
        return {}
    n = len(r)

    def q(p: float) -> float:
        return r[min(n - 1, round(p * (n - 1)))]
    mean = math.fsum(r) / n
    return {f"{prefix}/mean": mean, f"{prefix}/min": r[0], f"{prefix}/p25": q(0.25), f"{prefix}/p50": q(0.5),
            f"{prefix}/p75": q(0.75), f"{prefix}/max": r[-1],
            f"{prefix}/std": math.sqrt(math.fsum((x - mean) ** 2 for x in r) / n),
            f"{prefix}/zero_share": sum(x == 0.0 for x in r) / n, f"{prefix}/one_share": sum(x == 1.0 for x in r) / n,
            f"{prefix}/n": float(n)}
