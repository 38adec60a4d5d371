"""Regenerate docs/report_ex1_1.png, the README's picture of `python -m stax report`'s page for
Example 1.1 (needs headless Chromium: `apt install chromium`).

    .venv/bin/python docs/make_screenshot.py
"""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main():
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                    if shutil.which(n)), None)
    if browser is None:
        sys.exit("docs/make_screenshot.py needs headless Chromium (apt install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "ex1_1.html"
        subprocess.run([sys.executable, "-m", "stax", "report", str(ROOT / "examples" / "ex1_1_relu_sum.py"),
                        "-o", str(page)], check=True, cwd=ROOT)
        out = ROOT / "docs" / "report_ex1_1.png"
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1200,1100", f"--screenshot={out}", page.as_uri()],
                       check=True, capture_output=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
