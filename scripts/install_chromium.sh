#!/usr/bin/env bash
# Install a headless-capable Chromium (Debian `chromium` package) when no Chromium binary is on PATH.
# Used by the report's browser test (tests/test_report_browser.py); idempotent and quiet.
#   bash scripts/install_chromium.sh
# Needs root (or passwordless sudo) and access to the Debian package mirror; prints the binary it found or installed.
set -euo pipefail

find_chromium() {
  local name
  for name in chromium chromium-browser google-chrome-stable google-chrome; do
    if command -v "$name" >/dev/null 2>&1; then
      command -v "$name"
      return 0
    fi
  done
  return 1
}

if binary="$(find_chromium)"; then
  echo "chromium: $binary"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_chromium.sh: no chromium on PATH and no apt-get; install Chromium by hand" >&2
  exit 1
fi
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo_cmd=(sudo -n)
  else
    echo "install_chromium.sh: installing chromium needs root; run as root or with passwordless sudo" >&2
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! { "${sudo_cmd[@]}" apt-get update -qq && \
       "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends chromium; } >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  echo "install_chromium.sh: apt-get install chromium failed (log above)" >&2
  exit 1
fi
binary="$(find_chromium)" || { echo "install_chromium.sh: chromium installed but not on PATH" >&2; exit 1; }
echo "chromium: $binary ($("$binary" --version 2>/dev/null || echo 'version unknown'))"
