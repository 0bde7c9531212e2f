"""Tooling for the project itself (not for training runs): the generated docs reference.

Tooling layer (docs/architecture.md): may import the core, never imported by it.
"""
