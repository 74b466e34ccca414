"""Chunk cache: position-independent KV reuse of documents (DESIGN.md §2-3)."""
