"""Chunk cache: position-independent KV reuse of documents (docs/design.md §2-3)."""
