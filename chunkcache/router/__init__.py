"""Cache-aware router (docs/design.md §4): KV event intake, a block/chunk index, a scorer and an
OpenAI-compatible proxy. `python -m chunkcache.router` or `chunkcache route` runs it."""
