"""Averaging: matchmaking, the butterfly all-reduce, its trust rules and the robust outer step."""
