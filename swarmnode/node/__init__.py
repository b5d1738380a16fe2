"""Layer 4: the daemon: its configuration, its services, its progress, its round loop."""
