"""Helpers shared by the tests (no tests here): the tiny model, polling, serving apps, records and fakes."""
