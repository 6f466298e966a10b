"""Helpers shared by model-based tests (pure code: no sockets, no fixtures)."""
