#!/usr/bin/env bash
# Makes sure Debian's chromium and chromium-driver are installed: the
# console's browser tests drive a real headless chromium through
# chromedriver (WebDriver). Quick no-op when both are present; installs them
# from the system's packages when missing (needs root). Prints what it did.
set -euo pipefail

say() { printf 'browser: %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    say "chromium and chromedriver already installed ($(chromium --version 2>/dev/null | head -n1))"
    exit 0
fi
command -v apt-get >/dev/null || { say "cannot install chromium: no apt-get (install chromium and chromedriver by hand)" >&2; exit 1; }
say "installing chromium and chromium-driver from the system's packages"
as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium chromium-driver fonts-dejavu-core >/dev/null
say "installed $(chromium --version 2>/dev/null | head -n1); chromedriver at $(command -v chromedriver)"
