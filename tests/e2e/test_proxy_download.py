"""Downloads behind nginx (deploy/nginx/trainyard.conf as shipped): the API checks who may have a
checkpoint, nginx sends the bytes (X-Accel-Redirect), with Range and the sha256 header intact."""

from __future__ import annotations

import grp
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from api_schemas.manifest import MODEL_FILE, write_manifest
from common.artifacts import ArtifactStore
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
    """(proxy URL, alice's and bob's tokens, alice's checkpoint id, the model's bytes). nginx's workers
    run as `nobody`, as a deployment's run as an account of their own (the nginx image's `nginx`):
    they read the checkpoint as a member of TRAINYARD_ARTIFACT_READER_GID's group (their 403 else:
    the service writes what only its own account reads)."""
    if not Path(NGINX).exists():
        missing = "nginx is missing (apt-get install nginx-light)"
        pytest.fail(f"CI=true: {missing}", pytrace=False) if IN_CI else pytest.skip(missing)
    # Outside pytest's tmp directory, which only its owner may pass through, as a volume is mounted.
    base = Path(tempfile.mkdtemp(prefix="trainyard-proxy-"))
    base.chmod(0o711)
    reader_gid = grp.getgrnam("nogroup").gr_gid
    settings = Settings(data_dir=base / "yard", artifact_reader_gid=reader_gid)
    settings.data_dir.mkdir()
    settings.data_dir.chmod(0o711)  # passable, as a volume's root is (whatever this process's umask: a server command sets 077)
    upgrade(settings.resolved_database_url)
    sessions = session_factory(settings.resolved_database_url)
    with sessions() as session:
        alice, alice_token = create_user(session, "alice")
        _, bob_token = create_user(session, "bob")
        job_id = create_job(session, alice, job_spec()).id
    claimed = start_job(settings, job_id)
    written = tmp_path / "written" / "step-00000012"  # by the training, then taken into the store as a worker does
    written.mkdir(parents=True)
    content = os.urandom(3 << 20)
    (written / MODEL_FILE).write_bytes(content)
    write_manifest(written, 12)
    umask = os.umask(0o077)  # the service's: what it makes, only its account may read
    try:
        relative, sha256, size = ArtifactStore(settings.resolved_artifact_root, reader_gid).ingest_checkpoint(written, job_id, 12)
    finally:
        os.umask(umask)
    with sessions() as session:
        record_checkpoint(session, job_id, claimed.attempt_id, 12, relative, sha256, size, keep_last=1)
        checkpoint_id = list_checkpoints(session, job_id)[-1].id

    api_port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINYARD_DATA_DIR": str(settings.data_dir), "TRAINYARD_DOWNLOAD_REDIRECT_PREFIX": "/_artifacts/"}
    api = subprocess.Popen([sys.executable, "-m", "trainyard", "api", "--port", str(api_port)], env=env, stderr=subprocess.DEVNULL)
    try:
        with nginx_in_front(api_port, settings.resolved_artifact_root, base / "nginx", free_port(), workers_user="nobody nogroup") as url:
            wait_healthy(url, [api])
            yield url, alice_token, bob_token, checkpoint_id, content
    finally:
        stop_children([api])
        shutil.rmtree(base, ignore_errors=True)


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
