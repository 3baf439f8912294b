"""What the docs cite exists: every test named (`tests/<file>.py::test_name`, `::test_name`, a bare `test_name`), every
repository file given by its path, and every config key (`section.key`, as `--set` takes it); and docs/config.md is
`gptforge config`'s output, so that no field, default or help in it is stale."""

import re
from pathlib import Path

import pytest

from gptforge.core.config import PipelineConfig
from gptforge.core.config.reference import reference, section_models
from gptforge.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md",
        ROOT / "bench" / "RESULTS.md"]
CODE = re.compile(r"`([^`\n]+)`")


def cited(pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    """(doc:line, match) of `pattern` over every line of every doc."""
    return [(f"{doc.relative_to(ROOT)}:{n}", m) for doc in DOCS
            for n, line in enumerate(doc.read_text().splitlines(), 1) for m in pattern.finditer(line)]


def test_every_test_the_docs_cite_exists():
    token = re.compile(r"(?P<file>(?:tests/)?(?:[\w.-]+/)*test_\w+\.py)?(?:::(?P<qual>test_\w+))"
                       r"|(?P<file2>(?:tests/)?(?:[\w.-]+/)*test_\w+\.py)"
                       r"|(?<![\w/.:])(?P<bare>test_\w+)(?![\w.(/])")
    defs = {f.relative_to(ROOT).as_posix(): set(re.findall(r"^\s*def\s+(test_\w+)", f.read_text(), re.M))
            for f in (ROOT / "tests").rglob("*.py")}
    every = set().union(*defs.values()) | {"test_prefs"}  # (UltraFeedback's split, not a test)
    missing = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            current = None  # a `::name` belongs to the file cited last on its line
            for m in token.finditer(line):
                if path := m.group("file") or m.group("file2"):  # tests/README.md's paths are under tests/
                    current = path if path.startswith("tests/") else f"tests/{path}"
                    if current not in defs:
                        missing.append(f"{doc.relative_to(ROOT)}:{n}: {current}")
                        continue
                if m.group("qual") and (current not in defs or m.group("qual") not in defs[current]):
                    missing.append(f"{doc.relative_to(ROOT)}:{n}: {current}::{m.group('qual')}")
                elif m.group("bare") and m.group("bare") not in every:
                    missing.append(f"{doc.relative_to(ROOT)}:{n}: {m.group('bare')}")
    assert not missing, missing


def test_every_repository_file_the_docs_cite_exists():
    """A path in backticks to a file of the repository's kinds (.py, .yaml, .md, .sh, .sbatch, .toml, .txt):
    from the repository's root, from gptforge/ (`core/config/...`), from tests/ (tests/README.md) or from the doc's
    own folder. Placeholders (`<name>`, `*`, `{...}`) and output files (`logs/metrics.jsonl`) are not paths to
    check."""
    path = re.compile(r"^[\w./-]+/[\w.-]+\.(?:py|yaml|md|sh|sbatch|toml|txt)$")
    missing = []
    for where, m in cited(CODE):
        text = (m.group(1).split(":")[0].split() or [""])[0]  # `pipeline/store.py: locate` names the file
        if not path.match(text):
            continue
        doc = ROOT / where.split(":")[0]
        bases = (ROOT, ROOT / "gptforge", ROOT / "tests", doc.parent)
        if not any((base / text).exists() for base in bases):
            missing.append(f"{where}: {text}")
    assert not missing, missing


def resolves(key: str) -> bool:
    """Whether a dotted config key names a field of the schema (through its sections, and a list's items)."""
    model, parts = PipelineConfig, key.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:  # a property of a section (distributed.world_size) is read as a key is
            return i == len(parts) - 1 and isinstance(getattr(model, part, None), property)
        subs = section_models(field.annotation)
        if i < len(parts) - 1:
            if not subs:
                return False
            model = subs[0]
    return True


def test_every_config_key_the_docs_cite_is_in_the_schema():
    """A key in backticks that starts with a config section (`preference.ppo.ppo_epochs`, `--set
    pretrain.lr=1e-3`, `model.rope: {...}`) names a field of the schema."""
    sections = set(PipelineConfig.model_fields)
    key = re.compile(r"(?:^|--set\s+|\s)((?:" + "|".join(sorted(sections)) + r")(?:\.[A-Za-z_]\w*)+)(?=$|[=:\s,)\[])")
    files = {"py", "json", "jsonl", "md", "yaml", "safetensors", "bin", "pt", "png", "txt"}  # (model.py, run.json)
    missing = [f"{where}: {k.group(1)}" for where, m in cited(CODE) for k in key.finditer(m.group(1))
               if k.group(1).rsplit(".", 1)[1] not in files and not resolves(k.group(1))]
    assert not missing, missing


def test_docs_config_md_is_gptforge_configs_output(capsys):
    from gptforge.pipeline.cli import main

    doc = ROOT / "docs" / "config.md"
    assert doc.read_text() == reference(), "docs/config.md is stale: run `.venv/bin/gptforge config > docs/config.md`"
    assert main(["config"]) == 0 and capsys.readouterr().out == reference()
    assert reference("preference.ppo") in reference() and "`ppo_epochs`" in reference("preference.ppo")
    with pytest.raises(ConfigError, match="no config section 'preferense'; did you mean preference"):
        reference("preferense")


def test_no_doc_or_comment_names_a_plan_step():
    """"[7/7]'s" means something to the round that wrote it and nothing to a user: the docs and the code say what
    a thing is, or that it needs a GPU, never which issue it was."""
    step = re.compile(r"\[\d/\d\]")
    code = [p for room in ("gptforge", "data", "model", "pipeline", "stages", "bench", "tests", "configs")
            for p in (ROOT / room).rglob("*") if p.suffix in (".py", ".yaml", ".sh") and ".venv" not in p.parts]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in [*DOCS, *code] if p.is_file()
             for n, line in enumerate(p.read_text().splitlines(), 1) if step.search(line) and p != Path(__file__)]
    assert not found, found


def schema_keys(model=PipelineConfig, prefix: str = "") -> list[str]:
    """Every key of the schema, nested sections' too (`preference.ppo.gamma`)."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        for sub in section_models(field.annotation):
            out += schema_keys(sub, f"{prefix}{name}.")
    return out


def test_every_config_key_is_explained_in_the_doc_of_its_topic():
    """Not only in the generated reference: each key, or its last parts (`gamma` of `preference.ppo.gamma`, as a
    section's doc names it), in backticks or a YAML example of README.md or a topic's doc."""
    prose = "\n".join(p.read_text() for p in DOCS if p.name != "config.md" and p.parent.name != "tests")
    named = set()
    for m in re.finditer(r"`([^`\n]+)`", prose):
        for word in re.findall(r"[A-Za-z_][\w.]*", m.group(1)):
            parts = word.split(".")
            named.update(".".join(parts[i:]) for i in range(len(parts)))
    for block in re.findall(r"```ya?ml\n(.*?)```", prose, re.S):
        named.update(re.findall(r"^\s*([A-Za-z_]\w*):", block, re.M))
    missing = [k for k in schema_keys() if not any(".".join(k.split(".")[i:]) in named
                                                   for i in range(k.count(".") + 1))]
    assert not missing, missing
