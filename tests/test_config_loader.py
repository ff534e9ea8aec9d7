"""Loading config.py: finding its one project, sibling imports, errors that point at the fix."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator import definitions
from orchestrator.client.config_loader import load_config, validate_project
from orchestrator.errors import ConfigError

HEADER = "from orchestrator import definitions as d\n"
JOB = 'd.TrainingJob(image=d.Image(base_image="python:3.11"))'


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def write_config(directory: Path, body: str, name: str = "config.py") -> Path:
    return write(directory / name, HEADER + textwrap.dedent(body))


def project_line(var: str = "project", name: str = "demo", *, name_expr: str = "") -> str:
    """A module-level project; `name_expr` is Python code for the name (default: `name`)."""
    return f"{var} = d.TrainingProject(name={name_expr or repr(name)}, job={JOB})\n"


def load_error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value


# --- the path --------------------------------------------------------------------------------


def test_missing_path_is_a_config_error(tmp_path: Path) -> None:
    error = load_error(tmp_path / "nope" / "config.py")

    assert "nope/config.py" in str(error)
    assert "python file" in str(error)


def test_directory_is_a_config_error(tmp_path: Path) -> None:
    write_config(tmp_path, project_line())

    assert "python file" in str(load_error(tmp_path))


def test_non_python_file_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path / "config.yaml", "name: demo\n")

    assert "config.yaml" in str(load_error(path))


def test_relative_and_home_paths_are_resolved(tmp_path: Path, monkeypatch) -> None:
    write_config(tmp_path / "proj", project_line())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))

    for path in ("proj/config.py", "~/proj/config.py"):
        loaded = load_config(path)

        assert loaded.config_path == (tmp_path / "proj" / "config.py").resolve()
        assert loaded.source_dir == (tmp_path / "proj").resolve()


# --- finding the project ---------------------------------------------------------------------


def test_config_without_project_names_the_fix(tmp_path: Path) -> None:
    path = write_config(tmp_path, f"job = {JOB}\n")

    error = load_error(path)

    assert "defines no TrainingProject" in str(error)
    assert "project = TrainingProject(" in str(error)


def test_two_projects_are_refused_naming_both_variables(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, project_line("sft_project", "a") + project_line("dpo_project", "b")
    )

    error = load_error(path)

    assert "2 TrainingProjects (sft_project; dpo_project)" in str(error)
    assert "keep exactly one" in str(error)


def test_same_project_under_two_names_is_one_project(tmp_path: Path) -> None:
    path = write_config(tmp_path, project_line("project", "demo") + "alias = project\n")

    assert load_config(path).project.name == "demo"


def test_project_imported_from_a_sibling_module_counts(tmp_path: Path) -> None:
    write(tmp_path / "jobs.py", HEADER + project_line("shared_project", "from-sibling"))
    path = write_config(tmp_path, "from jobs import shared_project\n")

    assert load_config(path).project.name == "from-sibling"


def test_non_project_value_is_refused_by_validate_project() -> None:
    with pytest.raises(ConfigError, match="expected a TrainingProject, got dict"):
        validate_project({"name": "demo"})


# --- sibling imports -------------------------------------------------------------------------


def test_sibling_import_works_from_another_working_directory(tmp_path: Path, monkeypatch) -> None:
    write(tmp_path / "proj" / "team_settings.py", 'PROJECT = "from-settings"\n')
    path = write_config(
        tmp_path / "proj",
        "import team_settings\n" + project_line(name_expr="team_settings.PROJECT"),
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    assert load_config(path).project.name == "from-settings"


def test_sibling_package_import_works(tmp_path: Path) -> None:
    write(tmp_path / "lib" / "__init__.py", "")
    write(tmp_path / "lib" / "names.py", 'NAME = "from-package"\n')
    path = write_config(tmp_path, "from lib.names import NAME\n" + project_line(name_expr="NAME"))

    assert load_config(path).project.name == "from-package"
    assert "lib" not in sys.modules and "lib.names" not in sys.modules


def test_configs_in_different_dirs_each_get_their_own_helper(tmp_path: Path) -> None:
    paths = {}
    for team in ("alpha", "beta"):
        write(tmp_path / team / "helper.py", f'NAME = "{team}-project"\n')
        body = "import helper\n" + project_line(name_expr="helper.NAME")
        paths[team] = write_config(tmp_path / team, body)

    names = [load_config(paths[t]).project.name for t in ("alpha", "beta", "alpha")]

    assert names == ["alpha-project", "beta-project", "alpha-project"]
    assert "helper" not in sys.modules


def test_edited_helper_is_reread_on_the_next_load(tmp_path: Path) -> None:
    helper = write(tmp_path / "helper.py", 'NAME = "before"\n')
    path = write_config(tmp_path, "import helper\n" + project_line(name_expr="helper.NAME"))
    assert load_config(path).project.name == "before"

    helper.write_text('NAME = "after"\n')

    assert load_config(path).project.name == "after"


def test_namespace_package_next_to_config_does_not_leak(tmp_path: Path) -> None:
    paths = {}
    for team in ("alpha", "beta"):
        write(tmp_path / team / "scripts" / "names.py", f'NAME = "{team}-project"\n')
        body = "from scripts import names\n" + project_line(name_expr="names.NAME")
        paths[team] = write_config(tmp_path / team, body)

    names = [load_config(paths[t]).project.name for t in ("alpha", "beta")]

    assert names == ["alpha-project", "beta-project"]
    assert "scripts" not in sys.modules


def test_sys_path_and_modules_are_restored_after_success_and_failure(tmp_path: Path) -> None:
    good = write_config(tmp_path / "good", "import helper\n" + project_line())
    write(tmp_path / "good" / "helper.py", "")
    bad = write_config(tmp_path / "bad", "import helper\nraise RuntimeError('boom')\n")
    write(tmp_path / "bad" / "helper.py", "")
    path_before = list(sys.path)

    load_config(good)
    load_error(bad)

    assert sys.path == path_before
    left = [
        name
        for name, module in list(sys.modules.items())
        if str(tmp_path) in (getattr(module, "__file__", None) or "")
    ]
    assert left == []  # neither the configs nor their helpers


# --- errors while running the config ---------------------------------------------------------


def test_exception_in_config_names_line_and_exception(tmp_path: Path) -> None:
    path = write_config(tmp_path, "x = 1\nraise RuntimeError('dataset path not set')\n")

    message = str(load_error(path))

    assert "config.py line 3" in message  # line 1 is the import
    assert "RuntimeError: dataset path not set" in message


def test_exception_in_a_function_points_at_the_raising_line(tmp_path: Path) -> None:
    body = """\
        def gpus():
            return {}["count"]

        n = gpus()
    """
    message = str(load_error(write_config(tmp_path, body)))

    assert "line 3" in message
    assert "KeyError" in message


def test_syntax_error_names_the_line(tmp_path: Path) -> None:
    message = str(load_error(write_config(tmp_path, "x = 1\nproject = (\n")))

    assert "SyntaxError" in message
    assert "line 3" in message


def test_missing_module_is_named(tmp_path: Path) -> None:
    message = str(load_error(write_config(tmp_path, "import not_installed_anywhere\n")))

    assert "ModuleNotFoundError" in message
    assert "not_installed_anywhere" in message


def test_sys_exit_in_config_does_not_exit_the_caller(tmp_path: Path) -> None:
    message = str(load_error(write_config(tmp_path, "import sys\nsys.exit(2)\n")))

    assert "line 3 called sys.exit(2) while loading" in message


def test_invalid_model_in_config_names_the_field(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """\
        job = d.TrainingJob(
            image=d.Image(base_image="python:3.11"), compute=d.Compute(node_count=0)
        )
        """,
    )

    error = load_error(path)

    assert "config.py line 3" in str(error)
    assert any(p.startswith("Compute.node_count:") for p in error.problems), error.problems
    assert "node_count" in str(error)


def test_invalid_model_in_sibling_module_names_the_field(tmp_path: Path) -> None:
    write(tmp_path / "compute.py", HEADER + "COMPUTE = d.Compute(cpu_count=1.5)\n")
    path = write_config(tmp_path, "from compute import COMPUTE\n")

    error = load_error(path)

    assert any(p.startswith("Compute.cpu_count:") for p in error.problems), error.problems


def test_several_problems_are_all_reported(tmp_path: Path) -> None:
    path = write_config(tmp_path, "c = d.Compute(node_count=0, cpu_count=0, memory='lots')\n")

    problems = load_error(path).problems

    assert {p.split(":")[0] for p in problems} == {
        "Compute.node_count",
        "Compute.cpu_count",
        "Compute.memory",
    }


# --- edits after construction are validated too ----------------------------------------------


def test_duplicate_mount_appended_after_construction_is_caught(tmp_path: Path) -> None:
    body = project_line() + textwrap.dedent("""\
        for source in ("hf://org/model", "s3://bucket/model"):
            project.job.weights.append(
                d.WeightsSource(source=source, mount_location="/app/model")
            )
    """)
    error = load_error(write_config(tmp_path, body))

    assert "invalid" in str(error)
    assert [p.split(":")[0] for p in error.problems] == ["job.weights[1].mount_location"]
    assert "/app/model" in error.problems[0]


# Also prints pydantic's "serializer warnings" before the ConfigError (see the report on it).
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_wrong_type_assigned_into_env_dict_is_caught(tmp_path: Path) -> None:
    body = project_line() + "project.job.runtime.environment_variables['EPOCHS'] = 3\n"

    problems = load_error(write_config(tmp_path, body)).problems

    assert [p.split(":")[0] for p in problems] == ["job.runtime.environment_variables.EPOCHS"]


def test_invalid_assignment_fails_at_the_assignment(tmp_path: Path) -> None:
    body = project_line() + "project.job.compute.node_count = -1\n"

    error = load_error(write_config(tmp_path, body))

    assert "line 3" in str(error)
    assert any("node_count" in p for p in error.problems)


def test_unserializable_value_put_in_after_construction_is_a_config_error(
    tmp_path: Path,
) -> None:
    body = project_line() + "project.job.runtime.environment_variables['HF'] = d.SecretReference\n"

    problems = load_error(write_config(tmp_path, body)).problems

    assert [p.split(":")[0] for p in problems] == ["job.runtime.environment_variables.HF"]


def test_valid_edits_after_construction_are_kept(tmp_path: Path) -> None:
    body = project_line() + "project.job.runtime.start_commands.append('python train.py')\n"

    project = load_config(write_config(tmp_path, body)).project

    assert isinstance(project, definitions.TrainingProject)
    assert project.job.runtime.start_commands == ["python train.py"]


def test_config_rewritten_within_the_same_second_is_reread(tmp_path: Path, monkeypatch) -> None:
    # A sweep script that templates config.py and pushes each variant in a loop.
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path = write_config(tmp_path, project_line(name="lr-1e-4"))
    stamp = path.stat().st_mtime_ns
    assert load_config(path).project.name == "lr-1e-4"

    path.write_text(path.read_text().replace("lr-1e-4", "lr-3e-4"))
    os.utime(path, ns=(stamp, stamp))

    assert load_config(path).project.name == "lr-3e-4"
