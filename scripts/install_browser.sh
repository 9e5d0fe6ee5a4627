#!/usr/bin/env bash
# Install the Debian chromium package for the browser test (tests/e2e/test_browser.py).
# Idempotent: returns at once when /usr/bin/chromium is already there. Playwright drives this binary
# through executable_path; Playwright's own browser download is not used.
set -euo pipefail
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
    echo "install_browser: $CHROMIUM already installed"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
        echo "install_browser: need root (or sudo) to apt-get install chromium" >&2; exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
# Another apt may hold the lock for a moment (another developer, unattended upgrades): wait for it.
$SUDO apt-get -o DPkg::Lock::Timeout=120 update -q
$SUDO apt-get -o DPkg::Lock::Timeout=120 install -y -q --no-install-recommends chromium fonts-dejavu-core
"$CHROMIUM" --version
