"""A judged trace as a content-addressed replay task in Harbor's task format.

Layout (Harbor: ``task.toml``, ``instruction.md``, ``environment/``, ``tests/test.sh``): the agent
reads the query in ``instruction.md`` and writes the providers' ordering to ``/app/answer.txt``;
``tests/score.py`` scores it with tie-aware nDCG against the judge's grades and writes
``/logs/verifier/reward.txt``. ``tests/`` reaches the container only at verification time, so the
grades and the recorded candidates stay hidden from the agent.
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

import services.common.ndcg as ndcg_module
from schemas.task import Task, task_id_of
from schemas.trace import Trace
from schemas.verdict import Verdict
from services.common.ndcg import format_ordering

ANSWER_PATH = "/app/answer.txt"
TEST_SCRIPT = "tests/test.sh"
VERIFIER_TIMEOUT_SEC = 60.0
AGENT_TIMEOUT_SEC = 300.0

DOCKERFILE = """\
# Harness image for a fanroute replay task: the agent only writes /app/answer.txt.
FROM python:3.11-slim
WORKDIR /app
"""

TEST_SH = """\
#!/bin/bash
# Harbor verifier: score /app/answer.txt; score.py writes /logs/verifier/reward.txt.
mkdir -p /logs/verifier
exec python3 /tests/score.py
"""

SCORE_PY = '''\
#!/usr/bin/env python3
"""Score /app/answer.txt by tie-aware nDCG against the judge's grades; write the reward.

Writes exactly one reward file, /logs/verifier/reward.txt. A missing, empty or malformed answer
scores 0.0 and says why on stderr. A broken fixture is the task's fault, not the answer's: the
script then raises (traceback, non-zero exit) and writes no reward.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ndcg import parse_ordering, tie_aware_ndcg  # noqa: E402  (fanroute's module, copied verbatim)

ANSWER = Path("/app/answer.txt")
REWARD = Path("/logs/verifier/reward.txt")
FIXTURE = HERE / "fixtures" / "grades.json"
MAX_ANSWER_BYTES = 65536


class FixtureError(Exception):
    """The task's own grades fixture is unusable."""


def _is_grade(value):
    """A number from 0 to 3 (JSON booleans and NaN are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 3


def load_fixture(path):
    """(provider names, grades) from the fixture; FixtureError when it is broken."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FixtureError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise FixtureError(f"{path}: expected a JSON object")
    providers, grades = data.get("providers"), data.get("grades")
    if not isinstance(providers, list) or not providers or not all(
            isinstance(p, str) and p for p in providers):
        raise FixtureError(f"{path}: 'providers' must be a non-empty list of names")
    if not isinstance(grades, dict) or not grades:
        raise FixtureError(f"{path}: 'grades' must be a non-empty object")
    for name, grade in grades.items():
        if name not in providers or not _is_grade(grade):
            raise FixtureError(f"{path}: bad grade {grade!r} for provider {name!r}")
    if not any(grade > 0 for grade in grades.values()):
        raise FixtureError(f"{path}: no provider has a positive grade")
    return providers, {name: float(grade) for name, grade in grades.items()}


def read_answer(path):
    """The answer's one line; ValueError saying why when it is missing, empty or not one line."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_ANSWER_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"no answer: {path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if len(raw) > MAX_ANSWER_BYTES:
        raise ValueError(f"answer is longer than {MAX_ANSWER_BYTES} bytes")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"answer is not UTF-8 text ({exc})") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"answer is empty: {path}")
    if len(lines) > 1:
        raise ValueError(f"answer must be one line, got {len(lines)} non-empty lines")
    return lines[0]


def score(answer_path, providers, grades):
    """(reward, reason): the answer's nDCG, or 0.0 and why the answer could not be scored."""
    try:
        tiers = parse_ordering(read_answer(answer_path), providers)
    except ValueError as exc:
        return 0.0, str(exc)
    return round(tie_aware_ndcg(tiers, grades), 6), ""


def main():
    """Score the answer and write the reward; a broken fixture raises before any reward is written."""
    providers, grades = load_fixture(FIXTURE)
    reward, reason = score(ANSWER, providers, grades)
    if reason:
        print(f"score.py: reward 0.0: {reason}", file=sys.stderr)
    REWARD.parent.mkdir(parents=True, exist_ok=True)
    REWARD.write_text(f"{reward}\\n", encoding="utf-8")
    print(f"score.py: reward {reward}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

INSTRUCTION = """\
# Route a search query

You are a search router. Several search providers can answer the query below. Decide, from the
query alone, which providers would answer it best.

## Query

{query_block}

## Providers

{provider_list}

## Answer

Write your answer to the file `{answer_path}`: a single line that ranks every provider listed
above, best first.

- Separate providers with ` > ` (the provider on the left is better).
- Join providers you consider equally good with ` = `.
- Write each name exactly as listed above, and name each provider once.

Format example (not a hint): `{example}`

The file must contain that one line and nothing else. A missing, empty or malformed answer (an
unknown or repeated name, an empty tier) scores 0; a provider you leave out counts as ranked last.
"""


def _fence(text: str, char: str = "`", minimum: int = 3) -> str:
    """A run of ``char`` longer than any run inside ``text``, so ``text`` can be quoted verbatim."""
    longest = max((len(run) for run in re.findall(f"{re.escape(char)}+", text)), default=0)
    return char * max(minimum, longest + 1)


def _code_span(name: str) -> str:
    """``name`` as a Markdown code span, whatever backticks it holds."""
    tick = _fence(name, minimum=1)
    pad = " " if name.startswith("`") or name.endswith("`") else ""
    return f"{tick}{pad}{name}{pad}{tick}"


def instruction(query: str, providers: Sequence[str]) -> str:
    """The agent's instruction: the query, the provider names, where and how to answer."""
    fence = _fence(query)
    names = sorted(providers)
    return INSTRUCTION.format(
        query_block=f"{fence}text\n{query}\n{fence}",
        provider_list="\n".join(f"- {_code_span(n)}" for n in names),
        answer_path=ANSWER_PATH,
        example=format_ordering([names[:1], names[1:]]))


def _toml_str(value: str) -> str:
    """A TOML basic string (JSON escapes are TOML escapes, minus raw DEL)."""
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def task_toml(trace: Trace, verdict: Verdict) -> str:
    """Harbor's ``task.toml``: format version, metadata (tags carry ``sampled_because``), timeouts."""
    tags = ", ".join(_toml_str(t) for t in ("fanroute", "replay", "routing", verdict.sampled_because))
    return "\n".join([
        'version = "1.0"',
        "",
        "[metadata]",
        'author_name = "fanroute episode builder"',
        'difficulty = "unknown"',
        'category = "search-routing"',
        f"tags = [{tags}]",
        f"trace_id = {_toml_str(trace.trace_id)}",
        f"verdict_id = {_toml_str(verdict.verdict_id)}",
        f"judge_model = {_toml_str(verdict.judge_model)}",
        f"rubric_hash = {_toml_str(verdict.rubric_hash)}",
        "",
        "[verifier]",
        f"timeout_sec = {VERIFIER_TIMEOUT_SEC}",
        "",
        "[agent]",
        f"timeout_sec = {AGENT_TIMEOUT_SEC}",
        "",
        "[environment]",
        "build_timeout_sec = 600.0",
        "cpus = 1",
        "memory_mb = 1024",
        "storage_mb = 2048",
        "",
    ])


def _json_text(obj: Any) -> str:
    """Stable, readable JSON for a fixture file."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def grades_fixture(trace: Trace, verdict: Verdict) -> dict[str, Any]:
    """What ``score.py`` scores against: provider names, the judge's grades and ordering, provenance."""
    return {
        "providers": sorted(c.provider for c in trace.candidates),
        "grades": {g.provider: g.grade for g in verdict.grades},
        "ordering": format_ordering(verdict.ordering),
        "trace_id": trace.trace_id,
        "verdict_id": verdict.verdict_id,
        "judge_model": verdict.judge_model,
        "rubric_version": verdict.rubric_version,
        "rubric_hash": verdict.rubric_hash,
    }


def _check_inputs(trace: Trace, verdict: Verdict) -> None:
    """Refuse a pair that cannot make a scorable task, naming the reason."""
    if verdict.trace_id != trace.trace_id:
        raise ValueError(f"verdict {verdict.verdict_id} is for trace {verdict.trace_id}, "
                         f"not {trace.trace_id}")
    if verdict.status != "ok" or not verdict.ordering or not verdict.grades:
        raise ValueError(f"verdict {verdict.verdict_id} has no grades/ordering (status {verdict.status})")
    names = {c.provider for c in trace.candidates}
    for name in names:
        if name != name.strip() or re.search(r"[>=\n\r]", name):
            raise ValueError(f"provider name {name!r} cannot be written in the ordering format")
    judged = {g.provider for g in verdict.grades} | {n for tier in verdict.ordering for n in tier}
    if not judged <= names:
        raise ValueError(f"verdict {verdict.verdict_id} names providers not in the trace: "
                         f"{sorted(judged - names)}")
    if not any(g.grade > 0 for g in verdict.grades):
        raise ValueError(f"verdict {verdict.verdict_id}: no provider has a positive grade, "
                         "so every answer would score 0")


def task_files(trace: Trace, verdict: Verdict) -> dict[str, str]:
    """Every file of the task, keyed by relative path (sorted)."""
    _check_inputs(trace, verdict)
    files = {
        "task.toml": task_toml(trace, verdict),
        "instruction.md": instruction(trace.query, [c.provider for c in trace.candidates]),
        "environment/Dockerfile": DOCKERFILE,
        TEST_SCRIPT: TEST_SH,
        "tests/score.py": SCORE_PY,
        # Read at build time, so the task always carries the module the episodes were scored with.
        "tests/ndcg.py": Path(ndcg_module.__file__).read_text(encoding="utf-8"),
        "tests/fixtures/grades.json": _json_text(grades_fixture(trace, verdict)),
        "tests/fixtures/candidates.json": _json_text(
            [c.model_dump(mode="json") for c in trace.candidates]),
    }
    return dict(sorted(files.items()))


def build_task(trace: Trace, verdict: Verdict, *, now: datetime | None = None) -> Task:
    """The replay task of ``trace`` graded by ``verdict``; ``created_at`` stays out of the id."""
    files = task_files(trace, verdict)
    return Task(task_id=task_id_of(files), trace_id=trace.trace_id,
                created_at=now or datetime.now(UTC), files=files)


def _safe_relative(path: str) -> PurePosixPath:
    """``path`` as a relative path inside the task directory, or ValueError."""
    rel = PurePosixPath(path)
    if rel.is_absolute() or not rel.parts or ".." in rel.parts:
        raise ValueError(f"task file path {path!r} escapes the task directory")
    return rel


def write_task(task: Task, root: Path | str) -> Path:
    """Write ``task``'s files under ``root/<task_id>/`` (test.sh executable); return that directory."""
    if task.task_id != task_id_of(task.files):
        raise ValueError(f"task {task.task_id}: id does not match its files (hash {task_id_of(task.files)})")
    task_dir = Path(root) / task.task_id
    for path, text in sorted(task.files.items()):
        target = task_dir / _safe_relative(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text.encode("utf-8"))
        if path == TEST_SCRIPT:
            target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return task_dir
