"""A training process: its start-up, its devices, its clocks, its signals and its exit.

- :mod:`.runtime`: ``slipstream.init()``: who am I (the one launch-environment parser), which
  device, which backend, the process group and its timeouts.
- :mod:`.gpu_binding`: one GPU per rank under NCCL; two ranks on one device refused.
- :mod:`.gloo_interface`: the network interface gloo binds on a host with several.
- :mod:`.gloo_exit`: gloo's worker threads settle before the interpreter tears down.
- :mod:`.timing`: clocks for device work (host or CUDA events) that never stall the device.
- :mod:`.safe_signals`: signal handlers that raise only outside stdlib code holding a lock.

Nothing is imported here: the launcher takes :mod:`.safe_signals` without torch.
"""
