#!/usr/bin/env bash
# Build etcd, kube-apiserver and kube-controller-manager from the upstream Go modules
# (through the Go module proxy) into a cache outside the repo. Idempotent: skipped when the
# marker file, written last, is present.
#
#   e2e/build_control_plane.sh            build (tens of minutes on 2 cores, then cached)
#   e2e/build_control_plane.sh --resolve  only resolve and download the modules
#   e2e/build_control_plane.sh --background  build under nohup and nice 19, logging to <cache>/<version>/build.log
#                                           (`make test` starts it first: it takes the CPU the unit tests leave
#                                           idle; the e2e fixture's foreground run waits for it on the lock)
#   e2e/build_control_plane.sh --print-bin  print the bin directory and exit
#
# Environment: LORAPLANE_E2E_CACHE (default ~/.cache/loraplane-e2e), LORAPLANE_K8S_VERSION,
# LORAPLANE_ETCD_VERSION, LORAPLANE_E2E_BUILD_JOBS (go build -p, default 2).
set -euo pipefail

K8S_VERSION="${LORAPLANE_K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${LORAPLANE_ETCD_VERSION:-v3.6.8}"
JOBS="${LORAPLANE_E2E_BUILD_JOBS:-2}"
CACHE_ROOT="${LORAPLANE_E2E_CACHE:-$HOME/.cache/loraplane-e2e}"
DIR="$CACHE_ROOT/$K8S_VERSION"
BIN="$DIR/bin"
MARKER="$BIN/.complete"
BINARIES=(etcd kube-apiserver kube-controller-manager)

export GOFLAGS=-mod=mod
export CGO_ENABLED=0

# shellcheck source=e2e/build_common.sh
source "$(dirname "$0")/build_common.sh"

log() { printf '[build_control_plane %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

is_complete() {
    [[ -f "$MARKER" ]] || return 1
    local b
    for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
}

# k8s.io/kubernetes points each staging module at ./staging/src/k8s.io/<name>; as a dependency
# it needs k8s.io/<name> v0.<minor>.<patch> instead.
staging_replaces() {
    local gomod="$1" staging_version="v0${K8S_VERSION#v1}"
    sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/src/k8s\.io/[a-z0-9-]*$#\1#p' "$gomod" |
        while read -r mod; do printf '\t%s => %s %s\n' "$mod" "$mod" "$staging_version"; done
}

setup_k8s_module() {
    local src="$DIR/src/kubernetes"
    mkdir -p "$src"
    log "resolving k8s.io/kubernetes@$K8S_VERSION"
    local upstream_gomod
    upstream_gomod="$(cd "$src" && GOFLAGS= go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
        sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')"
    [[ -f "$upstream_gomod" ]] || { log "no go.mod for k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
    local go_directive
    go_directive="$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$upstream_gomod")"
    {
        printf 'module loraplane.local/e2e/kubernetes\n\ngo %s\n\n' "$go_directive"
        printf 'godebug default=go%s\n\n' "${go_directive%.*}"
        printf 'require k8s.io/kubernetes %s\n\nreplace (\n' "$K8S_VERSION"
        staging_replaces "$upstream_gomod"
        printf ')\n'
    } >"$src/go.mod"
    log "wrote $src/go.mod ($(grep -c '=>' "$src/go.mod") staging replaces)"
    (cd "$src" && go list -deps k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager |
        wc -l >"$src/.num_packages")
    log "k8s module graph resolved: $(cat "$src/.num_packages") packages"
}

setup_etcd_module() {
    local src="$DIR/src/etcd"
    mkdir -p "$src"
    log "resolving go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    printf 'module loraplane.local/e2e/etcd\n\ngo 1.24.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n' \
        "$ETCD_VERSION" >"$src/go.mod"
    (cd "$src" && go list -deps go.etcd.io/etcd/server/v3 | wc -l >"$src/.num_packages")
    log "etcd module graph resolved: $(cat "$src/.num_packages") packages"
}

build_etcd() {
    local src="$DIR/src/etcd"
    log "building etcd $ETCD_VERSION"
    (cd "$src" && go build -v -p "$JOBS" -trimpath -ldflags="-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3 2>&1) |
        progress etcd "$(cat "$src/.num_packages")"
    [[ -x "$BIN/etcd" ]] || { log "etcd build failed"; exit 1; }
}

build_k8s() {
    local src="$DIR/src/kubernetes" minor="${K8S_VERSION#v1.}"
    minor="${minor%%.*}"
    local pkg=k8s.io/component-base/version
    local ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    log "building kube-apiserver and kube-controller-manager $K8S_VERSION"
    (cd "$src" && go build -v -p "$JOBS" -trimpath -ldflags="$ldflags" -o "$BIN/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager 2>&1) |
        progress kubernetes "$(cat "$src/.num_packages")"
    [[ -x "$BIN/kube-apiserver" && -x "$BIN/kube-controller-manager" ]] || { log "kubernetes build failed"; exit 1; }
}

main() {
    if [[ "${1:-}" == "--print-bin" ]]; then
        echo "$BIN"
        return
    fi
    if [[ "${1:-}" == "--background" ]]; then
        mkdir -p "$DIR"
        if is_complete; then
            log "cached: $BIN ($(cat "$MARKER"))"
            return
        fi
        nohup nice -n 19 "$0" >"$DIR/build.log" 2>&1 &
        log "building in the background at nice 19 (pid $!); log: $DIR/build.log"
        return
    fi
    if is_complete; then
        log "cached: $BIN ($(cat "$MARKER"))"
        return
    fi
    command -v go >/dev/null || { log "Go is not available"; exit 1; }
    mkdir -p "$DIR"
    take_build_lock "$DIR"
    if is_complete; then
        log "cached: $BIN ($(cat "$MARKER"))"
        return
    fi
    log "$(go version); cache $DIR; -p $JOBS"
    mkdir -p "$BIN"
    local start=$SECONDS
    setup_etcd_module
    setup_k8s_module
    if [[ "${1:-}" == "--resolve" ]]; then
        log "modules resolved in $((SECONDS - start))s"
        return
    fi
    build_etcd
    build_k8s
    printf 'kubernetes %s etcd %s built in %ss with %s\n' "$K8S_VERSION" "$ETCD_VERSION" \
        "$((SECONDS - start))" "$(go version | cut -d' ' -f3)" >"$MARKER"
    log "done in $((SECONDS - start))s: $BIN"
}

main "$@"; exit
