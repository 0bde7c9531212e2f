"""A worker whose configuration is wrong: raises slipstream.errors.ConfigError.

``scripts_config_error.py [--before-init] [--marker DIR]``: by default after
``slipstream.init()`` (the error then leaves through init's excepthook), with
``--before-init`` before any process group exists (through the worker entry of
``slipstream run``). ``--marker DIR``: each start touches a file there, so a test
can count attempts.
"""

import argparse
import os

import slipstream
from slipstream.errors import ConfigError

parser = argparse.ArgumentParser()
parser.add_argument("--before-init", action="store_true")
parser.add_argument("--marker", default=None)
args = parser.parse_args()
if args.marker:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    open(os.path.join(args.marker, f"start-rank{os.environ.get('RANK', '0')}-attempt{attempt}"), "w").close()
if not args.before_init:
    slipstream.init()
raise ConfigError("checkpoint_dir exists and is not a directory: /no/such/ckpt (on purpose)")
