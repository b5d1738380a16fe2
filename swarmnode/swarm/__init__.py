"""Layer 3: training together: announcements, matchmaking, the butterfly all-reduce, recovery."""
