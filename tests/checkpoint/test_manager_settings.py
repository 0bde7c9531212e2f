"""CheckpointManager's settings are checked once, by CheckpointConfig (issue #44: each setting declared
once, never a copy with bounds of its own). The manager's own copy said ``checkpoint_every_steps must be
>= 1`` where the config says ``... >= 1 or None``, took ``max_failures=1.5``, and named an empty
directory in words of its own."""

from __future__ import annotations

import pytest

from slipstream.checkpoint import CheckpointManager
from slipstream.config import CheckpointConfig
from slipstream.errors import ConfigError

BAD = [
    ("keep_last", 0),
    ("every_steps", 0),
    ("every_s", 0.0),
    ("verify", "crc"),
    ("max_failures", 0),
    ("max_failures", 1.5),
    ("preemption_deadline_s", 0.0),
    ("snapshot_every_steps", 0),
    ("dir", ""),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_argument_is_refused_with_the_config_s_own_message(tmp_path, name, value):
    with pytest.raises(ConfigError) as config_said:
        CheckpointConfig(**{name: value})
    directory = value if name == "dir" else str(tmp_path / "ckpt")
    arguments = {} if name == "dir" else {name: value}
    with pytest.raises(ConfigError) as manager_said:
        CheckpointManager(directory, handle_sigterm=False, **arguments)
    assert str(manager_said.value) == str(config_said.value)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was made


def test_the_manager_reads_its_settings_from_the_checked_config(tmp_path):
    mgr = CheckpointManager(str(tmp_path), every_steps=7, every_s=3.0, keep_last=2, verify="size", max_failures=4,
                            preemption_deadline_s=9.0, handle_sigterm=False)
    try:
        assert mgr.settings == CheckpointConfig(dir=str(tmp_path), every_steps=7, every_s=3.0, keep_last=2,
                                                verify="size", max_failures=4, preemption_deadline_s=9.0)
        assert (mgr.every_steps, mgr.every_s, mgr.keep_last, mgr.verify, mgr.max_failures,
                mgr.preemption_deadline_s) == (7, 3.0, 2, "size", 4, 9.0)
    finally:
        mgr.close()
