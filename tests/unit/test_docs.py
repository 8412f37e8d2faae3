"""The README is a front page, the manual builds, and every command the two name exists.

A command named in a code span or block — ``fanroute ...``, ``python -m ...``, ``python bench/...``,
``make ...`` — must exist: a ``fanroute`` path is walked through the real parser and its ``--help``
must exit 0; a module must import-resolve; a script or make target must be there.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services import cli
from services.common import topology
from services.common.paths import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250


def _code(text: str) -> list[str]:
    """Every fenced block's body and every inline code span of a Markdown page."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```[^\n]*\n.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def _named(pattern: str) -> dict[str, set[str]]:
    """``match -> pages`` for ``pattern`` (one group) over the code of every page."""
    found: dict[str, set[str]] = {}
    for page in PAGES:
        for snippet in _code(page.read_text()):
            for m in re.finditer(pattern, snippet):
                found.setdefault(m.group(1).strip(), set()).add(page.name)
    return found


def _fanroute_commands() -> dict[tuple[str, ...], set[str]]:
    """``fanroute <words>`` → pages; words stop at a flag, a path, an ALL-CAPS placeholder or punctuation."""
    out: dict[tuple[str, ...], set[str]] = {}
    for words, pages in _named(r"(?:^|[\s(;|&$])fanroute((?:[ \t]+[a-z][a-z0-9_-]*)+)").items():
        out.setdefault(tuple(words.split()), set()).update(pages)
    return out


def _resolve(words: tuple[str, ...]) -> tuple[list[str], str | None]:
    """Walk ``words`` through the ``fanroute`` parser: the command path it names, or why it names none."""
    parser, _ = cli._parser()
    path: list[str] = []
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if path and path[0] in cli.SERVICES:
            break  # a service parses its own command line (no subcommands)
        if subs:
            if word not in subs[0].choices:
                return path, f"{word!r} is not a command of `fanroute {' '.join(path)}`".replace("  ", " ")
            parser = subs[0].choices[word]
            path.append(word)
            continue
        positional = [a for a in parser._actions if not a.option_strings and a.choices]
        if positional and word not in positional[0].choices:
            return path, f"{word!r} is not one of {sorted(positional[0].choices)} of `fanroute {' '.join(path)}`"
        break  # an argument (a file name, a recipe), not a command
    return path, None


COMMANDS = _fanroute_commands()


def test_the_readme_is_a_front_page() -> None:
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the manual lives in docs/"
    text = "\n".join(lines)
    assert "make demo" in text and "make test" in text and "fanroute doctor" in text


def test_the_architecture_picture_is_the_registry() -> None:
    assert topology.stale_pages() == [], "run `fanroute topology`"
    block = topology.block()
    from schemas.topics import TOPICS

    for name, spec in TOPICS.items():
        assert f"[({name})]" in block
        for producer in spec.producers:
            assert " CLI" in producer or producer in ("demo", "rl recipes") or f"{producer} --> t_{name}" in block


def test_commands_are_found_at_all() -> None:
    """The extraction itself works (else every check below would pass on nothing)."""
    assert ("demo",) in COMMANDS and ("doctor",) in COMMANDS and len(COMMANDS) >= 20
    assert _resolve(("no-such-command",))[1] is not None
    assert _resolve(("calibrate", "no-such-action"))[1] is not None
    assert _resolve(("models", "prepare")) == (["models", "prepare"], None)


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=" ".join)
def test_every_fanroute_command_named_exists(words: tuple[str, ...], capsys) -> None:
    path, why = _resolve(words)
    assert why is None, f"`fanroute {' '.join(words)}` in {sorted(COMMANDS[words])}: {why}"
    with pytest.raises(SystemExit) as exc:
        cli.main([*path, "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: fanroute")


def test_every_module_script_and_make_target_named_exists() -> None:
    missing = []
    for module, pages in _named(r"python -m ([A-Za-z_][\w.]*)").items():
        if module not in ("pip", "pytest", "venv") and importlib.util.find_spec(module) is None:
            missing.append(f"python -m {module} ({sorted(pages)})")
    for script, pages in _named(r"python (bench/[\w./-]+\.py)").items():
        if not (REPO_ROOT / script).is_file():
            missing.append(f"{script} ({sorted(pages)})")
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO_ROOT / "Makefile").read_text(), re.M))
    for target, pages in _named(r"(?:^|\s)make ([a-z][\w-]*)").items():
        if target not in targets:
            missing.append(f"make {target} ({sorted(pages)})")
    assert not missing, missing


@pytest.mark.slow
def test_the_manual_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link, a missing page in the nav or a bad anchor fails it."""
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    proc = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "architecture" / "index.html").is_file()
    assert 'class="mermaid"' in (tmp_path / "site" / "architecture" / "index.html").read_text()
