#!/usr/bin/env python3
"""The router harness: read the replay task's instruction, ask the policy for the providers' ordering with the
official OpenAI SDK (OPENAI_BASE_URL, OPENAI_API_KEY, FANROUTE_MODEL), write the ordering line where the
task's verifier reads it (the path the instruction names, /app/answer.txt).

Why a standalone file: it runs inside the sandbox, which sees no fanroute code; it needs only the ``openai``
package. It asks with the router prompt every service shares (``services/common/prompt.py``'s system turn
and the query as the user turn; a unit test keeps the copy below equal to it), reads the reply tolerantly
as the router client does (code fences, numbered lines, case), and makes exactly one call (no SDK retries:
a retry re-sends the same history, which the relay would fold as a second segment).

Exit status: 0 answered; FANROUTE_HARNESS_CONTEXT_EXIT (3) the relay refused the prompt as longer than the
model's context; 1 anything else (the error on stderr).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

SYSTEM_TEMPLATE = (
    "You route search queries to search providers. The providers are: {names}.\n"
    "Read the user's query and answer with every provider, best first, in one line: names "
    "separated by ' > ', equally good providers joined by ' = ' (for example: {example}). "
    "Answer with that line only."
)
_QUERY = re.compile(r"^## Query\n\n(`{3,})text\n(.*?)\n\1$", re.DOTALL | re.MULTILINE)
_SECTION = re.compile(r"^## Providers\n(.*?)(?=^## )", re.DOTALL | re.MULTILINE)
_ITEM = re.compile(r"^- (`+)(.+?)\1$")
_ANSWER = re.compile(r"Write your answer to the file `([^`\n]+)`")
_NOISE = re.compile(r"<think>.*?</think>|```[\w-]*", re.DOTALL | re.IGNORECASE)


def system_prompt(providers: list[str]) -> str:
    """The router's system turn (a copy of services.common.prompt.system_prompt)."""
    names = sorted(set(providers))
    example = " > ".join(names[:2]) + (f" = {names[2]}" if len(names) > 2 else "")
    return SYSTEM_TEMPLATE.format(names=", ".join(names), example=example)


def read_instruction(text: str) -> tuple[str, list[str], str]:
    """(query, provider names, answer path) from a replay task's instruction.md; ValueError if it is not one."""
    query, section, answer = _QUERY.search(text), _SECTION.search(text), _ANSWER.search(text)
    if not (query and section and answer):
        raise ValueError("instruction.md is not a fanroute replay task (no query, providers or answer path)")
    names = []
    for line in section.group(1).splitlines():
        if m := _ITEM.match(line.strip()):
            name = m.group(2)
            if len(name) > 2 and name[0] == name[-1] == " " and "`" in (name[1], name[-2]):
                name = name[1:-1]  # the padding a code span around a backtick needs
            names.append(name)
    if not names:
        raise ValueError("instruction.md lists no providers")
    return query.group(2), names, answer.group(1)


def ordering_line(reply: str, providers: list[str]) -> str:
    """The reply as one ``a > b = c`` line over known names (unknown names dropped, repeats kept once);
    the reply's first line as it is when it names no provider (the verifier scores that 0)."""
    canonical = {p.lower(): p for p in providers}
    pattern = re.compile(r"(?<![\w-])(" + "|".join(re.escape(n) for n in sorted(providers, key=len, reverse=True))
                         + r")(?![\w-])", re.IGNORECASE)
    body = _NOISE.sub("\n", reply)
    lines = [ln for ln in body.splitlines() if pattern.search(ln)]
    if not lines:
        return next((ln.strip() for ln in reply.splitlines() if ln.strip()), "")
    counts = [len({m.group(1).lower() for m in pattern.finditer(ln)}) for ln in lines]
    best = max(range(len(lines)), key=lambda i: (counts[i], -i))
    line = lines[best] if counts[best] > 1 else " > ".join(lines)
    tiers: list[list[str]] = []
    seen: set[str] = set()
    prev_end = None
    for m in pattern.finditer(line):
        name = canonical[m.group(1).lower()]
        tie = prev_end is not None and "=" in line[prev_end:m.start()] and ">" not in line[prev_end:m.start()]
        prev_end = m.end()
        if name in seen:
            continue
        seen.add(name)
        if tie and tiers:
            tiers[-1].append(name)
        else:
            tiers.append([name])
    return " > ".join(" = ".join(t) for t in tiers)


def main() -> int:
    import openai

    instruction = Path(os.environ.get("FANROUTE_INSTRUCTION", "/root/instruction.md"))
    context_exit = int(os.environ.get("FANROUTE_HARNESS_CONTEXT_EXIT", "3"))
    query, providers, answer_path = read_instruction(instruction.read_text(encoding="utf-8"))
    client = openai.OpenAI(timeout=float(os.environ.get("FANROUTE_HARNESS_TIMEOUT_S", "60")), max_retries=0)
    messages = [{"role": "system", "content": system_prompt(providers)}, {"role": "user", "content": query}]
    try:
        reply = client.chat.completions.create(
            model=os.environ.get("FANROUTE_MODEL", "policy"), messages=messages,
            max_tokens=int(os.environ.get("FANROUTE_HARNESS_MAX_TOKENS", "48")),
            temperature=float(os.environ.get("FANROUTE_HARNESS_TEMPERATURE", "1.0")))
    except openai.BadRequestError as exc:
        text = str(exc).lower()
        if "context length" in text or "prompt_too_long" in text or "too long" in text:
            print(f"router harness: context exhausted: {exc}", file=sys.stderr)
            return context_exit
        raise
    text = reply.choices[0].message.content or ""
    line = ordering_line(text, providers)
    Path(answer_path).parent.mkdir(parents=True, exist_ok=True)
    Path(answer_path).write_text(line + "\n", encoding="utf-8")
    print(f"router harness: model replied {text!r}; wrote {line!r} to {answer_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
