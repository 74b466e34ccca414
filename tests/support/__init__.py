"""Helpers of the tests (and the benchmarks): tiny random checkpoints, the `transformers` oracles,
in-process and subprocess servers, a Redis server, the shared documents and the engine factory."""
