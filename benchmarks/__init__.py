"""The benchmarks, a package so that they import each other and the test references plainly: run them from the
repository root with `python -m benchmarks.<name>` (see the Makefile's `bench` target)."""
