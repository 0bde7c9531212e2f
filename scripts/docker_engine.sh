#!/usr/bin/env bash
# Start (or stop) a Docker engine on this machine, for the container tests and image builds.
#
#   bash scripts/docker_engine.sh start   # dockerd in the background if none answers; waits until it does
#   bash scripts/docker_engine.sh stop    # stops the dockerd this script started (no other)
#
# Needs root and dockerd (Debian: apt-get install docker.io). Under systemd, `systemctl start
# docker` does the same; this is for machines and CI containers without it. Log and pid file in
# ${SLIPSTREAM_DOCKER_DIR:-/tmp/slipstream-docker}.
set -euo pipefail
dir="${SLIPSTREAM_DOCKER_DIR:-/tmp/slipstream-docker}"
WAIT_S=60

case "${1:-}" in
    start)
        if docker info >/dev/null 2>&1; then
            echo "docker_engine: an engine is already running"
            exit 0
        fi
        command -v dockerd >/dev/null 2>&1 || { echo "docker_engine: no dockerd (Debian: apt-get install docker.io)" >&2; exit 2; }
        [ "$(id -u)" = 0 ] || { echo "docker_engine: starting dockerd needs root" >&2; exit 2; }
        mkdir -p "$dir"
        nohup dockerd >"$dir/dockerd.log" 2>&1 &
        echo $! >"$dir/dockerd.pid"
        for _ in $(seq $((WAIT_S * 2))); do
            if docker info >/dev/null 2>&1; then
                echo "docker_engine: dockerd started (pid $(cat "$dir/dockerd.pid"), log $dir/dockerd.log)"
                exit 0
            fi
            kill -0 "$(cat "$dir/dockerd.pid")" 2>/dev/null || break
            sleep 0.5
        done
        echo "docker_engine: dockerd did not answer within ${WAIT_S} s; its log:" >&2
        tail -20 "$dir/dockerd.log" >&2
        exit 1
        ;;
    stop)
        [ -f "$dir/dockerd.pid" ] || exit 0
        pid="$(cat "$dir/dockerd.pid")"
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid"
            for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        fi
        rm -f "$dir/dockerd.pid"
        ;;
    *) echo "usage: bash scripts/docker_engine.sh start|stop" >&2; exit 2 ;;
esac
