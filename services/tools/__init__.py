"""Operator tools behind the ``fanroute`` CLI (traffic replay, trace tailing)."""
