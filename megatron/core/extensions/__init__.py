"""Adapters to optional third-party libraries (Transformer Engine)."""
