"""Code generated from proto/shoal/*.proto by scripts/gen_proto.py; do not edit."""
