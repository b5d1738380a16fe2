"""Layer 2: one node's training: the model, its data, DiLoCo, the training run, the ledger."""
