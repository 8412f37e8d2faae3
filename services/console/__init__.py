"""The operator console: traces with agree/disagree, runs, evaluations and adapters, in a browser."""
