"""The documentation cannot drift from the code:

- every relative link in README.md and docs/*.md resolves, inside the repository (and its #anchor, when it
  names one, is a heading of the target);
- every `key=value` written in them (inline code, and code blocks other than `text` ones, which hold
  program output such as quoted error messages) is a real config key whose value parses
  by the key's type and is one of its allowed values (the CHOICES registries validation checks against);
  placeholders (`N`, `DIR`, `$VOCAB`, `<path>`) and alternatives (`auto|triton`) are checked key by key;
- every launch command in a code block (`launch/pretrain.py`, `evaluate.py`, `plan.py` with its
  `--config` preset and overrides, no placeholders) passes the whole validation for its world size
  (`--world-size N`, or torchrun's `--nproc_per_node`, or the smallest the degrees need);
- docs/configuration.md is what `launch/config_doc.py` generates now, and every key has a meaning.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from parallel3d.models.config import CHOICES as MODEL_CHOICES, ModelConfig
from parallel3d.training.config import ConfigError, _apply_override, config_from_dict, load_config
from parallel3d.training.validate import CHOICES, resolve_and_validate

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = "model|parallel|train|data|checkpoint|log"
SETTING = re.compile(rf"(?<![\w./-])((?:{SECTIONS})\.[A-Za-z_][\w.]*)=([^\s`'\"]+)")
FENCE = re.compile(r"^(```|~~~)(.*?)\n(.*?)^\1\s*$", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
ALLOWED = {**CHOICES, **{f"model.{k}": v for k, v in MODEL_CHOICES.items()}}


def doc_files(root: Path = ROOT) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def split_code(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the prose with code blocks blanked out, [(language, code) of each block])."""
    blocks = [(m.group(2).strip(), m.group(3)) for m in FENCE.finditer(text)]
    return FENCE.sub("", text), blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_code(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", prose, re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    prose, _ = split_code(path.read_text())
    prose = re.sub(r"`[^`\n]*`", "", prose)  # inline code is not a link
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if root.resolve() not in (dest, *dest.parents):
            problems.append(f"{target}: points outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: {dest.relative_to(root.resolve())} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading #{anchor} in {dest.name}")
    return problems


@dataclass
class Setting:
    key: str
    value: str
    where: str

    @property
    def text(self) -> str:
        return f"{self.key}={self.value}"

    def placeholder(self) -> bool:
        v = self.value
        return bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", v)) or any(c in v for c in "$<>") or "..." in v

    def alternatives(self) -> list[str]:
        return [a for a in self.value.replace("\\|", "|").split("|") if a]


def settings_in(text: str, where: str) -> list[Setting]:
    out = []
    for key, value in SETTING.findall(text):
        value = value.rstrip(",;:")
        for open_, close in ("[]", "()"):  # a bracket closing around the setting, not inside its value
            while value.endswith(close) and value.count(close) > value.count(open_):
                value = value[:-1]
        out.append(Setting(key.rstrip("."), value, where))
    return out


def doc_settings(path: Path) -> tuple[list[Setting], list[tuple[str, list[Setting]]]]:
    """(every key=value of the file, [(command, its settings) for each launch command in a code block])."""
    text = path.read_text()
    prose, blocks = split_code(text)
    name = path.name
    found = []
    for span in re.findall(r"`([^`\n]+)`", prose):
        found += settings_in(span, f"{name}: `{span}`")
    commands = []
    for lang, code in blocks:
        if lang.split()[0:1] not in ([], ["bash"], ["sh"], ["shell"], ["console"], ["python"], ["yaml"]):
            continue  # a text block is program output (e.g. quoted error messages), not something to type
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0]
            items = settings_in(line, f"{name}: {line.strip()}")
            found += items
            if re.search(r"launch/(pretrain|evaluate|plan)\.py", line):
                commands.append((line.strip(), items))
    return found, commands


def setting_problem(s: Setting) -> str | None:
    """Why one key=value is not a real key with a valid value (None: it is)."""
    try:
        _apply_override({}, f"{s.key}=0", ModelConfig)  # the key path alone
    except ConfigError as e:
        return f"{s.where}: {e}"
    if s.placeholder():
        return None
    for value in s.alternatives():
        try:
            config_from_dict({}, ModelConfig, [f"{s.key}={value}"])
        except ConfigError as e:
            return f"{s.where}: {e}"
        allowed = ALLOWED.get(s.key)
        if allowed is not None and value not in map(str, allowed):
            return f"{s.where}: {s.key}={value} is not one of {', '.join(map(str, allowed))}"
    return None


def world_size_of(command: str, cfg) -> int:
    m = re.search(r"--world-size[= ](\d+)", command)
    if m:
        return int(m.group(1))
    m = re.search(r"--nproc[_-]per[_-]node[= ](\d+)", command)
    if m:
        nodes = re.search(r"--nnodes[= ](\d+)", command)
        return int(m.group(1)) * (int(nodes.group(1)) if nodes else 1)
    p = cfg.parallel
    dp = p.dp or max(1, p.ep // p.cp if p.ep > p.cp else 1)
    return p.tp * p.cp * p.pp * dp


def command_problem(command: str, items: list[Setting], root: Path = ROOT) -> str | None:
    """Why a documented launch command's config does not validate (None: it does, or it cannot be judged
    from the page: a placeholder, alternatives, or a --config outside the repository's presets)."""
    if any(s.placeholder() or len(s.alternatives()) != 1 for s in items):
        return None
    m = re.search(r"--config[= ](\S+)", command)
    preset = root / m.group(1) if m else None
    if preset is not None and not preset.is_file():
        return None
    try:
        cfg = load_config(str(preset) if preset else None, [s.text for s in items], ModelConfig)
        resolve_and_validate(cfg, world_size_of(command, cfg))
    except ConfigError as e:
        return f"{command}\n    {e}"
    return None


DOCS = doc_files()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_documented_setting_is_a_real_key_with_a_valid_value(path):
    found, _ = doc_settings(path)
    assert [p for p in map(setting_problem, found) if p] == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_documented_launch_command_validates(path):
    _, commands = doc_settings(path)
    assert [p for p in (command_problem(c, items) for c, items in commands) if p] == []


def test_configuration_reference_is_current_and_complete():
    import sys

    sys.path.insert(0, str(ROOT / "launch"))
    from config_doc import reference
    from parallel3d.training.docgen import undocumented

    assert (ROOT / "docs" / "configuration.md").read_text() == reference(), \
        "docs/configuration.md is stale: run `python launch/config_doc.py > docs/configuration.md`"
    assert undocumented(ModelConfig) == [], "add a trailing comment (its meaning) to each of these fields"


def test_the_checks_catch_what_they_are_for(tmp_path):
    """Each check rejects a broken example: the tests above cannot pass vacuously."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text((ROOT / "configs" / "tiny.yaml").read_text())
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Two words\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#two-words) [gone](docs/b.md) [anchor](docs/a.md#nope) [out](../x.md)\n"
                    "[web](https://example.org) [self](#readme)\n\n# README\n")
    assert broken_links(page, tmp_path) == ["docs/b.md: docs/b.md does not exist",
                                            "docs/a.md#nope: no heading #nope in a.md",
                                            "../x.md: points outside the repository"]
    page.write_text("Use `parallel.layers_per_stage=[1,2]`, `parallel.schedule=zb-v`, `parallel.schedul=1f1b`, `parallel.zero=4`, `train.lr=fast`, "
                    "`parallel.offload_dir=DIR`, `model.attention=auto|sdpa|cudnn`, `train.compile=true`.\n\n"
                    "```bash\ntorchrun --nproc_per_node=4 launch/pretrain.py --config configs/tiny.yaml \\\n"
                    "    parallel.tp=3\n"
                    "python launch/plan.py --config configs/tiny.yaml --world-size 8 parallel.tp=2 parallel.pp=2\n```\n"
                    "```text\nworld 2: parallel.zer0=1\n```\n")
    found, commands = doc_settings(page)
    problems = [setting_problem(s) for s in found]
    assert found[0].value == "[1,2]" and len(found) == 11  # the text block's quoted output is not checked
    assert [p is None for p in problems] == [True, True, False, False, False, True, False, True, True, True, True]
    assert "did you mean 'schedule'" in problems[2] and "parallel.zero=4 is not one of" in problems[3]
    assert "expected float" in problems[4] and "cudnn is not one of" in problems[6]
    first, second = (command_problem(c, items, tmp_path) for c, items in commands)
    assert "world size" in first or "divisible" in first, first  # tp=3 on 4 ranks
    assert second is None


def test_nothing_cites_a_file_outside_the_repository():
    """The project's own docs are its design record: no tracked file points at ../shared/ or DESIGN.md."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    offenders = [f for f in files if (root / f).is_file() and not (root / f).is_symlink()
                 and f != "tests/test_docs.py" and f.endswith((".py", ".md", ".yaml", ".ini", ".sbatch", "Makefile"))
                 and ("DESIGN.md" in (root / f).read_text(errors="ignore")
                      or "../shared/" in (root / f).read_text(errors="ignore"))]
    assert offenders == []
