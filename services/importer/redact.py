"""Redaction before anything leaves the machine: named regexes, each match becomes ``[REDACTED:<name>]``.

A rule whose regex has a group named ``secret`` replaces only that group (``Bearer [REDACTED:api_key]``).
User rules run first, then the chosen presets in a fixed order (email, api_key, credit_card, ipv4,
phone) so that a broad rule never eats part of a narrower one.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from services.common.errors import ConfigError
from services.importer.formats import Conversation


@dataclass(frozen=True)
class Rule:
    """One named pattern; ``check`` (optional) vetoes a match, e.g. a Luhn test for card numbers."""

    name: str
    pattern: re.Pattern[str]
    check: Callable[[str], bool] | None = None


def _luhn(text: str) -> bool:
    digits = [int(c) for c in text if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = sum(d if i % 2 == 0 else (d * 2 - 9 if d > 4 else d * 2) for i, d in enumerate(reversed(digits)))
    return total % 10 == 0


_DATE = re.compile(r"\d{1,4}[./-]\d{1,2}[./-]\d{1,4}")


def _phone_like(text: str) -> bool:
    """7-15 digits; without a '+' or an area code in parentheses, a last group of 4+ and not a date."""
    if not 7 <= sum(c.isdigit() for c in text) <= 15:
        return False
    if text.startswith("+") or "(" in text:
        return True
    return len(re.split(r"[ .-]", text)[-1]) >= 4 and not _DATE.fullmatch(text)


def _mixed(*classes: str) -> Callable[[str], bool]:
    """A check that the match holds a character of each class (random secrets do, words rarely)."""
    return lambda text: all(re.search(c, text) for c in classes)


def _rules(name: str, *specs: str | tuple[str, Callable[[str], bool]]) -> tuple[Rule, ...]:
    return tuple(Rule(name, re.compile(s)) if isinstance(s, str) else Rule(name, re.compile(s[0]), s[1])
                 for s in specs)


PRESETS: dict[str, tuple[Rule, ...]] = {
    "email": _rules("email", r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b"),
    "api_key": _rules(
        "api_key",
        r"\bsk-[A-Za-z0-9_-]{16,}",                                # OpenAI / Anthropic style keys
        r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",                          # AWS access key ids
        r"\b(?:gh[pousr]|github_pat)_[A-Za-z0-9_]{20,}",           # GitHub tokens
        r"\bxox[abprs]-[A-Za-z0-9-]{10,}",                         # Slack tokens
        r"\bAIza[0-9A-Za-z_-]{35}",                                # Google API keys
        r"(?i)\bbearer\s+(?P<secret>[A-Za-z0-9._~+/-]{16,}=*)",    # Authorization: Bearer ...
        r"(?i)\b(?:api[_-]?key|secret|token|password|passwd)\b[\"']?\s*[:=]\s*[\"']?(?P<secret>[^\s\"',;]{8,})",
        (r"(?i)\b[0-9a-f]{32,}\b", _mixed(r"\d", r"[a-fA-F]")),    # long hex secrets
        (r"(?<![\w+/=.:-])[A-Za-z0-9+/_-]{40,}={0,2}(?![\w+/=-])",  # long base64 secrets
         _mixed(r"\d", r"[a-z]", r"[A-Z]")),
    ),
    "credit_card": _rules("credit_card", (r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])", _luhn)),
    "ipv4": _rules("ipv4", r"\b(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\b"),
    "phone": _rules("phone", (r"(?<![\w+])(?:\+\d{7,15}|(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,5}\)[ .-]?)?"
                              r"\d{1,5}(?:[ .-]\d{1,5}){1,4})(?![\w-]|\.\d)", _phone_like)),
}
_NAME = re.compile(r"[A-Za-z][\w.-]*")


def parse_presets(specs: str | Iterable[str]) -> list[str]:
    """Preset names from comma-separated lists (``"email,phone"``, ``"all"``); unknown names raise."""
    names = [n.strip() for s in ([specs] if isinstance(specs, str) else specs) for n in s.split(",") if n.strip()]
    if "all" in names:
        return list(PRESETS)
    unknown = sorted(set(names) - set(PRESETS))
    if unknown:
        raise ConfigError(f"unknown redaction preset(s) {', '.join(unknown)}; "
                          f"choose from {', '.join(PRESETS)} or all")
    return names


def parse_rule(spec: str) -> Rule:
    """A user rule from ``NAME=REGEX``."""
    name, sep, pattern = spec.partition("=")
    if not sep or not _NAME.fullmatch(name) or not pattern:
        raise ConfigError(f"--redact {spec!r}: expected NAME=REGEX (NAME: letters, digits, _ . -)")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"--redact {spec!r}: not a valid regex ({exc})") from exc
    if compiled.fullmatch(""):
        raise ConfigError(f"--redact {spec!r}: the regex matches the empty string")
    return Rule(name, compiled)


@dataclass(frozen=True)
class Redactor:
    """Named rules applied in order to text and to every string inside JSON-like values."""

    rules: tuple[Rule, ...] = ()

    @classmethod
    def build(cls, presets: str | Iterable[str] = (), custom: Iterable[str] = ()) -> Redactor:
        """User rules (``NAME=REGEX``) first, then the named presets in their fixed order."""
        chosen = set(parse_presets(presets))
        return cls(tuple(parse_rule(s) for s in custom)
                   + tuple(r for name, rules in PRESETS.items() if name in chosen for r in rules))

    @property
    def kinds(self) -> list[str]:
        """The replacement names, in the order they apply."""
        return list(dict.fromkeys(r.name for r in self.rules))

    def redact(self, text: str, counts: Counter[str] | None = None) -> str:
        """``text`` with every match replaced; ``counts`` (if given) gains one per replacement."""
        for rule in self.rules:
            text = rule.pattern.sub(lambda m, rule=rule: _replace(rule, m, counts), text)
        return text

    def redact_value(self, value: Any, counts: Counter[str] | None = None) -> Any:
        """``value`` with every string in it (dict keys included) redacted."""
        if isinstance(value, str):
            return self.redact(value, counts)
        if isinstance(value, dict):
            return {self.redact_value(k, counts): self.redact_value(v, counts) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.redact_value(v, counts) for v in value)
        return value


def _replace(rule: Rule, m: re.Match[str], counts: Counter[str] | None) -> str:
    group = "secret" if "secret" in m.re.groupindex and m.group("secret") is not None else 0
    if rule.check and not rule.check(m.group(group)):
        return m.group(0)
    if counts is not None:
        counts[rule.name] += 1
    whole, (start, end) = m.group(0), (i - m.start() for i in m.span(group))
    return f"{whole[:start]}[REDACTED:{rule.name}]{whole[end:]}"


def redact_conversation(conv: Conversation, redactor: Redactor, counts: Counter[str] | None = None) -> Conversation:
    """``conv`` with its message texts and its meta redacted; ``counts`` counts the message texts only
    (what an episode carries). The trace id is an identifier and is kept as it is.
    """
    return replace(conv, messages=[(role, redactor.redact(text, counts)) for role, text in conv.messages],
                   meta=redactor.redact_value(conv.meta))
