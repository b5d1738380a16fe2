"""Stubs for the `swarmnode.v1` protobuf package."""
