"""Unit tests: one process, no ranks (``make test-quick``)."""
