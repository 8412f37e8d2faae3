"""The gateway: fan every query out to the providers (or route it with the promoted adapter)."""
