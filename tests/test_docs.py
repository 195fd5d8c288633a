"""The docs: every ```python block of the guide (docs/guide/*.md) and of README.md runs,
the site builds with ``mkdocs build --strict`` (a broken link fails it), and the README
stays a front door (at most 200 lines).

A page's blocks run in order in one fresh interpreter on 8 forced CPU devices, sharing one
namespace, as a reader following along would. A block preceded by ``<!-- requires: ray -->``
needs that optional module; where it is missing the block is skipped and the test says so.
```bash blocks are not run.
"""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = sorted((ROOT / "docs" / "guide").glob("*.md"))
PAGES = [ROOT / "README.md"] + GUIDE
README_MAX_LINES = 200
# Every page runs in a fresh interpreter (multiprocess, so in the slow tier, conftest.py);
# parameter_servers.md also starts a Ray cluster.
RAY_PAGES = {"parameter_servers.md"}

_BLOCK = re.compile(r"(?:<!--\s*requires:\s*(?P<req>[\w., -]+?)\s*-->\s*\n)?^```python[ \t]*\n(?P<code>.*?)^```[ \t]*$",
                    re.M | re.S)


def python_blocks(text: str) -> list:
    """[(line number, required modules, code)] of every ```python block, in order."""
    out = []
    for m in _BLOCK.finditer(text):
        req = tuple(r.strip() for r in (m.group("req") or "").split(",") if r.strip())
        out.append((text.count("\n", 0, m.start("code")) + 1, req, m.group("code")))
    return out


def page_script(path: Path) -> tuple:
    """The script that runs a page's blocks in order, and the blocks skipped (with why)."""
    parts, skipped = [], []
    for line, req, code in python_blocks(path.read_text()):
        missing = [r for r in req if importlib.util.find_spec(r) is None]
        if missing:
            skipped.append(f"{path.name}:{line} needs {', '.join(missing)} (not installed)")
            continue
        # each block compiled apart, so an error names the page and the block's first line
        parts.append(f"exec(compile({code!r}, {f'{path.name}:{line}'!r}, 'exec'))\n")
    return "".join(parts), skipped


def run_page(path: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    script, skipped = page_script(path)
    for s in skipped:
        print("skipped block:", s)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               SHARDPROP_PROGRESS="0", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)


def _param(p: Path):
    return pytest.param(p, id=p.name, marks=[pytest.mark.ray] if p.name in RAY_PAGES else [])


def test_guide_pages_exist():
    names = {p.name for p in GUIDE}
    for page in ["marks_and_propagation.md", "training.md", "auto.md", "parameter_servers.md", "launching.md",
                 "dumps_and_report.md", "correctness.md"]:
        assert page in names, f"docs/guide/{page} is missing"


@pytest.mark.parametrize("page", [_param(p) for p in PAGES])
@pytest.mark.multiprocess
@pytest.mark.timeout(1020)   # a page's script may take up to 900 s
def test_page_code_blocks_run(page, tmp_path):
    if not python_blocks(page.read_text()):
        pytest.skip(f"{page.name} has no python block")
    r = run_page(page, tmp_path)
    assert r.returncode == 0, f"a python block of {page.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


@pytest.mark.multiprocess
def test_a_broken_block_fails(tmp_path):
    """The runner is not vacuous: a failing block fails its page, and names the block."""
    page = tmp_path / "broken.md"
    page.write_text(textwrap.dedent("""\
        # A page

        ```python
        x = 1
        ```

        text

        ```python
        assert x == 2, "x is still 1"
        ```

        <!-- requires: no_such_module_here -->
        ```python
        raise SystemExit(3)
        ```
        """))
    blocks = python_blocks(page.read_text())
    assert [(b[0], b[1]) for b in blocks] == [(4, ()), (10, ()), (15, ("no_such_module_here",))]
    script, skipped = page_script(page)
    assert skipped == ["broken.md:15 needs no_such_module_here (not installed)"]
    r = run_page(page, tmp_path)
    assert r.returncode != 0 and "broken.md:10" in r.stderr and "x is still 1" in r.stderr


_REPO_PATH = re.compile(r"`((?:compiler|ir|passes|runtime|examples|bench|tests|shardprop|docs)/[\w/.\-]*)`")
_MODULE = re.compile(r"`(\w+\.py)`")


def test_files_the_docs_name_exist():
    """Every repository path the README, DESIGN.md and the docs name in backticks exists, and
    every module named alone (`refine.py`) is somewhere in the tree: a file moved or renamed
    fails here until the docs follow."""
    pages = [ROOT / "README.md", ROOT / "DESIGN.md"] + sorted((ROOT / "docs").rglob("*.md"))
    modules = {p.name for d in ("compiler", "ir", "passes", "runtime", "examples", "bench", "tests", "shardprop")
               for p in (ROOT / d).rglob("*.py")}
    missing = []
    for page in pages:
        text = page.read_text()
        missing += [f"{page.relative_to(ROOT)}: {m}" for m in _REPO_PATH.findall(text)
                    if not (ROOT / m.rstrip("/")).exists()]
        missing += [f"{page.relative_to(ROOT)}: {m}" for m in _MODULE.findall(text) if m not in modules]
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(sorted(set(missing)))


_FILE_SUFFIXES = ("py", "json", "txt", "ir", "html", "png", "md", "toml", "yml")   # plan.json is a file
_DOTTED = re.compile(r"`([a-z_]+)\.([A-Za-z_]\w*)[\w.]*(?:\(\))?`")


def test_names_the_docs_give_modules_exist():
    """`launch.start_logged`, `cost.ComputeTimes`, `geo.pushes`: where the part before the dot
    is one of the package's modules, the name after it is defined there (a function, class,
    assignment or attribute), so a function moved to another module fails here."""
    modules = {}
    for d in ("compiler", "ir", "passes", "runtime"):
        for p in (ROOT / d).rglob("*.py"):
            modules.setdefault(p.stem, []).append(p)
    pages = [ROOT / "README.md", ROOT / "DESIGN.md"] + sorted((ROOT / "docs").rglob("*.md"))
    missing = []
    for page in pages:
        for mod, name in _DOTTED.findall(page.read_text()):
            if mod not in modules or name in _FILE_SUFFIXES:
                continue
            src = "".join(p.read_text() for p in modules[mod])
            if not re.search(rf"(def|class)\s+{name}\b|^\s*{name}\s*[:=]|\.{name}\s*[:=]", src, re.M):
                missing.append(f"{page.relative_to(ROOT)}: {mod}.{name}")
    assert not missing, "the docs name functions that their module does not define:\n" + "\n".join(missing)


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES} (move the rest to docs/)"


def test_readme_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && "
            "python examples/quickstart.py") in text
    command = "XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -q -n 2 --dist loadfile tests"
    assert command + "\n" in text
    assert command + " ||" in (ROOT / ".ci" / "run").read_text()   # (the CI runs exactly the README's command)


# Not -q: mkdocs's quiet flag hides warnings from the strict-mode counter too, so a broken
# link would pass (test_mkdocs_strict_fails_on_a_broken_link caught that).
@pytest.mark.multiprocess
@pytest.mark.timeout(420)   # the build may take up to 300 s
def test_mkdocs_build_strict(tmp_path):
    if shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install mkdocs mkdocs-material)")
    if importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material is not installed (pip install mkdocs-material)")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert (tmp_path / "site" / "index.html").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(420)   # the build may take up to 300 s
def test_mkdocs_strict_fails_on_a_broken_link(tmp_path):
    """The strict build is a real check: the same site with one dead link fails."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs or mkdocs-material is not installed (pip install mkdocs mkdocs-material)")
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[dead](guide/no_such_page.md)\n")
    cfg = (ROOT / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(cfg)
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "no_such_page.md" in (r.stdout + r.stderr)
