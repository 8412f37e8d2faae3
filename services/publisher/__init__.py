"""The adapter publisher: content-addressed adapter files over HTTP, version stamps, ``adapters`` topic."""
