"""Offline evaluation of routers on held-out fan-out traces (``fanroute eval``) and the promotion
rule that acts on it (``fanroute promote``)."""
