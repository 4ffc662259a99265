"""The install lines users copy: the GPU line keeps the user's torch and names the QLoRA extra; no page names a
package index entry that does not exist. (.ci/run also dry-runs the GPU line: it must change neither trl nor torch.)"""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _line_after(marker: str) -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    return lines[lines.index(f"<!-- {marker} -->") + 1]


def test_the_gpu_install_line_keeps_the_users_torch_and_installs_bitsandbytes():
    line = _line_after("gpu-install-line")
    assert line.startswith("pip install -e ") and "torch" not in line, line
    extras = set(re.search(r"\.\[([\w,-]+)\]", line).group(1).split(","))
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"recipes", "quantization"} <= extras <= set(optional)
    assert any(dep.startswith("bitsandbytes") for dep in optional["quantization"])


def test_the_cpu_lines_pin_the_local_cpu_torch():
    for marker in ("quickstart-line", "test-line"):
        assert _line_after(marker).startswith("pip install torch==2.13.0 "), marker


def test_no_page_installs_trl_ext_from_an_index():
    # trl_ext installs from its clone (`pip install -e ".[extra]"`): no index has a package named trl-ext
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "recipes").rglob("*.md"),
             *(ROOT / "trl_ext").rglob("*.py"), *(ROOT / "recipes").glob("*.py")]
    offenders = [str(p.relative_to(ROOT)) for p in pages if re.search(r"pip install\W+trl-ext", p.read_text())]
    assert offenders == [], offenders
