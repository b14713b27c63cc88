"""Sphinx configuration for numpyro_pc.

Notebooks are not executed here (``make notebooks`` runs them).  At build time
the notebooks in ``../notebooks`` are copied into ``_generated_notebooks/``
(git-ignored): the committed notebook when it carries the outputs of a full run
(``make notebooks-full``; ``make notebooks`` checks that they belong to the current
code cells), else the executed fast copy in ``../notebooks/_executed`` when it is at
least as new as the source, so the rendered pages carry outputs after ``make test``.
"""

from __future__ import annotations

import filecmp
import importlib.metadata
import importlib.util
import json
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
NOTEBOOKS = ROOT / "notebooks"
GENERATED = DOCS / "_generated_notebooks"

# The editable install already puts the repository on sys.path; this only
# helps when building docs from a checkout without installing it.
if importlib.util.find_spec("numpyro_pc") is None:
    sys.path.insert(0, str(ROOT))

# -- project -----------------------------------------------------------------
project = "numpyro_pc"
author = "numpyro_pc developers"
copyright = "numpyro_pc developers"
try:
    release = importlib.metadata.version("numpyro-pc")
except importlib.metadata.PackageNotFoundError:
    release = "dev"
version = release

# -- extensions --------------------------------------------------------------
extensions = [
    "myst_nb",  # also provides the MyST markdown parser
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
exclude_patterns = ["_build", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

nb_execution_mode = "off"
nb_merge_streams = True
# Progress-bar widgets (tqdm.auto) have no static rendering; dropping them is fine.
suppress_warnings = ["mystnb.unknown_mime_type"]

autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": True}
autodoc_typehints = "description"
autodoc_mock_imports = ["flwr"]  # optional extra, not installed by `make venv`

# -- html --------------------------------------------------------------------
html_theme = "furo"
html_title = f"numpyro_pc {release}"
html_static_path: list[str] = []


# -- notebooks ---------------------------------------------------------------
def _heading(cells: list) -> str | None:
    """First markdown heading in a notebook's cells, if any."""
    for cell in cells:
        if cell.get("cell_type") != "markdown":
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else source
        for line in source.splitlines():
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return None


def _notebook_for_docs(src: Path) -> str:
    """The notebook text to render: the committed full run, else the executed copy when it is
    current, with a title cell added when the notebook has no heading (Sphinx needs page titles)."""
    executed = NOTEBOOKS / "_executed" / src.name
    full_run = json.loads(src.read_text(encoding="utf-8")).get("metadata", {}).get("numpyro_pc", {}).get("mode")
    fresh = executed.exists() and executed.stat().st_mtime >= src.stat().st_mtime
    use = src if full_run == "full" or not fresh else executed
    text = use.read_text(encoding="utf-8")
    nb = json.loads(text)
    if _heading(nb.get("cells", [])) is None:
        title = src.stem.replace("_", " ").strip().capitalize()
        cell = {"cell_type": "markdown", "metadata": {}, "source": [f"# {title}"]}
        if (nb.get("nbformat", 4), nb.get("nbformat_minor", 0)) >= (4, 5):
            cell["id"] = "numpyro-pc-docs-title"  # cell ids are required from 4.5 on
        nb.setdefault("cells", []).insert(0, cell)
        text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    return text


def _write_if_changed(path: Path, text: str) -> None:
    # Unchanged files keep their mtime, so incremental builds stay incremental.
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def _sync_notebooks() -> None:
    GENERATED.mkdir(exist_ok=True)
    have_dir = NOTEBOOKS.is_dir()
    sources = sorted(NOTEBOOKS.glob("*.ipynb")) if have_dir else []
    wanted = {"index.md"}
    for src in sources:
        _write_if_changed(GENERATED / src.name, _notebook_for_docs(src))
        wanted.add(src.name)
    for pattern in ("*.png", "*.svg", "*.jpg", "*.gif"):  # images linked from markdown cells
        for img in NOTEBOOKS.glob(pattern) if have_dir else []:
            if not (GENERATED / img.name).exists() or not filecmp.cmp(img, GENERATED / img.name, shallow=False):
                shutil.copyfile(img, GENERATED / img.name)
            wanted.add(img.name)
    for stale in GENERATED.iterdir():
        if stale.name not in wanted:
            stale.unlink() if stale.is_file() else shutil.rmtree(stale)

    lines = ["# Examples", ""]
    if sources:
        lines += [
            "Notebooks from the repository's `notebooks/` folder, rendered with the",
            "outputs of their last `make notebooks` run.",
            "",
            "```{toctree}",
            ":maxdepth: 1",
            "",
            *(src.stem for src in sources),
            "```",
        ]
    else:
        lines.append("No example notebooks yet.")
    _write_if_changed(GENERATED / "index.md", "\n".join(lines) + "\n")


_sync_notebooks()
