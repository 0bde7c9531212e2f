"""`slipstream run`: a torchrun-compatible launcher on torch's elastic agent."""

from .api import LaunchOptions, launch

__all__ = ["LaunchOptions", "launch"]
