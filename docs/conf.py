"""Sphinx configuration of the kdn_compile documentation.

Build (warnings are errors): ``./dev.sh docs``, i.e.
``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
The package must be importable (``./dev.sh`` installs it editable).
"""

from __future__ import annotations

import glob
import importlib.metadata
import os

project = "kdn_compile"
author = "kdn_compile contributors"
copyright = "2026, kdn_compile contributors"
try:
    release = importlib.metadata.version("kdn-compile")
except importlib.metadata.PackageNotFoundError:
    release = "0.1.0"

version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
]

# Sources: reStructuredText and markdown (MyST, for the tables of the markdown pages).
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Docstrings are Google style (Args / Returns / Raises / Example).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
# nn.Module.forward's generic docstring says nothing about our layers.
autodoc_inherit_docstrings = False
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": True}

# Cross-references to torch types stay plain text: no intersphinx (the build
# is offline) and no nitpicky mode.
nitpicky = False

html_theme = "alabaster"
html_title = f"kdn_compile {release}"
html_static_path = ["_static"]
# The benchmark plots: kdn-compile bench writes PNGs; copied here, the benchmarks page shows them.
PLOTS = os.path.join(os.path.dirname(__file__), "_static", "bench")
PLOTS_MARKER = "<!-- kdn-bench-plots: filled in at build time from docs/_static/bench/*.png -->"
html_theme_options = {
    "description": "GDN, KDA and Diagonal KDN for torch.compile, Inductor and torch.export",
    "fixed_sidebar": True,
}


def _drop_builtin_type_docstrings(app, what, name, obj, options, lines):
    """Constants documented with ``autodata`` must not inherit ``float.__doc__``."""
    del app, name, options
    builtin_doc = (type(obj).__doc__ or "").strip().splitlines()
    if what == "data" and builtin_doc and lines and lines[0].strip() == builtin_doc[0].strip():
        lines.clear()


def _plots_markdown() -> str:
    """Markdown images of every PNG under ``_static/bench``, or a sentence saying there are none."""
    pngs = sorted(glob.glob(os.path.join(PLOTS, "*.png")))
    if not pngs:
        return ("No plots yet: no GPU run of `kdn-compile bench` has been copied to "
                "`docs/_static/bench/`.")
    return "\n\n".join(f"![{os.path.basename(p)}](_static/bench/{os.path.basename(p)})"
                       for p in pngs)


def _fill_plots(app, docname, source):
    """Replace the benchmarks page's plots marker with the plots found at build time."""
    del app
    if docname == "benchmarks":
        source[0] = source[0].replace(PLOTS_MARKER, _plots_markdown())


def setup(app):
    app.connect("autodoc-process-docstring", _drop_builtin_type_docstrings)
    app.connect("source-read", _fill_plots)
