"""No Docker engine runs here, so the deploy files are checked for agreement with the code instead:
they parse, name only settings that exist, and run only server commands that `trainyard` accepts."""

from __future__ import annotations

import ipaddress
import tomllib
from pathlib import Path

import yaml

from stack.cli import build_parser
from common.settings import Settings
from trainyard.cli import SERVER_COMMANDS

REPO = Path(__file__).resolve().parents[2]
TRAINYARD_IMAGES = {"trainyard:latest", "trainyard:gpu"}  # CPU torch, CUDA torch (see the Dockerfile)
SETTINGS_ENV = {f"TRAINYARD_{name.upper()}" for name in Settings.model_fields}


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def kubernetes() -> list[dict]:
    return [doc for doc in yaml.safe_load_all((REPO / "deploy/kubernetes/trainyard.yaml").read_text()) if doc]


def assert_cli_accepts(args: list[str]) -> None:
    args = [a.replace("$(NODE_NAME)", "node-1").replace("$(POD_IP)", "10.0.0.7") for a in args]
    assert args[0] in SERVER_COMMANDS, args  # what `trainyard` hands to the server's parser
    parsed = build_parser().parse_args(args)
    assert callable(parsed.func), args


def test_compose_services_run_real_commands_with_real_settings():
    services = compose()["services"]
    assert {"postgres", "redis", "api", "scheduler", "worker-cpu", "worker-gpu"} <= set(services)
    for name, service in services.items():
        if service.get("image") not in TRAINYARD_IMAGES:
            continue
        if "entrypoint" in service:  # a shell line of `trainyard …` commands
            for line in service["entrypoint"][-1].split("&&"):
                assert line.split()[0] == "trainyard", (name, line)
                assert_cli_accepts(line.split()[1:])
        else:
            assert_cli_accepts(service["command"])
        trainyard_env = {key for key in service["environment"] if key.startswith("TRAINYARD_")}
        assert trainyard_env <= SETTINGS_ENV, (name, trainyard_env - SETTINGS_ENV)
    # Worker hosts reach the service through its API with a token of their own: no database URL.
    for name in ("worker-cpu", "worker-gpu"):
        environment = services[name]["environment"]
        assert "TRAINYARD_DATABASE_URL" not in environment and environment["TRAINYARD_API_URL"].startswith("http://api:")
        host = services[name]["command"][services[name]["command"].index("--host-name") + 1]
        assert f"trainyard host token {host} --output {environment['TRAINYARD_HOST_TOKEN_FILE']}" in services["host-tokens"]["entrypoint"][-1]
    gpu = services["worker-gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    # `--devices cuda:all` needs CUDA torch: the GPU worker's image is built with a CUDA index, the others' not.
    assert gpu["image"] == "trainyard:gpu" and "/whl/cu" in gpu["build"]["args"]["TORCH_INDEX"]
    assert "TORCH_INDEX" in (REPO / "Dockerfile").read_text()
    for name, service in services.items():
        if service.get("image") == "trainyard:gpu":
            assert "cuda" in " ".join(service["command"]), name


def test_compose_proxy_serves_downloads_from_the_volume_the_api_redirects_into():
    services = compose()["services"]
    proxy, api = services["proxy"], services["api"]
    config = REPO / proxy["volumes"][0].split(":")[0]
    assert config == REPO / "deploy/nginx/trainyard.conf"  # the file tests/e2e/test_proxy_download.py runs
    text = config.read_text()
    prefix = api["environment"]["TRAINYARD_DOWNLOAD_REDIRECT_PREFIX"]
    assert f"location {prefix} {{" in text and f"alias {api['environment']['TRAINYARD_ARTIFACT_ROOT']}/;" in text
    assert "trainyard-data:/var/lib/trainyard:ro" in proxy["volumes"] and "ports" not in api  # clients go through the proxy
    assert "server api:8000;" in text and "8000" in api["command"]
    # nginx's workers (the image's `nginx` user, group 101) may read what the API redirects them to.
    assert proxy["image"].startswith("nginx:") and api["environment"]["TRAINYARD_ARTIFACT_READER_GID"] == "101"
    # The API takes the client's address from the proxy's X-Forwarded-For, and from it alone.
    allowed = api["command"][api["command"].index("--forwarded-allow-ips") + 1]
    assert allowed == proxy["networks"]["default"]["ipv4_address"]
    assert ipaddress.ip_address(allowed) in ipaddress.ip_network(compose()["networks"]["default"]["ipam"]["config"][0]["subnet"])


def test_kubernetes_manifests_run_real_commands_with_real_settings():
    docs = kubernetes()
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "DaemonSet", "Secret", "ConfigMap", "PersistentVolumeClaim", "Service", "Job"} <= kinds
    for doc in docs:
        if doc["kind"] in ("Secret", "ConfigMap"):
            data = doc.get("stringData") or doc.get("data")
            assert set(data) <= SETTINGS_ENV, set(data) - SETTINGS_ENV
        if doc["kind"] in ("Deployment", "DaemonSet", "Job"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                assert_cli_accepts(container["args"])
                # A worker of GPUs runs the image built with CUDA torch; everything else the CPU one.
                gpu = "cuda" in " ".join(container["args"])
                assert container["image"] == ("trainyard:gpu" if gpu else "trainyard:latest"), doc["metadata"]["name"]


def test_dockerfile_copies_every_package_the_project_installs():
    # Read from pyproject.toml, not listed here: a package added there (common/) and not to the
    # Dockerfile made an image where no role could start (ModuleNotFoundError: common).
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [pattern.rstrip("*") for pattern in include]
    assert set(packages) >= {"api_schemas", "common", "service", "workers", "trainyard", "stack"}
    dockerfile = (REPO / "Dockerfile").read_text()
    for package in [*packages, "data"]:
        assert f"COPY {package} {package}" in dockerfile


def test_the_shipped_deployments_give_the_service_no_superuser_and_a_redis_that_asks_for_a_password():
    # A job that reached the database logged in as superuser (compose's POSTGRES_USER is one) and made itself admin.
    services = compose()["services"]
    postgres, redis = services["postgres"], services["redis"]
    assert "POSTGRES_USER" not in postgres["environment"]  # the image's own `postgres` superuser, not the service's role
    database_url = services["api"]["environment"]["TRAINYARD_DATABASE_URL"]
    assert database_url.startswith("postgresql+psycopg://trainyard:${TRAINYARD_DB_PASSWORD:?")
    init = REPO / postgres["volumes"][1].split(":")[0]
    assert "NOSUPERUSER" in init.read_text() and "OWNER trainyard" in init.read_text()
    assert "--requirepass" in redis["command"] and "redis://:${TRAINYARD_REDIS_PASSWORD:?" in services["api"]["environment"]["TRAINYARD_BROKER_URL"]
    secrets = {doc["metadata"]["name"]: doc["stringData"] for doc in kubernetes() if doc["kind"] == "Secret"}
    assert all(secret["TRAINYARD_BROKER_URL"].startswith("redis://:") for secret in secrets.values())
    # A worker host holds no database URL: the API's address, and its own token from a file.
    [worker] = [doc for doc in kubernetes() if doc["kind"] == "DaemonSet"]
    [container] = worker["spec"]["template"]["spec"]["containers"]
    sources = [source["secretRef"]["name"] for source in container["envFrom"] if "secretRef" in source]
    assert sources == ["trainyard-worker"] and "TRAINYARD_DATABASE_URL" not in secrets["trainyard-worker"]
    assert {"name": "TRAINYARD_HOST_TOKEN_FILE", "value": "/etc/trainyard/host-tokens/$(NODE_NAME)"} in container["env"]
    assert "NOSUPERUSER" in (REPO / "deploy/kubernetes/trainyard.yaml").read_text()
