"""The conformance matrix of issue #32: every accepted configuration trains or is refused up front."""
