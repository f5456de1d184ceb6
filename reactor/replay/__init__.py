"""Replay engine: storage, selectors, rate limiters and tables. Usable without the runtime."""
