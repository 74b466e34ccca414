"""What the engine and the chunk cache share, below both: a request's state (`Sequence`, its kind
and its typed plan), the paged KV blocks with their prefix cache, and the KV-slot helpers that
read and write token slots of the KV tensors. Nothing here imports chunk/ or engine/ at run time
(tests/test_layers.py)."""
