"""The tiny `opd run` of tests/test_run.py with its store on an S3-compatible server (moto on 127.0.0.1).

Every stage process reaches the server through `store.s3_endpoint` in the
configuration and the AWS_* credentials in its environment (no AWS_ENDPOINT_URL):
nothing is written to a local store, and the checks read everything back over S3.
The chaos driver's S3 run is `tests/chaos/test_chaos.py::test_kill_anything_on_an_s3_store`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from opd_cache.storage.store import Store
from tests.test_run import assert_tiny_run_finished, exit_codes, tiny_config

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_run(tmp_path_factory, s3_endpoint):
    tmp = tmp_path_factory.mktemp("s3run")
    bucket = f"opdrun{int(time.time() * 1000) % 10**8}"
    uri = f"s3://{bucket}/run"
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    env.update(CREDENTIALS)
    patch = pytest.MonkeyPatch()  # the Store of this process (the checks) needs the credentials too
    for key, value in CREDENTIALS.items():
        patch.setenv(key, value)
    Store(uri, s3_endpoint=s3_endpoint).fs.create_dir(bucket)
    config_path = tiny_config(tmp, store={"uri": uri, "s3_endpoint": s3_endpoint})
    cmd = [sys.executable, "-m", "opd_cache.cli", "run", "--config", str(config_path), "--quiet"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp, env=env)
    yield tmp, Store(uri, s3_endpoint=s3_endpoint), out
    patch.undo()


def test_opd_run_on_s3_completes_and_the_store_holds_shards_versions_and_ledger(s3_run):
    tmp, store, out = s3_run
    assert out.returncode == 0, out.stderr + str(exit_codes(tmp / "opd-logs"))
    assert not (tmp / "store").exists(), "nothing may be written to a local store"
    assert_tiny_run_finished(store)  # read back over S3


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_write_that_fails_half_way_publishes_nothing(where, request):
    """Closing an S3 output stream completes the upload with what was written so far, even after an exception
    (a second Ctrl-C in `opd rollout`, an error half-way): the store must keep the previous object, or none."""
    store = request.getfixturevalue("local_store" if where == "local" else "s3_store")
    store.write_bytes("rollouts/old.arrow", b"complete")

    def half(out):
        out.write(b"half of a shard")
        raise KeyboardInterrupt

    for rel in ("rollouts/old.arrow", "rollouts/new.arrow"):
        with pytest.raises(KeyboardInterrupt):
            store.write_atomic(rel, half)
    assert store.read_bytes("rollouts/old.arrow") == b"complete"
    assert not store.exists("rollouts/new.arrow")
    assert [i.base_name for i in store.list_files("rollouts")] == ["old.arrow"]
