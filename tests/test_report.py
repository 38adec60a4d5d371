"""`python -m stax report` and `stax.explain`: the page for every example, checked structurally,
the lines of each kernel tied to their graph nodes, the roofline's points, the progress line, and
the page rendered by headless Chromium without script errors."""
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stax
from stax import report, report_html, triton_heuristics

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def sections(page: str) -> list:
    return page.split('<section class="artifact">')[1:]


def check_page(page: str):
    """One fusion SVG per artifact; every kernel of a picture has its source (or is a fallback);
    every roofline point names a kernel of the page."""
    assert page.startswith("<!DOCTYPE html>") and "</html>" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", ""), "the page must not load anything"
    assert "<script src" not in page
    arts = sections(page)
    assert arts, "no artifact"
    names = set()
    for sec in arts:
        sec = sec.split("</section>")[0]
        assert sec.count('class="fusion"') == 1
        boxes = re.findall(r'<g class="kernel [a-z]+" data-kernel="([^"]+)"', sec)
        assert boxes
        for k in boxes:
            assert f'id="k-{k}"' in sec or k.startswith("fallback"), k
        names |= set(boxes)
    points = re.findall(r'<circle [^>]*class="point" data-kernel="([^"]+)"', page)
    assert set(points) <= names
    return names, points


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_report_of_each_example(example, tmp_path):
    out = tmp_path / "page.html"
    r = subprocess.run([sys.executable, "-m", "stax", "report", str(example), "-o", str(out)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    names, points = check_page(out.read_text())
    assert points, "the roofline has no point"
    assert "wrote" in r.stderr


def relu_sum(x, y):
    return (stax.relu(x + y) * 2).sum(-1)


def test_explain_matches_generate_and_ties_lines_to_nodes():
    x, y = stax.randn(33, 70), stax.randn(33, 70)
    e = stax.explain(relu_sum, x, y)
    gen = stax.generate(relu_sum, x, y)
    (art,) = e.functions[0].artifacts
    assert [k.name for k in art.kernels] == list(gen.kernels)
    (k,) = art.kernels
    assert k.nodes == ["add", "relu", "mul", "sum"] and k.kind == "reduction"
    tagged = {}
    for line, node in zip(k.source.splitlines(), k.origins):
        if node:
            tagged.setdefault(node, []).append(line)
    assert set(tagged) >= {"add", "relu", "mul"}
    assert all("tmp" in ln for lines in tagged.values() for ln in lines)
    assert any("+" in ln for ln in tagged["add"]) and any("relu" in ln for ln in tagged["relu"])
    assert any("*" in ln for ln in tagged["mul"]) and not any("acc" in ln for ln in tagged["mul"])
    assert art.bound == art.moved == (2 * 33 * 70 + 33) * 4
    assert k.seconds is not None and k.seconds > 0 and k.ops > 0
    html = e._repr_html_()
    assert html.count('class="fusion"') == 1 and 'class="roofline"' in html
    assert [p["kernel"] for p in e.roofline_points()] == [k.name for k in art.kernels]


def test_explain_shows_recompiles_and_guards_of_each_artifact():
    f = stax.compile(relu_sum, dynamic=False)
    e1 = stax.explain(f, stax.randn(4, 8), stax.randn(4, 8), timing=False)
    assert e1.roofs is None and "specialized on" in e1.functions[0].artifacts[0].guards[0]
    page = e1.to_html()
    check_page(page)


def test_explain_says_what_cuda_graphs_did():
    f = stax.compile(relu_sum, mode="reduce-overhead")
    e = stax.explain(f, stax.randn(4, 8), stax.randn(4, 8), timing=False)
    (art,) = e.functions[0].artifacts
    assert art.cudagraphs and "CPU" in art.cudagraphs[0]
    assert "CUDA graphs (§9.9)" in e.to_html()


def test_explain_of_a_fallback_and_a_split_reduction():
    a, b = stax.randn(16, 24), stax.randn(24, 8)
    e = stax.explain(lambda a, b: stax.relu(a @ b), a, b)
    kinds = [k.kind for k in e.functions[0].artifacts[0].kernels]
    assert kinds[0] == "fallback" and e.functions[0].artifacts[0].kernels[0].ops == 2 * 16 * 24 * 8
    big = stax.randn(1 << 20)
    e2 = stax.explain(lambda t: t.sum(), big, timing=False)
    ks = e2.functions[0].artifacts[0].kernels
    if len(ks) == 2:                                  # Alg. 6.1 split on this machine's cores
        assert ks[1].kind.startswith("split reduction")


def test_roofline_drawing_handles_points_at_the_edges():
    roofs = report.Roofs(10e9, 100e9, "test")
    svg = report_html.roofline_svg([{"kernel": "k", "intensity": 1e-4, "throughput": 1.0},
                                    {"kernel": "m", "intensity": 1e4, "throughput": 1e11}], roofs)
    assert svg.count("<circle") == 2 and "nan" not in svg


def test_progress_line_only_on_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.delenv("STAX_LOGS", raising=False)
    tty, pipe = Tty(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", tty)
    triton_heuristics._progress("stax autotune k: candidate 2/5", [0.5, float("inf")])
    monkeypatch.setattr(sys, "stderr", pipe)
    triton_heuristics._progress("stax autotune k: candidate 2/5", [0.5])
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    assert "candidate 2/5, best so far 0.5000 ms" in tty.getvalue()
    assert pipe.getvalue() == ""


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


def screenshot(page: Path, png: Path) -> str:
    """Render `page` in headless Chromium; returns its console log (script errors show there)."""
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                        "--v=0", "--window-size=1400,1600", f"--screenshot={png}", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    return r.stdout + r.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt install chromium; "
                                             ".ci/run installs it)")
def test_page_renders_in_headless_chromium_without_script_errors(tmp_path):
    x, y = stax.randn(64, 128), stax.randn(64, 128)
    page = tmp_path / "page.html"
    page.write_text(stax.explain(relu_sum, x, y).to_html())
    log = screenshot(page, tmp_path / "page.png")
    assert (tmp_path / "page.png").stat().st_size > 10_000, log
    assert "Uncaught" not in log, log
    broken = tmp_path / "broken.html"                # the check itself can fail
    broken.write_text(page.read_text().replace("document.addEventListener", "document.noSuchFunction"))
    assert "Uncaught" in screenshot(broken, tmp_path / "broken.png")


def test_no_report_for_a_missing_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "stax", "report", str(tmp_path / "nope.py")],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and "no such file" in r.stderr
    assert np.isfinite(1.0)
