"""input.path and output.path on S3: the 60-row job read from, checkpointed to, killed, resumed
and finished on a local S3 server (moto's server mode on loopback, started by the test)."""

from __future__ import annotations

import io
import json
import signal
import time

import pyarrow.parquet as pq
import pytest
from job_files import OPS_ROWS, ops_job, ops_reference, run_cli, start_cli

pytestmark = pytest.mark.slow  # the fast lane leaves it out (README: Run the tests)

moto_server = pytest.importorskip("moto.server", reason="pip install 'moto[server]'")
boto3 = pytest.importorskip("boto3")

BUCKET = "batchllm-test"
PARTS = "out/result.parquet.parts/"


@pytest.fixture(scope="module")
def s3():
    """(environment for batchllm processes, a boto3 client) of a fresh local S3 server."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}",
           "AWS_EC2_METADATA_DISABLED": "true"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    yield env, client
    server.stop()


def _keys(client, prefix: str) -> list[str]:
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in listing.get("Contents", []))


def _table(client, key: str):
    return pq.read_table(io.BytesIO(client.get_object(Bucket=BUCKET, Key=key)["Body"].read()))


def test_job_in_and_out_of_s3_killed_and_resumed(tmp_path, s3):
    env, client = s3
    job = ops_job(tmp_path, "run", input={"path": f"s3://{BUCKET}/in/prompts.parquet"},
                  output={"path": f"s3://{BUCKET}/out/result.parquet"})
    client.upload_file(str(tmp_path / "in.parquet"), BUCKET, "in/prompts.parquet")
    proc = start_cli("run", str(job), "--quiet", env=env)
    while proc.poll() is None and len(_keys(client, PARTS)) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err  # killed mid-run
    assert "locked on this machine only" in err
    parts = _keys(client, PARTS)
    assert _keys(client, "out/result.parquet") == parts  # no final object, no temporary one
    done = sum(_table(client, k).num_rows for k in parts)  # every part object is whole
    assert 0 < done < OPS_ROWS
    resumed = run_cli("run", str(job), "--quiet", "--set", "output.mode=resume", env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert _keys(client, "out/result.parquet") == [
        "out/result.parquet", "out/result.parquet.metrics.json"]  # parts removed at the end
    final, reference = _table(client, "out/result.parquet"), ops_reference()
    assert final.equals(reference)
    # the same metadata; the fingerprint names the input file by its own name (same contents)
    key = b"batchllm.fingerprint"
    ours, theirs = final.schema.metadata, reference.schema.metadata
    assert {k: v for k, v in ours.items() if k != key} == {
        k: v for k, v in theirs.items() if k != key}
    ours, theirs = json.loads(ours[key]), json.loads(theirs[key])
    assert [d for _, d in ours.pop("files")] == [d for _, d in theirs.pop("files")]
    assert ours == theirs
