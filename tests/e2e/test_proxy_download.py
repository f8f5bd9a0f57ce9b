"""Downloads behind nginx (deploy/nginx/trainyard.conf as shipped): the API checks who may have a
checkpoint, nginx sends the bytes (X-Accel-Redirect), with Range and the sha256 header intact."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from api_schemas.manifest import MODEL_FILE
from service.db.accounts import create_user
from service.db.checkpoints import list_checkpoints, record_checkpoint
from service.db.jobs import create_job
from service.db.migrate import upgrade
from service.db.session import session_factory
from stack.embedded import stop_children, wait_healthy
from common.settings import Settings
from tests.conftest import IN_CI
from tests.helpers import job_spec, start_job
from tests.nginx import NGINX, REPO, nginx_in_front
from trainyard.client import Client
from workers.supervisor import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def proxied(tmp_path):
    """(proxy URL, alice's and bob's tokens, alice's checkpoint id, the model's bytes)."""
    if not Path(NGINX).exists():
        missing = "nginx is missing (apt-get install nginx-light)"
        pytest.fail(f"CI=true: {missing}", pytrace=False) if IN_CI else pytest.skip(missing)
    settings = Settings(data_dir=tmp_path / "yard")
    settings.data_dir.mkdir()
    upgrade(settings.resolved_database_url)
    sessions = session_factory(settings.resolved_database_url)
    with sessions() as session:
        alice, alice_token = create_user(session, "alice")
        _, bob_token = create_user(session, "bob")
        job_id = create_job(session, alice, job_spec()).id
    claimed = start_job(settings, job_id)
    relative = f"jobs/{job_id}/checkpoints/step-00000012"
    model = settings.resolved_artifact_root / relative / MODEL_FILE
    model.parent.mkdir(parents=True)
    content = os.urandom(3 << 20)
    model.write_bytes(content)
    with sessions() as session:
        sha256 = hashlib.sha256(content).hexdigest()
        record_checkpoint(session, job_id, claimed.attempt_id, 12, relative, sha256, len(content), keep_last=1)
        checkpoint_id = list_checkpoints(session, job_id)[-1].id

    api_port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINYARD_DATA_DIR": str(settings.data_dir), "TRAINYARD_DOWNLOAD_REDIRECT_PREFIX": "/_artifacts/"}
    api = subprocess.Popen([sys.executable, "-m", "trainyard", "api", "--port", str(api_port)], env=env, stderr=subprocess.DEVNULL)
    try:
        with nginx_in_front(api_port, settings.resolved_artifact_root, tmp_path / "nginx", free_port()) as url:
            wait_healthy(url, [api])
            yield url, alice_token, bob_token, checkpoint_id, content
    finally:
        stop_children([api])


def test_nginx_sends_the_checkpoint_the_api_allowed_with_range_and_sha256(proxied, tmp_path):
    url, alice, bob, checkpoint_id, content = proxied
    download = f"/v1/checkpoints/{checkpoint_id}/download"
    with httpx.Client(base_url=url, timeout=30) as http:
        whole = http.get(download, headers={"Authorization": f"Bearer {alice}"})
        assert whole.status_code == 200 and whole.content == content
        assert whole.headers["X-Checkpoint-SHA256"] == hashlib.sha256(content).hexdigest()
        [disposition] = whole.headers.get_list("Content-Disposition")
        assert disposition.endswith('-step12.safetensors"')

        part = http.get(download, headers={"Authorization": f"Bearer {alice}", "Range": "bytes=1000-1999"})
        assert part.status_code == 206 and part.content == content[1000:2000]

        # Still the API's decision: no token, someone else's checkpoint, or the file's own URL.
        assert http.get(download).status_code == 401
        assert http.get(download, headers={"Authorization": f"Bearer {bob}"}).status_code == 404
        relative = f"/_artifacts/jobs/1/checkpoints/step-00000012/{MODEL_FILE}"
        assert http.get(relative, headers={"Authorization": f"Bearer {alice}"}).status_code == 404

    # The SDK's verified, resumable download works through the proxy, resuming a partial file.
    dest = tmp_path / "model.safetensors"
    dest.with_name(dest.name + ".part").write_bytes(content[: 1 << 20])
    with Client(url, alice) as client:
        client.download(checkpoint_id, dest)
    assert dest.read_bytes() == content
