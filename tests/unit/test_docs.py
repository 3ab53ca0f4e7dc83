"""The docs stay true: what they name exists in the repository.

Reads docs/*.md and README.md as text and checks, without servers, a database or Redis:
relative links (and their #anchors) resolve inside the repository; every `make <target>`,
`manage.py <command>`, setting, file path, module and function name, Celery task name, event
kind, metric family, device topic and REST path they name exists in the code. A doc that
names something the code no longer has fails here instead of misleading a newcomer.
"""

from __future__ import annotations

import re
import sysconfig
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest
from django.urls import Resolver404, resolve

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
# The project's packages: a path or dotted name starting with one of these is the project's.
PACKAGES = ("iotqueue", "devices", "jobs", "triggers", "webhooks", "devtools")
# Top-level entries a path in the docs may start with (besides the packages).
TOP_LEVEL = (*PACKAGES, "tests", "bench", "deploy", "docs", ".ci")
# Made by deploy/make-certs.sh or at run time, never part of the repository.
GENERATED = ("deploy/ca", "deploy/certs", "deploy/clients", "deploy/device-ca", "var/")
# What the project runs or configures (settings and environment variables are read there).
SOURCE_GLOBS = ("**/*.py", "**/*.lua", "Makefile", "Dockerfile", "docker-compose.yml", "deploy/*", ".ci/*")
# Names the docs write as settings or environment variables.
SETTING = re.compile(
    r"\b(?:IOTQUEUE|MQTT|CELERY|REDIS|DATABASE|POSTGRES|AXES|SECURE|CSRF|SESSION|EMAIL|SCHEMATHESIS|MOSQUITTO)"
    r"_[A-Z0-9_]*[A-Z0-9]\b"
)
# Files outside the repository that the project must not lean on.
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md|SCENARIOS|STYLE\.md|[Dd]esign files?")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?:^|[\s;&|(])make\s+([a-z][\w-]*)")
MANAGE = re.compile(r"manage\.py\s+([a-z][\w]*)")
PATH = re.compile(r"(?<![\w/.<-])((?:[\w.-]+/)+[\w.*-]*)")
DOTTED = re.compile(rf"^((?:{'|'.join(PACKAGES)})(?:\.\w+)+)")
# A file (with an extension) or a package directory, as opposed to an MQTT topic.
FILE_LIKE = re.compile(r"^(?:[\w.-]+/)*[\w*-]+\.[\w*]+$|^(?:\.?[A-Za-z_]\w*/)+$")
FILE_EXTENSIONS = {"py", "lua", "md", "sh", "conf", "yml", "toml", "txt", "js", "css", "png"}
# Files the running stack writes (var/devstack/sim.json, its logs), not the repository's.
RUNTIME_EXTENSIONS = {"json", "log", "sqlite3", "crt", "key"}
SHORT_REF = re.compile(r"^([A-Za-z_]\w*\.[A-Za-z_]\w*)(?:\(\))?$")
EVENT_KIND = re.compile(r"^((?:run|step|reply|message|lock|schedule|webhook)\.[a-z_]+)$")
# (iotqueue_device.…, the device agent library's package, is a module, not a metric family.)
METRIC = re.compile(r"\b(iotqueue_(?!device\b)[a-z_]+)")
API_PATH = re.compile(r"(?<![\w/])(/(?:api|admin)/[^\s`\"')]*|/metrics\b)")


def doc_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def code_of(text: str) -> list[str]:
    """Code blocks and inline code spans: where commands, paths and names are written."""
    blocks = FENCE.findall(text)
    prose = FENCE.sub("", text)
    return blocks + SPAN.findall(prose)


def names_in_docs(pattern: re.Pattern, *, code_only: bool = True) -> list[tuple[str, str]]:
    """(doc, name) for every match of `pattern` in the docs' code (or their whole text)."""
    found = []
    for doc in DOCS:
        text = doc_text(doc)
        for chunk in code_of(text) if code_only else [text]:
            for match in pattern.finditer(chunk):
                groups = [group for group in match.groups() if group]
                found.append((doc.name, groups[0] if groups else match.group(0)))
    return sorted(set(found))


@cache
def source_text(*, tests: bool = False) -> str:
    """Everything the project runs or configures, docs excluded (tests only if asked: a test
    may read a variable, but a name only a test mentions is not the product's)."""
    files = set()
    for pattern in SOURCE_GLOBS:
        files.update(p for p in ROOT.glob(pattern) if p.is_file())
    skip = [ROOT / ".venv", ROOT / "var", ROOT / "docs"] + ([] if tests else [ROOT / "tests"])
    return "\n".join(
        p.read_text(encoding="utf-8", errors="replace")
        for p in sorted(files)
        if not any(p.is_relative_to(s) for s in skip) and p != Path(__file__).resolve()
    )


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    slugs = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", FENCE.sub("", doc_text(path)), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def test_the_docs_name_nothing_outside_the_repository():
    # given every doc
    # then none refers to files that only exist next to the repository
    found = [(doc.name, m.group(0)) for doc in DOCS for m in OUTSIDE.finditer(doc_text(doc))]
    assert not found, found


def test_every_relative_link_resolves_inside_the_repository():
    # given every Markdown link and image that is not a URL
    # then its file is in the repository, and its #anchor a heading of that file
    broken = []
    for doc in DOCS:
        for match in LINK.finditer(doc_text(doc)):
            target = match.group(1) or match.group(2)
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not a file
            file_part, _, anchor = target.partition("#")
            path = (doc.parent / unquote(file_part)).resolve() if file_part else doc
            if not path.is_relative_to(ROOT):
                broken.append((doc.name, target, "outside the repository"))
            elif not path.exists():
                broken.append((doc.name, target, "no such file"))
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append((doc.name, target, "no such heading"))
    assert not broken, broken


def test_every_make_target_named_exists():
    # given the Makefile's targets; then every `make <target>` a doc writes is one of them
    targets = set(re.findall(r"^([\w-]+)\s*:", (ROOT / "Makefile").read_text(), re.MULTILINE))
    missing = [(doc, target) for doc, target in names_in_docs(MAKE) if target not in targets]
    assert not missing, missing


@cache
def management_commands() -> set[str]:
    """The project's commands and those of Django and the installed apps."""
    roots = [ROOT, Path(sysconfig.get_paths()["purelib"])]
    return {
        p.stem
        for root in roots
        for p in root.glob("**/management/commands/*.py")
        if not p.stem.startswith("_") and ".venv" not in p.relative_to(root).parts
    }


def test_every_management_command_named_exists():
    # given the commands written as `manage.py <command>` and in tables headed "command"
    named = names_in_docs(MANAGE)
    for doc in DOCS:
        for table in re.findall(r"^\| command \|.*\n(?:\|.*\n)+", doc_text(doc), re.MULTILINE):
            named += [(doc.name, row) for row in re.findall(r"^\| `([a-z_]+)", table, re.MULTILINE)]
    # then each is a management command of the project or of an installed app
    missing = [(doc, command) for doc, command in named if command not in management_commands()]
    assert not missing, missing


def test_every_setting_named_is_read_by_the_code():
    # given the code, the Makefile, CI and the deployment files (tests may read a variable too)
    source = source_text(tests=True)
    # then every IOTQUEUE_…, MQTT_…, CELERY_… (and the like) a doc names is read there
    missing = [
        (doc, name)
        for doc, name in names_in_docs(SETTING, code_only=False)
        if not re.search(rf"\b{name}\b", source)
    ]
    assert not missing, missing


def test_every_file_path_named_exists():
    # given paths such as jobs/engine/batch.py or devices/lua/ in the docs' code
    # then each is in the repository (a glob such as run_*.py matches something)
    missing = []
    for doc, path in names_in_docs(PATH):
        if not path.startswith(tuple(f"{top}/" for top in TOP_LEVEL)) or path.startswith(GENERATED):
            continue
        if not FILE_LIKE.match(path):
            continue  # a topic such as iotqueue/lamp-2/status, not a file
        if not list(ROOT.glob(path.rstrip("/"))):
            missing.append((doc, path))
    assert not missing, missing


def _module_defines(module: Path, name: str) -> bool:
    text = module.read_text(encoding="utf-8")
    return bool(
        re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]", text, re.MULTILINE)
        or re.search(rf"^(?:from\s+\S+\s+)?import\s+.*\b{name}\b", text, re.MULTILINE)
    )


def _dotted_exists(dotted: str) -> bool:
    """A module, or a module's top-level name (and a method of it), or a task or permission."""
    parts = dotted.split(".")
    base = ROOT
    for index, part in enumerate(parts):
        if (base / part).is_dir():
            base = base / part
            continue
        if (base / f"{part}.py").is_file():
            rest = parts[index + 1 :]
            return not rest or _module_defines(base / f"{part}.py", rest[0])
        init = base / "__init__.py"
        return init.is_file() and _module_defines(init, part)
    return True


def test_every_dotted_name_is_a_module_a_task_or_a_permission():
    # given names such as jobs.engine.batch.inbox_apply, jobs.step_replies, jobs.add_jobrun
    # then each is a module or what it defines, a Celery task's name, or a model permission
    source = source_text()
    missing = []
    for doc, dotted in names_in_docs(DOTTED):
        if _dotted_exists(dotted):
            continue
        if re.search(rf"[\"']{re.escape(dotted)}[\"']", source):
            continue  # a Celery task's (or a logger's) name
        app, _, codename = dotted.partition(".")
        permission = re.fullmatch(r"(?:add|change|delete|view)_(\w+)", codename)
        models = ROOT / app / "models.py"
        if permission and models.is_file():
            declared = re.findall(r"^class (\w+)\(", models.read_text(), re.MULTILINE)
            if permission.group(1) in {name.lower() for name in declared}:
                continue
        missing.append((doc, dotted))
    assert not missing, missing


@cache
def project_modules() -> dict[str, list[Path]]:
    """Module stem -> the project's files of that name (`dispatch` -> jobs/engine/dispatch.py)."""
    modules: dict[str, list[Path]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).glob("**/*.py"):
            if "migrations" not in path.parts:
                modules.setdefault(path.stem, []).append(path)
    return modules


@cache
def project_classes() -> dict[str, list[Path]]:
    """Class name -> the project's files that define it."""
    classes: dict[str, list[Path]] = {}
    for paths in project_modules().values():
        for path in paths:
            for name in re.findall(r"^class (\w+)\b", path.read_text(encoding="utf-8"), re.MULTILINE):
                classes.setdefault(name, []).append(path)
    return classes


def test_every_short_module_or_class_reference_names_something_it_defines():
    # given `module.name` and `Class.attribute` as the docs write them, e.g.
    # `dispatch.step_acquire`, `_Batch.classify`, `StepRun.fence`
    source = source_text()
    missing = []
    for doc, ref in names_in_docs(SHORT_REF):
        owner, name = ref.split(".")
        if name in RUNTIME_EXTENSIONS:
            continue
        if name in FILE_EXTENSIONS:  # a bare file name (`attempts.py`): somewhere in the project
            if not any(p for p in ROOT.glob(f"**/{ref}") if ".venv" not in p.parts):
                missing.append((doc, ref))
            continue
        files = project_modules().get(owner) or project_classes().get(owner)
        if not files or re.search(rf"[\"']{re.escape(ref)}[\"']", source):
            continue  # not the project's, or a name in its own right (an event kind: reply.stale)
        # then one of the module's (or the class's) files defines it
        if not any(_module_defines(path, name) for path in files):
            missing.append((doc, ref))
    assert not missing, missing


def test_every_event_kind_named_is_recorded_by_the_code():
    # given the statuses a kind may be built from (f"run.{status}", f"step.{outcome.status}")
    source = source_text()
    statuses = set(re.findall(r'= "([a-z_]+)"', (ROOT / "jobs" / "models.py").read_text()))
    missing = []
    for doc, kind in names_in_docs(EVENT_KIND):
        family, _, suffix = kind.partition(".")
        if any(_module_defines(path, suffix) for path in project_modules().get(family, [])):
            continue  # `progress.progress_keep`: a function of jobs/engine/progress.py, not a kind
        literal = re.search(rf"[\"']{re.escape(kind)}[\"']", source)
        built = f'f"{family}.{{' in source and suffix in statuses
        # then the code records it, literally or from a status
        if not (literal or built):
            missing.append((doc, kind))
    assert not missing, missing


def test_every_metric_family_named_is_declared():
    # given the families as the code declares them (a counter's name without `_total`)
    declared = set(re.findall(r"[\"'](iotqueue_[a-z_]+)[\"']", source_text()))
    # then every series a doc names belongs to one of them
    missing = [
        (doc, name)
        for doc, name in names_in_docs(METRIC)
        if re.sub(r"_(?:total|bucket|sum|count)$", "", name) not in declared and name not in declared
    ]
    assert not missing, missing


def _sample_path(path: str) -> str:
    """A concrete URL for a documented one: placeholders and elisions become a name."""
    path = unquote(path.split("?")[0].split("#")[0])
    segments = ["x" if re.search(r"[<…{]|\.\.\.", s) else s for s in path.split("/")]
    return "/".join(segments)


def test_every_rest_and_admin_path_named_resolves():
    # given /api/…, /admin/… and /metrics as the docs write them (<id> and … stand for a name)
    # then the URLconf routes each
    unresolved = []
    for doc, path in names_in_docs(API_PATH, code_only=False):
        if path.endswith(("…", "...")):
            continue  # "/api/…": the whole API, not a path
        try:
            resolve(_sample_path(path))
        except Resolver404:
            unresolved.append((doc, path))
    assert not unresolved, unresolved


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_every_device_topic_named_is_the_protocols(doc):
    # given the protocol's topics as the code names them
    protocol = (ROOT / "devices" / "protocol.py").read_text()
    # then every `P/D/<kind>` a doc writes is one of them
    kinds = set(re.findall(r"`P/(?:D|\+|<name>)/([a-z]+)", doc_text(doc)))
    unknown = [kind for kind in kinds if f'"{kind}"' not in protocol and kind not in {"cmd", "events"}]
    assert not unknown, unknown
