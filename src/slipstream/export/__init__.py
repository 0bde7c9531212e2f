"""``slipstream export``: the command line over :mod:`slipstream.checkpoint.export` (tooling).

The command lives in its own light package so that ``slipstream --help``, which
registers every command, does not import torch through ``slipstream.checkpoint``.
"""
