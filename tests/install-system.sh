#!/usr/bin/env bash
# What the tests need from the system, from Debian's packages: Chromium (and a font, so plots'
# text renders) for the tests that look at pages in a real browser; podman, runc and a static
# busybox (the tests build their job image from it, offline) for jobs run in containers.
# Idempotent: nothing to do when all are there; otherwise apt-get (as root, or with sudo).
set -euo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium fonts-liberation)
command -v podman >/dev/null 2>&1 || missing+=(podman)
command -v runc >/dev/null 2>&1 || missing+=(runc)
[ -x /bin/busybox ] || missing+=(busybox-static)
command -v docker-registry >/dev/null 2>&1 || missing+=(docker-registry)
command -v htpasswd >/dev/null 2>&1 || missing+=(apache2-utils)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
fail() {
    echo "install-system.sh: $1; install Debian's packages ${missing[*]} yourself, or set" \
        "ORCHESTRATOR_SKIP_BROWSER_TESTS=1 / ORCHESTRATOR_SKIP_CONTAINER_TESTS=1 to skip" \
        "the tests that need them" >&2
    exit 1
}
command -v apt-get >/dev/null 2>&1 || fail "${missing[*]} missing and there is no apt-get here"
if [ "$(id -u)" -eq 0 ]; then
    as_root=""
elif command -v sudo >/dev/null 2>&1; then
    as_root="sudo"
else
    fail "${missing[*]} missing and installing needs root (not root, and no sudo)"
fi

install() {
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}
# The package lists are fetched only when the install cannot do without them.
if ! install 2>/dev/null; then
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    install
fi
for tool in chromium podman runc; do
    command -v "$tool" >/dev/null 2>&1 || fail "$tool is still missing"
done
