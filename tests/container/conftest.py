"""The training image, built once per session by ``scripts/build_image.sh --local-base`` and run for real.

The build is the user's one command; it is skipped when the image's revision label is this clean
tree's commit (.ci/run built it just before), and Docker's layer cache makes it about 10 s when an
earlier build had the same layers. A Docker engine is started if none answers
(``scripts/docker_engine.sh start``). Skipped without docker/dockerd or root; under CI=true (.ci/run
installs docker.io and debootstrap and runs as root) they must run.

``SLIPSTREAM_TEST_IMAGE=TAG`` uses an image that is already built instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import need

REPO = Path(__file__).resolve().parents[2]
IMAGE = "slipstream:test"
BUILD_TIMEOUT_S = 1200


def _unavailable() -> str | None:
    missing = [t for t in ("docker", "dockerd", "debootstrap") if shutil.which(t) is None]
    if missing:
        return f"Docker is not installed ({', '.join(missing)} missing; Debian: apt-get install docker.io debootstrap)"
    if os.geteuid() != 0:
        return "needs root (dockerd, debootstrap)"
    return None


def _built_from_this_commit(tag: str) -> bool:
    """Whether ``tag`` carries the revision label scripts/build_image.sh gives a clean tree at HEAD
    (a tree with changes in what goes into the image is always rebuilt)."""
    def out(*argv: str) -> str:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    head = out("git", "rev-parse", "--short=12", "HEAD")
    changed = out("git", "status", "--porcelain", "--", "src", "pyproject.toml", "Dockerfile", "docker", "examples")
    label = out("docker", "image", "inspect", "-f", '{{ index .Config.Labels "org.opencontainers.image.revision" }}',
                tag)
    return bool(head) and not changed and label == head


@pytest.fixture(scope="session")
def docker_image() -> str:
    """The tag of an image built from this tree."""
    if os.environ.get("SLIPSTREAM_TEST_IMAGE"):
        return os.environ["SLIPSTREAM_TEST_IMAGE"]
    why = _unavailable()
    need(why is None, str(why))
    engine = subprocess.run(["bash", str(REPO / "scripts" / "docker_engine.sh"), "start"], capture_output=True,
                            text=True, timeout=120)
    assert engine.returncode == 0, engine.stdout + engine.stderr
    if _built_from_this_commit(IMAGE):  # .ci/run built it a minute ago
        return IMAGE
    build = subprocess.run(["bash", str(REPO / "scripts" / "build_image.sh"), "--local-base", "--tag", IMAGE],
                           capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert build.returncode == 0, (build.stdout + build.stderr)[-4000:]
    assert f"built {IMAGE}" in build.stdout, build.stdout[-2000:]
    return IMAGE
