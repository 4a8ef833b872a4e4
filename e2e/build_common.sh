# What the e2e build scripts share (sourced by build_control_plane.sh and build_monitoring.sh; they define log()).

# A line every $3 (default 50) compiled packages of the total $2 ("go build -v" names each one), labelled $1.
progress() {
    local label="$1" total="$2" every="${3:-50}"
    awk -v label="$label" -v total="$total" -v every="$every" '
        { n++; if (n % every == 0) { printf "  %s: %d/%d packages (%s)\n", label, n, total, $0; fflush() } }
        END { printf "  %s: %d packages compiled\n", label, n }'
}

# Hold $1/build.lock (on fd 9) for the rest of the script; a build already running is waited for.
take_build_lock() {
    exec 9>"$1/build.lock"
    if ! flock -n 9; then
        log "another build holds $1/build.lock; waiting for it"
        flock 9
    fi
}
