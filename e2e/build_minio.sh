#!/usr/bin/env bash
# Build the MinIO server (the S3-compatible store the tests run on loopback) from the Go module proxy into
# a cache outside the repo. Idempotent: skipped when the binary is there. About 2-5 minutes on 2 cores.
# MinIO is AGPL-3.0: it is built and run unmodified as a separate test server; none of its code is in
# this repository and nothing here links to it.
#
#   e2e/build_minio.sh              build (once)
#   e2e/build_minio.sh --print-bin  print the binary's path and exit
#
# Environment: LORAPLANE_E2E_CACHE (default ~/.cache/loraplane-e2e), LORAPLANE_MINIO_VERSION.
set -euo pipefail

VERSION="${LORAPLANE_MINIO_VERSION:-v0.0.0-20260212201848-7aac2a2c5b7c}"
CACHE_ROOT="${LORAPLANE_E2E_CACHE:-$HOME/.cache/loraplane-e2e}"
DIR="$CACHE_ROOT/minio/$VERSION"
BIN="$DIR/minio"

if [[ "${1:-}" == "--print-bin" ]]; then
    echo "$BIN"
    exit 0
fi
if [[ -x "$BIN" ]]; then
    exit 0
fi
mkdir -p "$DIR"
echo "[build_minio $(date +%H:%M:%S)] building github.com/minio/minio@$VERSION into $DIR"
# go install writes the binary only when the build succeeded, so a killed build leaves nothing behind
GOBIN="$DIR/.tmp" CGO_ENABLED=0 go install "github.com/minio/minio@$VERSION"
mv "$DIR/.tmp/minio" "$BIN"
rmdir "$DIR/.tmp"
echo "[build_minio $(date +%H:%M:%S)] done: $BIN"
