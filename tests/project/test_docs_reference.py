"""The documentation matches the code (issue 48, items 2 and 6): the minimax and DRO objects have reference
pages and tutorials, the refusal of a loss for a minimax algorithm says where a problem comes from, the
landing page is the README itself, the Opacus mapping has its missing rows with code that runs, and the
guide gives large batches and data parallelism their own sections and names its example's extra. The
tutorials themselves run in tests/project/test_docs.py; the strict site build there covers the hook."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpvr

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _hook():
    spec = importlib.util.spec_from_file_location("readme_page", DOCS / "readme_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_problems_and_objectives_have_reference_pages_in_the_navigation() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {"problems": ("MinimaxProblem", "Divergence"), "objectives": ("AUCMargin", "AUCModel", "KL")}
    for page, names in pages.items():
        text = (DOCS / "reference" / f"{page}.md").read_text()
        assert f"reference/{page}.md" in config
        for name in names:
            assert re.search(rf"^::: dpvr\.{page}\.{name}$", text, flags=re.M), (page, name)
    for tutorial in ("minimax", "dro"):
        assert f"tutorials/{tutorial}.md" in config
    choosing = (DOCS / "tutorials" / "choosing.md").read_text()
    assert "reference/problems.md" in choosing and "reference/objectives.md" in choosing


def test_a_loss_given_to_a_minimax_algorithm_is_told_where_problems_come_from() -> None:
    data = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)).float())
    with pytest.raises(TypeError, match=r"dpvr\.objectives.*AUCMargin"):
        dpvr.make_private(nn.Linear(3, 1), nn.BCEWithLogitsLoss(), data, algorithm="dp-sgda", epsilon=1.0,
                          batch_size=4, steps=1, lr=0.1, lr_y=0.1, clip={"x": 1.0, "y": 1.0})


def test_the_landing_page_is_the_readme() -> None:
    hook = _hook()
    assert (DOCS / "index.md").read_text().strip() == hook.MARKER
    assert "docs/readme_page.py" in (ROOT / "mkdocs.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    assert readme.splitlines()[2:6] == ["```bash", *readme.splitlines()[3:5], "```"]  # the set-up first
    page = hook.on_page_markdown(hook.MARKER + "\n", None, {"config_file_path": str(ROOT / "mkdocs.yml")},
                                 None)
    assert page == hook.landing_page(readme) and "](docs/" not in page
    for target in re.findall(r"\]\(([^)#:]+)\)", page):  # every relative link resolves on the site
        assert (DOCS / target).exists(), target


def test_the_opacus_mapping_has_the_missing_rows_each_with_code() -> None:
    text = (DOCS / "tutorials" / "opacus.md").read_text()
    rows = {"BatchMemoryManager": "RuntimeConfig(chunk_size=", "DPDDP": "process_group",
            "DPLSTM": "nn.LSTM"}
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    for opacus, dpvr_side in rows.items():
        assert re.search(rf"^\| `{opacus}.*\| .*{re.escape(dpvr_side)}", text, flags=re.M), opacus
        assert any(f"# {opacus} ->" in block for block in blocks), f"no runnable block for {opacus}"


def test_the_guide_has_its_own_sections_and_names_its_extra() -> None:
    text = (DOCS / "guide.md").read_text()
    assert re.search(r"^## Large batches$", text, flags=re.M)
    assert re.search(r"^## Data-parallel training$", text, flags=re.M)
    first_block = text.index("```python")
    assert "mlxtend" in text[:first_block]
    assert "TokenLoss" in text and "attention_mask" in text
