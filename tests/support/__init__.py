"""Helpers shared by the tests (no tests here).

- ``tiny_model``: the tiny random Llama, its tokenizer and LoRA adapters, built offline;
- ``poll``: ``eventually()`` / ``eventually_sync()``, the one way a test waits for a condition;
- ``serving``: ``free_port``, ``served`` (an app in the test's loop) and ``LoopbackServer`` (in a thread);
- ``http_fake``: the scripted HTTP server and its fixtures, the fake OpenAI-compatible router;
- ``records``: builders of citations, candidates, traces, verdicts and episodes;
- ``fakes``: fake providers and a keyword judge backend;
- ``bus``: the in-memory bus with a collector; ``topics``: read a real topic back, wait for records;
- ``processes``: a service in its own process for a block, then crashed or stopped.
"""
