"""The server's routes, one module per concern; each receives the server's `ServerContext` through
the `Context` dependency (server/context.py) and `build_app` includes them all."""
