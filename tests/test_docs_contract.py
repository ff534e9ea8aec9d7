"""The docs as contracts: the CLI verb table, the settings tables, the storage tree, the errors
paragraph, the Python API's row and the push walkthrough's headings are compared with the code
they describe, so a change to one without the other fails here, naming what drifted. No Ray;
reads the docs and the package's source, and imports the CLI app, settings.py and
storage/layout.py. (The node-local layout and "Not built yet": test_docs_layout.py and
test_docs_not_built.py.)"""

from __future__ import annotations

import ast
import builtins
import inspect
import re
from pathlib import Path
from typing import Any

import typer

import orchestrator
from orchestrator import errors, settings
from orchestrator.cli.app import app
from orchestrator.client import api
from orchestrator.storage import layout
from orchestrator.storage.checkpoints import CheckpointStore, UploadSettings
from orchestrator.storage.checkpoints import files_dir as checkpoint_files_dir
from orchestrator.storage.checkpoints import manifest_path as checkpoint_manifest_path
from orchestrator.storage.prices import PRICES
from orchestrator.storage.queue_store import ENTRIES, QUOTAS, REQUESTS, VIEW
from orchestrator.storage.retry import StorageSettings
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.training_cache import CacheStore, LocalCopy
from orchestrator.storage.weights import file_path, manifest_path, set_dir

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PACKAGE = REPO / "orchestrator"
SETTINGS = {s.name: s for s in settings.all_settings()}


def section(doc: str, heading: str) -> str:
    """The text under `heading` (a whole heading line) up to the next heading of its level."""
    text = (DOCS / doc).read_text()
    start = text.index(f"\n{heading}\n")
    level = heading.split(" ", 1)[0]
    end = text.find(f"\n{level} ", start + len(heading) + 2)
    return text[start : end if end >= 0 else len(text)]


def tables(text: str) -> list[list[list[str]]]:
    """Each Markdown table in `text`: its rows (the header's and the separator's left out), each
    a list of cells. A blank line ends a table, as it does when Markdown renders one."""
    found: list[list[list[str]]] = []
    rows: list[list[str]] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            rows = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if rows is None:
            rows = []
            found.append(rows)
            rows.append(cells)  # the header, dropped below
        elif not all(set(c) <= set("-: ") for c in cells):
            rows.append(cells)
    return [t[1:] for t in found]


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# --- (a) the CLI verbs -----------------------------------------------------------------------


def app_verbs() -> set[str]:
    """Every command of the typer app, as typed: `push`, `checkpoints list`."""

    def walk(command: Any, path: tuple[str, ...]) -> list[str]:
        subcommands = getattr(command, "commands", None)
        if subcommands is None:
            return [" ".join(path)]
        return [v for name, sub in subcommands.items() for v in walk(sub, (*path, name))]

    return set(walk(typer.main.get_command(app), ()))


def documented_verbs() -> set[str]:
    """The verbs of the user guide's CLI table. A row's first cell names one command in full
    (`orchestrator cache summarize ...`) and may add others of its group after a `/`
    (`` / `delete NAME` `` or `` / `cache delete ...` ``); `` / `--flag` `` adds none."""
    verbs = set()
    for row in tables(section("user-guide.md", "## CLI"))[0]:
        spans = code_spans(row[0])
        words = re.findall(r"[a-z_]+|\S+", spans[0].removeprefix("orchestrator "))
        path = _verb_words(words)
        verbs.add(" ".join(path))
        for span in spans[1:]:
            more = _verb_words(span.split())
            if not more:
                continue
            verbs.add(" ".join(more if more[0] == path[0] else [path[0], *more]))
    return verbs


def _verb_words(words: list[str]) -> list[str]:
    path = []
    for word in words:
        if not re.fullmatch(r"[a-z_]+", word):
            break
        path.append(word)
    return path


def test_the_user_guides_cli_table_lists_exactly_the_apps_verbs():
    app_side, docs_side = app_verbs(), documented_verbs()
    assert docs_side == app_side, (
        "docs/user-guide.md's CLI table and the typer app (orchestrator/cli/app.py) differ: "
        f"not in the docs: {sorted(app_side - docs_side)}; "
        f"in the docs but not the app: {sorted(docs_side - app_side)}"
    )


def test_architecture_md_names_no_verb_the_app_lacks():
    """Its CLI row names the verbs' modules; the table of verbs is the user guide's."""
    row = next(
        line for line in (DOCS / "architecture.md").read_text().splitlines()
        if line.startswith("| CLI |")
    )  # fmt: skip
    top = {v.split()[0] for v in app_verbs()}
    named = {m.removeprefix("cmd_") for m in re.findall(r"`cmd_([a-z_]+)\.py`", row)}
    assert named <= top, f"docs/architecture.md's CLI row names verbs the app lacks: {named - top}"


# --- (b) the settings tables -----------------------------------------------------------------

# Where a setting's default is None in settings.py, the value it stands for is a field's default
# of the model that parses the group (storage/checkpoints.py, storage/retry.py).
_GROUP_DEFAULTS: dict[str, Any] = {
    **{
        f"ORCHESTRATOR_CHECKPOINT_{name.upper()}": field.default
        for name, field in UploadSettings.model_fields.items()
    },
    settings.STORAGE_OUTAGE_S.name: StorageSettings.model_fields["outage_s"].default,
    settings.ON_STORAGE_ERROR.name: StorageSettings.model_fields["on_error"].default,
}


def effective_default(name: str) -> Any:
    default = SETTINGS[name].default
    return _GROUP_DEFAULTS.get(name) if default is None else default


def rows_by_variable(rows: list[list[str]]) -> list[tuple[str, str, list[str]]]:
    """(variable, its default's cell, the row) for every ORCHESTRATOR_* setting a row names.
    A row may name several (`ORCHESTRATOR_MAX_RETRIES`, `ORCHESTRATOR_MAX_PREEMPTIONS`, or
    `_SETTLE_S` after a full name: the same prefix) with as many defaults, comma-separated."""
    found = []
    for row in rows:
        names: list[str] = []
        for span in code_spans(row[0]):
            if span.startswith("ORCHESTRATOR_"):
                names.append(span)
            elif span.startswith("_") and names:
                prefix = re.match(r"ORCHESTRATOR_[A-Z]+", names[0])
                names.append(f"{prefix.group(0) if prefix else 'ORCHESTRATOR'}{span}")
            else:
                names.append(span)  # another variable (HF_ENDPOINT): it takes a default too
        defaults = [row[1]] if len(names) == 1 else _split_defaults(row[1])
        assert len(defaults) == len(names), (
            f"the row for {', '.join(names)} gives {len(defaults)} defaults for {len(names)} "
            f"variables: {row[1]!r}"
        )
        found += [(n, d, row) for n, d in zip(names, defaults, strict=True) if n in SETTINGS]
        unknown = [n for n in names if n.startswith("ORCHESTRATOR_") and n not in SETTINGS]
        unknown = [n for n in unknown if n != "ORCHESTRATOR_SECRET_<NAME>"]
        assert not unknown, f"documented, but not in orchestrator/settings.py: {unknown}"
    return found


def _split_defaults(cell: str) -> list[str]:
    """`8`, no cap, `0.5` -> three defaults (commas inside a code span or brackets stay)."""
    parts, depth, current, in_code = [], 0, "", False
    for i, ch in enumerate(cell):
        in_code = not in_code if ch == "`" else in_code
        depth += (ch in "([") - (ch in ")]") if not in_code else 0
        if ch == "," and not in_code and depth == 0 and cell[i + 1 : i + 2] == " ":
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [*parts, current.strip()]


def states_default(cell: str, default: Any) -> bool:
    """Whether a Default cell says `default`; a default worked out when it is used (None: a
    path under $ORCHESTRATOR_HOME, a share of free disk) is described, not compared."""
    if default is None:
        return True
    text = cell.strip().lower()
    if isinstance(default, bool):
        return text.startswith(("off", "unset")) if not default else text.startswith("on")
    if default in ("", ()):
        return text.startswith(("none", "unset"))
    spans = code_spans(cell)
    if not spans:
        return False
    if isinstance(default, int | float):
        try:
            return float(spans[0]) == float(default)
        except ValueError:
            return False
    return spans[0] == str(default)


def check_table_rows(doc: str, found: list[tuple[str, str, list[str]]]) -> list[str]:
    return [
        f"{doc}: {name}'s default says {cell!r}, settings.py says {effective_default(name)!r}"
        for name, cell, _ in found
        if not states_default(cell, effective_default(name))
    ]


def configuration_tables() -> list[list[list[str]]]:
    return tables(section("configuration.md", "## Environment variables"))


def test_configuration_md_tables_hold_every_setting_once_with_its_default():
    found = [f for t in configuration_tables() for f in rows_by_variable(t) if f[0] in SETTINGS]
    names = [name for name, _, _ in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"docs/configuration.md lists these in more than one row: {twice}"
    missing = sorted(set(SETTINGS) - set(names))
    assert not missing, f"in orchestrator/settings.py, in no table of configuration.md: {missing}"
    wrong = check_table_rows("docs/configuration.md", found)
    assert not wrong, "\n".join(wrong)


def test_configuration_md_tables_say_who_reads_each_setting():
    """The table headed "Read by" says it per row; the other tables are the client's at push
    (checkpoints, storage, retries, deploys) and the nodes' (weights and caches)."""
    words = {settings.CLIENT: "client", settings.HEAD: "head node", settings.NODE: "each node"}
    wrong = []
    for rows in configuration_tables():
        by_row = len(rows[0]) == 4
        for name, _, row in rows_by_variable(rows):
            read_by = SETTINGS[name].read_by
            if by_row and not row[2].startswith(words[read_by]):
                wrong.append(f"{name}: read by {row[2]!r}, settings.py says {read_by}")
    client = {n for n, _, _ in rows_by_variable(configuration_tables()[0])}
    node = {n for n, _, _ in rows_by_variable(configuration_tables()[1])}
    wrong += [f"{n}: in the client's table, read by {SETTINGS[n].read_by}" for n in client
              if SETTINGS[n].read_by != settings.CLIENT]  # fmt: skip
    wrong += [f"{n}: in the nodes' table, read by {SETTINGS[n].read_by}" for n in node
              if SETTINGS[n].read_by != settings.NODE]  # fmt: skip
    assert not wrong, "docs/configuration.md:\n" + "\n".join(wrong)


def test_the_flag_values_that_mean_off_are_the_parsers():
    """configuration.md says once which values turn a flag off; settings.flag decides."""
    text = section("configuration.md", "## Environment variables")
    sentence = re.search(r"A flag[^.]*\.", text, re.S)
    assert sentence, "docs/configuration.md no longer says which values turn a flag off"
    said = {s.lower() for s in code_spans(sentence.group(0))}
    flags = sorted(n for n, s in SETTINGS.items() if s.parse is settings.flag)
    named = {s for s in said if s.startswith("orchestrator_")}
    assert named == {n.lower() for n in flags}, f"the flags are {flags}; the sentence names {named}"
    off = said - named
    parsed = {v for v in settings._OFF if v}  # and empty, which needs no saying
    assert off == parsed, f"docs say {sorted(off)} turn a flag off; settings.flag: {sorted(parsed)}"


def test_the_user_guides_table_names_real_settings_with_their_defaults():
    found = rows_by_variable(
        tables(section("user-guide.md", "## orchestrator's own environment variables"))[0]
    )
    missing = sorted(set(SETTINGS) - {name for name, _, _ in found})
    assert not missing, f"in orchestrator/settings.py, not in the user guide's table: {missing}"
    wrong = check_table_rows("docs/user-guide.md", found)
    assert not wrong, "\n".join(wrong)


# --- (c) the storage tree --------------------------------------------------------------------


def documented_tree() -> list[str]:
    """The paths of architecture.md's storage tree: the first word of each entry."""
    text = section("architecture.md", "## Storage layout")
    block = text[text.index("<storage root>/") : text.index("```", text.index("<storage root>/"))]
    return [m.group(1) for m in re.finditer(r"^  (\S+)", block, re.M)]


def test_architecture_md_storage_tree_is_layouts_tree():
    declared = [path for path, _ in layout.TREE]
    documented = documented_tree()
    assert documented == declared, (
        "docs/architecture.md's storage tree and orchestrator/storage/layout.py's TREE differ: "
        f"not in the docs: {[p for p in declared if p not in documented]}; "
        f"not in TREE: {[p for p in documented if p not in declared]}"
        + ("; the same paths in another order" if sorted(documented) == sorted(declared) else "")
    )


def _pattern(path: str) -> re.Pattern[str]:
    """A TREE path as a regex: `<path>` any number of segments, another `<...>` one."""
    parts = re.split(r"(<[a-z_0-9]+>)", path)
    body = "".join(
        ".+" if p == "<path>" else "[^/]+" if p.startswith("<") else re.escape(p) for p in parts
    )
    return re.compile(body)


def undeclared(paths: list[str]) -> list[str]:
    patterns = [_pattern(p) for p, _ in layout.TREE]
    return [p for p in paths if not any(pat.fullmatch(p) for pat in patterns)]


def test_what_the_storage_modules_write_is_in_the_tree(tmp_path):
    """Paths the code builds, and the files a checkpoint upload and a cache write-back leave in
    a real root: each matches one of TREE's paths."""
    built = [
        layout.archive("0f" * 32), layout.record("j1"), layout.status("j1"),
        layout.log_segment("j1", 3), layout.rank_metrics("j1", 0), layout.session("j1"),
        layout.project("p1"), layout.project_name("demo/any name"),
        checkpoint_manifest_path("p1", "j1", 0, "checkpoint-5"),
        f"{checkpoint_files_dir('p1', 'j1', 0, 'checkpoint-5', 2)}/model.safetensors",
        file_path("k1", "config.json"), manifest_path("k1"), f"{set_dir('k1')}/manifest.json",
        QUOTAS, PRICES, f"{ENTRIES}/j1.json", f"{REQUESTS}/j1.json", VIEW,
    ]  # fmt: skip
    root = StorageRoot(tmp_path / "root")
    ckpt = tmp_path / "checkpoint-5"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "sub" / "w.bin").write_bytes(b"w")
    CheckpointStore(root).upload(ckpt, "p1", "j1", 0)
    for project in ("p1", None):
        copy = LocalCopy(tmp_path / f"copy-{project}")
        (copy.data / "a.txt").write_text("a")
        CacheStore(root, "t1", project).write_back(copy)
    CacheStore(root, "t1", "p1").mark_holder("n1")  # the project's scope only, as the seeder
    written = [p.relative_to(root.url).as_posix() for p in Path(root.url).rglob("*") if p.is_file()]
    assert len(written) >= 7, written
    assert not undeclared(built + written), (
        f"written under the storage root but not in layout.TREE: {undeclared(built + written)}"
    )


# --- errors ------------------------------------------------------------------------------------


def test_every_orchestrator_error_is_defined_in_errors_py():
    """A user catches what errors.py defines."""
    bases = {"OrchestratorError"}
    defined: list[tuple[str, str]] = []
    changed = True
    while changed:  # subclasses of subclasses, wherever they are
        changed = False
        for path in PACKAGE.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef) or node.name in bases:
                    continue
                if any(ast.unparse(b).split(".")[-1] in bases for b in node.bases):
                    bases.add(node.name)
                    defined.append((str(path.relative_to(PACKAGE)), node.name))
                    changed = True
    outside = sorted(d for d in defined if d[0] != "errors.py")
    assert outside == [], f"OrchestratorErrors defined outside orchestrator/errors.py: {outside}"
    assert all(hasattr(errors, name) for path, name in defined if path == "errors.py")


def exception_classes() -> dict[str, tuple[str, bool]]:
    """Every exception class the package defines: its module (relative to the package) and
    whether it is an OrchestratorError."""
    raised = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
              and issubclass(getattr(builtins, n), BaseException)}  # fmt: skip
    classes = {
        node.name: (
            str(path.relative_to(PACKAGE)),
            [ast.unparse(b).split(".")[-1] for b in node.bases],
        )
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    found: dict[str, tuple[str, bool]] = {}
    changed = True
    while changed:  # subclasses of subclasses
        changed = False
        for name, (where, bases) in classes.items():
            if name not in found and any(b in raised or b in found for b in bases):
                ours = name == "OrchestratorError" or any(
                    found.get(b, ("", False))[1] for b in bases
                )
                found[name], changed = (where, ours), True
    return found


def errors_paragraph() -> str:
    text = (DOCS / "architecture.md").read_text()
    start = text.index('<a id="errors"></a>')
    return text[start : text.index("\n\n", start)]


def test_the_errors_paragraph_names_every_error_a_user_can_catch():
    paragraph = errors_paragraph()
    users = paragraph[: paragraph.index("; the modules that raise them")]
    named = {s for s in code_spans(users) if "/" not in s}
    ours = {name for name, (_, mine) in exception_classes().items() if mine}
    assert named == ours, (
        f"docs/architecture.md#errors: not named: {sorted(ours - named)}; "
        f"named but not an OrchestratorError: {sorted(named - ours)}"
    )


def test_the_errors_paragraph_names_every_internal_exception_where_it_is_defined():
    """Each name stands before the module it is defined in: `A` and `B` (path.py, why)."""
    paragraph = errors_paragraph()
    start = paragraph.index("reach a user only as a job's cause or a")
    internal = paragraph[start : paragraph.index("`tests/test_docs_contract.py`", start)]
    documented: dict[str, str] = {}
    names: list[str] = []
    for m in re.finditer(r"\(([\w/]+\.py)[^)]*\)|`([^`]+)`", internal):
        if m.group(1):
            documented.update(dict.fromkeys(names, m.group(1)))
            names = []
        else:
            names.append(m.group(2))
    assert not names, f"named without their module: {names}"
    defined = {name: where for name, (where, mine) in exception_classes().items() if not mine}
    wrong = {n: (documented.get(n), defined.get(n)) for n in {*documented, *defined}
             if documented.get(n) != defined.get(n)}  # fmt: skip
    assert not wrong, f"docs/architecture.md#errors (documented, defined): {wrong}"


def test_the_python_api_row_lists_what_client_api_defines():
    (layers,) = [t for t in tables(section("architecture.md", "## Layers")) if len(t) > 20]
    (cell,) = [row[2] for row in layers if row[1] == "`client/api.py`"]
    public = {name for name, value in vars(api).items()
              if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
              and value.__module__ == api.__name__}  # fmt: skip
    listed = {s for s in code_spans(cell) if s != "orchestrator" and "/" not in s}
    assert listed == public, (
        f"not listed: {public - listed}; not in client/api.py: {listed - public}"
    )
    reexported = {s for s in code_spans(cell[: cell.index("(re-exported by")])}
    assert reexported == {n for n in public if getattr(orchestrator, n, None) is getattr(api, n)}


def test_the_push_walkthrough_headings_name_methods_that_exist():
    """`Class.method` in a heading of "A push, end to end", and a bare `_name` after one in the
    same heading (a method of that class): each is defined on that class."""
    classes = {
        node.name: {
            n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    text = section("architecture.md", "## A push, end to end")
    checked, missing = 0, []
    for heading in re.findall(r"^### .*$", text, re.M):
        owner = None
        for span in code_spans(heading):
            if "." in span and "/" not in span:
                owner, span = span.split(".", 1)
            elif owner is None or not span.startswith("_"):
                continue
            checked += 1
            if span not in classes.get(owner, set()):
                missing.append(f"{owner}.{span} ({heading})")
    assert checked >= 4 and not missing, f"{checked} method names checked; not defined: {missing}"
