"""The test suite, a package so that its helpers (tests/support) import by name, not by `sys.path`."""
