"""Regenerate the README's picture, reports/report-screenshot.png, from the committed
example report's summary through the current report code (never a stale picture):

    .venv/bin/python scripts/report_screenshot.py [SUMMARY_DIR] [PNG]

The report is written to a temporary folder (the committed one stays as it is) and
photographed by headless Chromium (scripts/setup_test_browser.sh installs it), its first
1400 x 1000 pixels: the headline and the first plots."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def main(source: Path, png: Path) -> int:
    from autotune.outputs.report import write_report

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report"
        write_report(source, out)
        profile = Path(tmp) / "profile"
        shot = Path(tmp) / "shot.png"
        run = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--hide-scrollbars", f"--user-data-dir={profile}", "--virtual-time-budget=15000",
             f"--screenshot={shot}", "--window-size=1400,1000",
             (out / "report.html").as_uri()], capture_output=True, text=True, timeout=180)
        if not shot.is_file() or shot.stat().st_size < 20_000:
            print(f"chromium made no picture: {run.stderr[-2000:]}", file=sys.stderr)
            return 1
        shutil.copyfile(shot, png)
    print(f"wrote {png} from {source / 'summary.json'}")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(Path(args[0]) if args else ROOT / "reports" / "tiny-gpt2",
                  Path(args[1]) if len(args) > 1 else ROOT / "reports" / "report-screenshot.png"))
