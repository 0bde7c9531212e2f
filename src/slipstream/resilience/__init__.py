"""Staying up through failures: healing in place and what it stands on.

- :mod:`.heal`: when a rank dies, the others keep their processes and re-form the group
  (the generation protocol on the launcher's store).
- :mod:`.heal_env`: healing's environment names (torch-free: the supervisor reads them).
- :mod:`.snapshot_dirs`: where in-memory snapshots live, and their sweep (torch-free).
- :mod:`.pids`: whether a process is alive (the launcher, the checkpoint lease, the data cache).

Nothing is imported here: the supervisor and the launcher take the torch-free modules alone.
Failure *detection* (heartbeats, hang diagnosis, the flight recorder) is :mod:`slipstream.fault`.
"""
