"""Layer 1: the snapshot file format, its reader and writer, and the speculative checkpointer."""
