"""What the network costs, without torch: the models ``slipstream plan``, the probe and ``auto`` share.

- :mod:`.link`: the alpha-beta link model and the ring collectives' bytes per rank.
- :mod:`.lowcomm`: DiLoCo's step model and the one rule for when to recommend it.
"""
