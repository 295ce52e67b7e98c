"""Differentiable ops, one module per family; each op's forward and backward sit together."""
