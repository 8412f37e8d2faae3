"""Shared plumbing for every service: bus, settings, errors, logging."""
