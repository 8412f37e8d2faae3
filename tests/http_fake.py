"""Moved to :mod:`tests.support.http_fake`; this re-export stays only until the modules that another
engineer owns right now (tests/unit/test_judge_http.py, tests/unit/test_web_providers.py) import from
there. Do not add users."""

from tests.support.http_fake import Reply, ScriptedServer, scripted_fixtures, started

__all__ = ["Reply", "ScriptedServer", "scripted_fixtures", "started"]
