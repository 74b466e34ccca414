"""Chunk cache: position-independent KV reuse of documents (docs/design.md §2-3).

Bookkeeping over core/ (the sequences, KV blocks and slots it shares with the engine), read in
this order: parse (a prompt's parts) -> matcher (cached spans inside plain prompts) -> pool (the
entries) -> manager (admission, fill jobs, assembly) -> tiers/ (below the pool). The model-side
compute it relies on (blend, sensitivity) is the engine's, beside the runner.
"""
