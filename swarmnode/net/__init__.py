"""Layer 2: talking to peers: identity, security, gRPC snapshot service, the signed Kademlia DHT."""
