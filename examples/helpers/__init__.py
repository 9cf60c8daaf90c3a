"""Programs and modules that only serve the examples in examples/ (none is an example itself)."""
