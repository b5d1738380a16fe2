"""Recovery: restoring a node from its own or its peers' snapshots, from one peer or many."""
