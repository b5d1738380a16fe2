"""Layer 5: benchmarks (nothing in the runtime layers imports them)."""
