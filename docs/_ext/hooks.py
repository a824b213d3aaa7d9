"""MkDocs hooks (mkdocs.yml, ``hooks:``): the teaching notebooks as pages of the site.

The notebooks live in ``notebooks/`` at the repository's root, where JupyterLab and
the tests open them; this adds each one to the site's files as
``notebooks/<name>.ipynb`` before mkdocs-jupyter turns notebooks into pages, so
neither a copy nor a symlink is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


@event_priority(100)  # before mkdocs-jupyter's on_files, which makes pages of .ipynb files
def on_files(files: Files, config: Any) -> Files:
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(
            File(
                f"notebooks/{path.name}",
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
