"""Judge backends: the LLM endpoints (and local models) that grade blind candidates."""
