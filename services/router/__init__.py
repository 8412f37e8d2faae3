"""Asking the student router for an ordering: the prompt it trained on, a tolerant parser, the slice rule.

A library shared by the gateway's routed mode and ``fanroute eval``; not a service of its own.
"""
