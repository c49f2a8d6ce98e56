"""Thin Ray actors, one per role. Each holds a backend or an engine behind a small interface."""
