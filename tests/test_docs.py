"""The commands the README, the docs and the scripts show are commands d2o takes: its commands and
options, and the methods and tasks they name (other values are checked where each command runs)."""

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from d2o.cli import app
from d2o.eval.tasks import TASKS
from d2o.methods import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SCRIPTS = [*sorted((ROOT / "benchmarks").glob("*.sh")), *sorted((ROOT / "docs").rglob("*.sh"))]


def markdown_commands(path: Path) -> list[list[str]]:
    """Every ``d2o ...`` line of a code block, and every inline ``d2o ...`` span with options."""
    text = path.read_text(encoding="utf-8")
    found, block = [], False
    for line in text.replace("\\\n", " ").splitlines():  # a command continued over lines is one line
        if line.startswith("```"):
            block = not block
        elif block and line.strip().startswith("d2o "):
            found.append(shlex.split(line.split(" #")[0])[1:])
    return found + [shlex.split(span) for span in re.findall(r"`d2o ([^`]+ --[^`]+)`", text)]


def script_commands(path: Path, folder: Path) -> list[list[str]]:
    """The d2o command lines the script runs, recorded by a stand-in for d2o."""
    log, stand_in = folder / "calls.jsonl", folder / "d2o"
    stand_in.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "D2O": str(stand_in), "OUT": str(folder / "out")}
    done = subprocess.run(["bash", str(path)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def check_command(args: list[str]) -> None:
    result = CliRunner().invoke(app, [*args, "--help"])  # unknown commands and options fail, --help runs nothing
    assert result.exit_code == 0, result.output
    for option, value in zip(args, args[1:]):
        if option in ("--methods", "--method"):
            unknown = [name for name in value.split(",") if name not in REGISTRY and name != "..."]  # a placeholder
            assert not unknown, f"no method named {unknown}"
        if option == "--task":
            assert value in TASKS or value == "T", f"no task named {value!r}"  # "T": a placeholder


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_commands_a_document_shows_are_commands_d2o_takes(path):
    for args in markdown_commands(path):
        try:
            check_command(args)
        except AssertionError as error:
            raise AssertionError(f"`d2o {shlex.join(args)}`: {error}") from None


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_commands_a_script_runs_are_commands_d2o_takes(path, tmp_path):
    calls = script_commands(path, tmp_path)
    assert calls, f"{path.name} ran no d2o command"
    for args in calls:
        try:
            check_command(args)
        except AssertionError as error:
            raise AssertionError(f"`d2o {shlex.join(args)}`: {error}") from None


def test_a_renamed_method_in_a_document_is_found(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("```bash\nd2o eval --task passkey --methods full,d2o-old --out x\n```\n")
    args, = markdown_commands(readme)
    with pytest.raises(AssertionError, match="d2o-old"):
        check_command(args)
    with pytest.raises(AssertionError, match="--metods"):
        check_command(["eval", "--task", "passkey", "--metods", "full"])


def test_the_docs_site_builds_strictly_and_every_guide_is_in_its_navigation(tmp_path):
    """``mkdocs build --strict``: no broken link, no missing page, no API reference that does not
    resolve; every guide reachable from the navigation."""
    import yaml

    nav = json.dumps(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    docs = ROOT / "docs"
    for page in [docs / "index.md", docs / "ARCHITECTURE.md", docs / "reference.md", *(docs / "guides").glob("*.md")]:
        assert str(page.relative_to(docs)) in nav, f"{page} is not in the site's navigation"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "index.html").read_text().count("compress") > 3


def test_the_readme_is_short():
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words <= 1500, f"README.md has {words} words"


@pytest.mark.real_model
def test_the_method_guides_complete_example_runs(real_model, monkeypatch):
    """docs/guides/writing-a-method.md's method, written against the engine's boundary, runs as shown."""
    import d2o
    from d2o.methods import REGISTRY

    text = (ROOT / "docs" / "guides" / "writing-a-method.md").read_text(encoding="utf-8")
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setattr(d2o, "load_model", lambda name: real_model)  # the one the session loaded
    namespace = {}
    try:
        exec(compile(code, "writing-a-method.md", "exec"), namespace)
    finally:
        REGISTRY.pop("fading-attention", None)
    result = namespace["result"]
    assert result.text.strip() and result.report.method == "fading-attention"
    assert result.report.kv_tokens_kept < 0.3 * result.report.kv_tokens_full  # 20% held, a few slots over
