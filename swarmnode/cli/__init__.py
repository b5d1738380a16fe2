"""Layer 6: the `swarmnode` command (`main.py`), its printing, the demo."""
