"""Architecture boundaries, checked in a fresh interpreter so other tests' imports don't mask a leak,
and for the client also in its source, so that an import inside a function is caught too."""

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = {path.parent.name for path in REPO.glob("*/*.py")}  # api_schemas, service, workers, trainyard, tests, …
CLIENT_FILES = sorted((REPO / "trainyard").rglob("*.py"))
WORKER_FILES = sorted((REPO / "workers").rglob("*.py"))
COMMON_FILES = sorted((REPO / "common").rglob("*.py"))


@functools.cache  # one fresh interpreter per set of modules, however many tests ask
def modules_after_import(*modules: str) -> set[str]:
    code = f"import json, sys, {', '.join(modules)}; print(json.dumps(sorted(sys.modules)))"
    return set(json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout))


def imported_modules(path: Path) -> set[str]:
    """Every module the file imports absolutely, wherever in the file (function-level imports too);
    `from a.b import c` counts as a.b.c, which is a module or a name in a.b."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:  # a relative import stays in its own package
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    return imported


def project_imports(path: Path) -> set[str]:
    return {name for name in imported_modules(path) if name.split(".")[0] in PROJECT_PACKAGES}


@pytest.mark.parametrize("module", ["service.api.main", "service.scheduler", "stack.cli", "stack.demo"])
def test_the_service_never_imports_torch_or_accelerate(module):
    loaded = modules_after_import(module)
    assert "torch" not in loaded and "accelerate" not in loaded


@pytest.mark.parametrize("module", ["service.api.main", "service.scheduler"])
def test_optuna_is_loaded_by_a_sweeps_first_pass_not_at_every_start(module):
    # ~0.4 s of CPU at every API and scheduler start (service/sweeps.py `_optuna`).
    assert "optuna" not in modules_after_import(module)


def test_the_client_source_is_found():
    assert {"cli.py", "client.py", "client_cli.py", "progress.py"} <= {path.name for path in CLIENT_FILES}


@pytest.mark.parametrize("path", CLIENT_FILES, ids=lambda path: path.name)
def test_the_client_imports_only_api_schemas_itself_and_third_party_libraries(path):
    project = {name.split(".")[0] for name in project_imports(path)}
    assert project <= {"api_schemas", "trainyard"}, f"trainyard/{path.name} imports {sorted(project - {'api_schemas', 'trainyard'})}"


def test_importing_the_client_loads_neither_the_server_nor_torch():
    loaded = {name.split(".")[0] for name in modules_after_import("trainyard.cli", "trainyard.client")}
    assert "trainyard" in loaded and not loaded & {"service", "workers", "torch", "sqlalchemy"}


@pytest.mark.parametrize("path", WORKER_FILES, ids=lambda path: str(path.relative_to(REPO / "workers")))
def test_the_workers_import_nothing_of_the_service(path):
    # They reach it through its HTTP API (workers/host_client.py); what both sides run is common/'s.
    service = sorted(name for name in project_imports(path) if name.split(".")[0] in ("service", "stack", "trainyard"))
    assert not service, f"workers/{path.name} imports {service}"


@pytest.mark.parametrize("path", COMMON_FILES, ids=lambda path: str(path.relative_to(REPO / "common")))
def test_what_both_sides_share_imports_only_the_contract(path):
    others = sorted(name for name in project_imports(path) if name.split(".")[0] not in ("api_schemas", "common"))
    assert not others, f"common/{path.name} imports {others}"


def test_a_worker_host_loads_no_service_code_nor_database_library():
    loaded = modules_after_import("workers.host", "workers.supervisor", "workers.slurm_agent")
    assert "sqlalchemy" not in loaded and not any(name.split(".")[0] in ("service", "stack") for name in loaded)


SERVICE_FILES = sorted((REPO / "service").rglob("*.py"))


@pytest.mark.parametrize("path", SERVICE_FILES, ids=lambda path: str(path.relative_to(REPO / "service")))
def test_the_service_imports_neither_the_workers_nor_the_client(path):
    # What starts the parts together is stack/, above all three: every arrow runs one way.
    assert not {name.split(".")[0] for name in project_imports(path)} & {"workers", "trainyard", "stack"}


def test_nothing_imports_the_stack_that_starts_it():
    for package in ("api_schemas", "service", "workers", "trainyard"):
        for path in (REPO / package).rglob("*.py"):
            assert not any(name.split(".")[0] == "stack" for name in project_imports(path)), path


def test_api_schemas_import_nothing_of_the_project():
    loaded = modules_after_import("api_schemas")
    assert not any(name.split(".")[0] in ("service", "workers", "trainyard") for name in loaded)


def test_the_training_loop_knows_nothing_of_the_database_or_http():
    loaded = modules_after_import("workers.training")
    assert not any(name.split(".")[0] in ("service", "sqlalchemy", "httpx", "fastapi", "celery") for name in loaded)


def test_checking_a_saved_dataset_at_submit_loads_neither_torch_nor_transformers(tmp_path):
    pytest.importorskip("datasets")
    code = f"""
import json, sys
import datasets
datasets.disable_progress_bars()
datasets.Dataset.from_dict({{"text": ["a", "b"], "label": [0, 1]}}).save_to_disk({str(tmp_path / "saved")!r})
from service.datasets import check_disk_dataset
from pathlib import Path
check_disk_dataset(Path({str(tmp_path)!r}), "saved", None, "text", "label", "classify", 2)
print(json.dumps(sorted(sys.modules)))
"""
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout))
    assert "datasets" in loaded and "torch" not in loaded and "transformers" not in loaded



@pytest.mark.parametrize("path", sorted((REPO / "service" / "db").glob("*.py")), ids=lambda path: path.name)
def test_the_data_layer_imports_only_api_schemas_and_itself(path):
    # service/db/__init__.py says why: nothing in the data layer reaches up to the API, the scheduler or the workers.
    assert {name for name in project_imports(path) if not name.startswith(("api_schemas", "service.db."))} == set()


@pytest.mark.parametrize("path", sorted((REPO / "service" / "migrations" / "versions").glob("*.py")), ids=lambda path: path.name)
def test_a_migration_imports_no_project_code(path):
    # A migration must do at its revision what it did when written, whatever the live code becomes.
    assert project_imports(path) == set()
