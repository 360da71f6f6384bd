"""environment.yml (conda) carries exactly requirements.txt's pins and its Python version."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _requirements() -> list[str]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return [s for s in (line.split("#")[0].strip() for line in lines) if s]


def test_environment_yml_pins_equal_requirements():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    deps = env["dependencies"]
    pip = [d["pip"] for d in deps if isinstance(d, dict) and "pip" in d]
    assert len(pip) == 1, "one pip: section"
    assert [str(p).strip() for p in pip[0]] == _requirements()
    assert "pip" in deps
    python = [d for d in deps if isinstance(d, str) and d.startswith("python")]
    want = re.search(r"Python (3\.\d+)", (REPO / "requirements.txt").read_text()).group(1)
    assert python == [f"python={want}"]
    assert env["name"] == "sfl" and env["channels"]


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ ;\[]", spec, maxsplit=1)[0].strip().lower()


def test_notebooks_extra_brings_jupyterlab_and_the_pinned_plotting_stack():
    """`pip install -e .[notebooks]` gives JupyterLab plus what the notebooks import; the packages it shares
    with requirements.txt carry the same specifiers there (seaborn pinned exactly)."""
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["notebooks"]
    by_name = {_name(s): s.replace(" ", "") for s in extra}
    assert "jupyterlab" in by_name
    reqs = {_name(s): s.replace(" ", "") for s in _requirements()}
    for name in ("seaborn", "matplotlib", "pandas", "nbclient", "ipykernel"):
        assert by_name[name] == reqs[name], name
    assert reqs["seaborn"].startswith("seaborn==")
