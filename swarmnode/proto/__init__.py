"""Generated protobuf and gRPC stubs (see protos/generate.py)."""
