"""`pie bench` and its suites: benchmarks that print numbers (see docs/benchmarks.md)."""
