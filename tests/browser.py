"""A report page as a person sees it: headless Chromium lays it out, a probe script reports where each figure sits,
and a screenshot shows whether each figure is drawn there (not blank)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
FIGURE_PROBE = """<script>window.addEventListener('load', () => {
  const figs = [...document.querySelectorAll('img[data-figure]')].map(img => {
    const r = img.getBoundingClientRect();
    return {id: img.dataset.figure, complete: img.complete, naturalWidth: img.naturalWidth,
            naturalHeight: img.naturalHeight, x: r.left + scrollX, y: r.top + scrollY, w: r.width, h: r.height};
  });
  const pre = document.createElement('pre'); pre.id = 'figure-probe';
  pre.textContent = JSON.stringify({height: document.documentElement.scrollHeight, figures: figs});
  document.body.appendChild(pre);
});</script>"""


def figures_on_screen(page: Path, tmp_path: Path) -> tuple[list[dict], np.ndarray]:
    """Each figure's place on PAGE as Chromium lays it out, and a full-height screenshot (RGB pixels)."""
    assert CHROMIUM is not None
    probe_page = tmp_path / "probe.html"
    probe_page.write_text(page.read_text().replace("</body>", FIGURE_PROBE + "</body>"))
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
            "--force-device-scale-factor=1", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--window-size=1200,900", "--virtual-time-budget=5000", "--dump-dom",
                          probe_page.as_uri()], capture_output=True, text=True, timeout=60, check=True).stdout
    found = re.search(r'<pre id="figure-probe">(.*?)</pre>', dom, re.S)
    assert found, "the page's load handler did not run"
    probe = json.loads(found.group(1).replace("&quot;", '"'))
    shot = tmp_path / "shot.png"
    subprocess.run([*base, f"--window-size=1200,{probe['height']}", f"--screenshot={shot}", probe_page.as_uri()],
                   capture_output=True, timeout=60, check=True)
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape[0] == probe["height"]
    return probe["figures"], pixels


def assert_drawn(fig: dict, pixels: np.ndarray) -> None:
    """FIG loaded, has a real size, and its screen region is not blank (ink on over 2% of it, more than 8 colours)."""
    assert fig["complete"] and fig["naturalWidth"] > 100 and fig["naturalHeight"] > 100, fig
    assert fig["w"] > 100 and fig["h"] > 100, fig
    x, y, w, h = (round(fig[k]) for k in ("x", "y", "w", "h"))
    region = pixels[y:y + h, x:x + w]
    assert region.shape[:2] == (h, w), f"{fig['id']} lies outside the screenshot"
    non_white = (region < 240).any(axis=2).mean()
    colours = len(np.unique(region.reshape(-1, 3) // 16, axis=0))
    assert non_white > 0.02 and colours > 8, f"{fig['id']} is blank on screen ({non_white=:.3f}, {colours=})"
