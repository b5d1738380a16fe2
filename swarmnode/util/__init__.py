"""Layer 0: what every layer uses: the clock, fault points, metrics, validators, child processes."""
