"""Persistence: the checkpoint format, each buffer's checkpoint adapter, metadata files."""
