#!/usr/bin/env bash
# Installs Debian's Chromium for the report's end-to-end test (tests/test_report.py), which
# renders report.html headless. Safe to rerun: does nothing when Chromium is there.
# Exit status: 0 when /usr/bin/chromium is usable afterwards, 1 when it could not be installed.
set -uo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "setup_test_browser: /usr/bin/chromium missing and not root; install the 'chromium'" \
       "package, or the slow report test will skip" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; } >&2; then
  echo "setup_test_browser: apt-get could not install chromium" >&2
  exit 1
fi
[ -x /usr/bin/chromium ]
