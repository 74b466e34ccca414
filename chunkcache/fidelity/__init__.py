"""What reuse costs on a given model: the built-in questions, the measurement shared by
`chunkcache calibrate` and benchmarks/bench_fidelity.py, the profile it writes and the gate that
picks a reuse configuration from it when an engine starts (docs/chunk-cache.md, "How sure is
reuse on my model")."""
