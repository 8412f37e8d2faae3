"""The router harness (router.py): a standalone program the sandbox runs; only its file is used, never imported by services."""
