"""``fanroute import``: conversation logs from other products' exports become redacted episodes."""
