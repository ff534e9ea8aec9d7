#!/usr/bin/env bash
# Chromium for tests/test_metrics_browser.py, which opens the HTML metrics report in a real
# headless browser. Idempotent: nothing to do when `chromium` is on PATH; otherwise Debian's
# package through apt-get (as root, or with sudo), with a font so the plots' text renders.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
fail() {
    echo "install-browser.sh: $1; install Debian's chromium package yourself, or set" \
        "ORCHESTRATOR_SKIP_BROWSER_TESTS=1 to skip the browser tests" >&2
    exit 1
}
command -v apt-get >/dev/null 2>&1 || fail "chromium is missing and there is no apt-get here"
if [ "$(id -u)" -eq 0 ]; then
    as_root=""
elif command -v sudo >/dev/null 2>&1; then
    as_root="sudo"
else
    fail "chromium is missing and installing it needs root (not root, and no sudo)"
fi

install() {
    $as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq chromium fonts-liberation >/dev/null
}
# The package lists are fetched only when the install cannot do without them.
if ! install 2>/dev/null; then
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    install
fi
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || fail "chromium is still missing"
