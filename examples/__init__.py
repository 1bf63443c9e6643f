"""Demo models and fleets shipped with lowerflow (used by the README demo, tests and benchmarks)."""
