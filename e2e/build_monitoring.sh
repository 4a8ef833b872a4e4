#!/usr/bin/env bash
# Build the monitoring stack the autoscaling e2e runs, from the Go module proxy at pinned releases, into a
# cache outside the repo: Prometheus (scrapes the pods through Kubernetes service discovery) and KEDA (its
# operator and its metrics API server, external.metrics.k8s.io). Both are Apache-2.0 and run unmodified as
# separate programs; none of their code is in this repository. Idempotent: a component is skipped when its
# marker, written last, is present.
#
#   e2e/build_monitoring.sh             build what is missing (Prometheus ~5 min, KEDA ~15 min on 2 cores)
#   e2e/build_monitoring.sh --background  build what is missing under nohup and nice 19 (`make test` starts it
#                                        first, so it takes the CPU the tests leave idle), logging to
#                                        <cache>/build.log; a later foreground run waits for it on the lock
#   e2e/build_monitoring.sh --print-dir print the cache directory and exit
#
# Prometheus is built with its own build tags for a binary holding only the Kubernetes service discovery
# (`remove_all_sd,enable_kubernetes_sd`, as its Makefile's plugins support); the web UI's assets are not
# embedded (the HTTP API is what is used). KEDA is built from its module's own directory (a copy of the
# module cache's), since its go.mod has replace and exclude directives `go install` refuses; its CRDs are
# copied beside the binaries.
#
# prometheus-adapter is not built: the Go module proxy serves no version of sigs.k8s.io/prometheus-adapter
# (403), so KEDA is the tested autoscaling path.
#
# Environment: LORAPLANE_E2E_CACHE (default ~/.cache/loraplane-e2e), LORAPLANE_PROMETHEUS_VERSION (the Go
# module's version: v0.316.0 is Prometheus 3.16.0), LORAPLANE_KEDA_VERSION, LORAPLANE_E2E_BUILD_JOBS (go build -p).
set -euo pipefail

PROMETHEUS_VERSION="${LORAPLANE_PROMETHEUS_VERSION:-v0.316.0}"
KEDA_VERSION="${LORAPLANE_KEDA_VERSION:-v2.21.0}"
JOBS="${LORAPLANE_E2E_BUILD_JOBS:-2}"
CACHE_ROOT="${LORAPLANE_E2E_CACHE:-$HOME/.cache/loraplane-e2e}"
DIR="$CACHE_ROOT/monitoring"
PROM_DIR="$DIR/prometheus-$PROMETHEUS_VERSION"
KEDA_DIR="$DIR/keda-$KEDA_VERSION"

export GOFLAGS=-mod=mod
export CGO_ENABLED=0

# shellcheck source=e2e/build_common.sh
source "$(dirname "$0")/build_common.sh"

log() { printf '[build_monitoring %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

build_prometheus() {
    [[ -f "$PROM_DIR/.complete" && -x "$PROM_DIR/prometheus" ]] && { log "cached: $PROM_DIR"; return; }
    local src="$PROM_DIR/src" tags=remove_all_sd,enable_kubernetes_sd start=$SECONDS
    mkdir -p "$src"
    local go_directive
    go_directive="$(cd "$src" && GOFLAGS= go mod download -json "github.com/prometheus/prometheus@$PROMETHEUS_VERSION" |
        sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p' | xargs sed -n 's/^go \([0-9.]*\)$/\1/p')"
    printf 'module loraplane.local/e2e/prometheus\n\ngo %s\n\nrequire github.com/prometheus/prometheus %s\n' \
        "$go_directive" "$PROMETHEUS_VERSION" >"$src/go.mod"
    log "resolving github.com/prometheus/prometheus@$PROMETHEUS_VERSION (tags $tags)"
    local total
    total="$(cd "$src" && go list -tags "$tags" -deps github.com/prometheus/prometheus/cmd/prometheus | wc -l)"
    local minor="${PROMETHEUS_VERSION#v0.}" version
    version="3.$((10#${minor%%.*} - 300)).${minor#*.}"  # v0.316.0 -> 3.16.0
    local pkg=github.com/prometheus/common/version
    log "building Prometheus $version ($total packages)"
    (cd "$src" && go build -v -p "$JOBS" -trimpath -tags "$tags" -o "$PROM_DIR/prometheus.tmp" \
        -ldflags="-s -w -X $pkg.Version=$version -X $pkg.Branch=$PROMETHEUS_VERSION -X $pkg.BuildUser=loraplane-e2e" \
        github.com/prometheus/prometheus/cmd/prometheus 2>&1) | progress prometheus "$total" 100
    [[ -x "$PROM_DIR/prometheus.tmp" ]] || { log "Prometheus build failed"; exit 1; }
    mv "$PROM_DIR/prometheus.tmp" "$PROM_DIR/prometheus"
    printf 'prometheus %s (%s) built in %ss\n' "$version" "$PROMETHEUS_VERSION" "$((SECONDS - start))" >"$PROM_DIR/.complete"
    log "Prometheus done in $((SECONDS - start))s"
}

build_keda() {
    [[ -f "$KEDA_DIR/.complete" && -x "$KEDA_DIR/keda" && -x "$KEDA_DIR/keda-adapter" ]] && {
        log "cached: $KEDA_DIR"
        return
    }
    local src="$KEDA_DIR/src" start=$SECONDS module
    log "resolving github.com/kedacore/keda/v2@$KEDA_VERSION"
    module="$(cd /tmp && GOFLAGS= go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" |
        sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p')"
    [[ -d "$module" ]] || { log "no module directory for keda $KEDA_VERSION"; exit 1; }
    rm -rf "$src"
    mkdir -p "$KEDA_DIR"
    cp -r "$module" "$src"
    chmod -R u+w "$src"
    local total
    total="$(cd "$src" && go list -deps ./cmd/operator ./cmd/adapter | wc -l)"
    local ldflags="-s -w -X github.com/kedacore/keda/v2/version.Version=${KEDA_VERSION#v}"
    ldflags+=" -X github.com/kedacore/keda/v2/version.GitCommit=module-proxy"
    log "building KEDA $KEDA_VERSION: operator and metrics API server ($total packages)"
    (cd "$src" && go build -v -p "$JOBS" -trimpath -ldflags="$ldflags" -o "$KEDA_DIR/keda.tmp" ./cmd/operator 2>&1 &&
        go build -v -p "$JOBS" -trimpath -ldflags="$ldflags" -o "$KEDA_DIR/keda-adapter.tmp" ./cmd/adapter 2>&1) |
        progress keda "$total" 100
    [[ -x "$KEDA_DIR/keda.tmp" && -x "$KEDA_DIR/keda-adapter.tmp" ]] || { log "KEDA build failed"; exit 1; }
    mv "$KEDA_DIR/keda.tmp" "$KEDA_DIR/keda"
    mv "$KEDA_DIR/keda-adapter.tmp" "$KEDA_DIR/keda-adapter"
    rm -rf "$KEDA_DIR/crds"
    cp -r "$src/config/crd/bases" "$KEDA_DIR/crds"
    rm -rf "$src"  # the build cache keeps what a rebuild needs
    printf 'keda %s built in %ss\n' "$KEDA_VERSION" "$((SECONDS - start))" >"$KEDA_DIR/.complete"
    log "KEDA done in $((SECONDS - start))s"
}

is_complete() {
    [[ -f "$PROM_DIR/.complete" && -f "$KEDA_DIR/.complete" ]]
}

main() {
    if [[ "${1:-}" == "--print-dir" ]]; then
        echo "$DIR"
        return
    fi
    if [[ "${1:-}" == "--background" ]]; then
        if is_complete; then
            log "cached: $DIR"
            return
        fi
        mkdir -p "$DIR"
        nohup nice -n 19 "$0" >>"$DIR/build.log" 2>&1 &
        log "building in the background at nice 19 (pid $!); log: $DIR/build.log"
        return
    fi
    command -v go >/dev/null || { log "Go is not available"; exit 1; }
    mkdir -p "$DIR"
    take_build_lock "$DIR"
    log "$(go version); cache $DIR; -p $JOBS"
    build_prometheus
    build_keda
}

main "$@"; exit
