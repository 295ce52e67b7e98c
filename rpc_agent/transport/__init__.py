"""The RPC transport: one gRPC bidirectional stream per worker pair for control frames, and a
raw authenticated data channel per pair for large buffers."""
