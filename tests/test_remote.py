"""The SSH runner (issue 7) against a REAL sshd started on 127.0.0.1 by these tests.

The fixture generates a host key and a user key in a temporary folder, writes an sshd
config (key-only, loopback, a free port) and runs Debian's ``/usr/sbin/sshd -D`` as the
current user; it stops it afterwards. The "device" runs edgekit's own CPU path with the
same Python environment. Skipped where openssh-server is not installed.
"""
from __future__ import annotations

import getpass
import importlib.util
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgekit.errors import BadInputError, UnavailableError
from edgekit.remote import remote_build, remote_profile
from edgekit.runtimes.tensorrt.device import require_remote_tensorrt
from edgekit.ssh import RemoteHost

SSHD = "/usr/sbin/sshd"
pytestmark = pytest.mark.ssh


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    if not (os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen")):
        pytest.skip("openssh-server / openssh-client not installed (apt-get install openssh-server)")
    d = tmp_path_factory.mktemp("sshd")
    if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
        try:  # sshd running as root wants its privilege-separation folder
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        except OSError as e:
            pytest.skip(f"cannot create /run/sshd: {e}")
    for name in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "id.pub", d / "authorized_keys")
    os.chmod(d / "authorized_keys", 0o600)
    port = _free_port()
    (d / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {d / 'host_key'}
AuthorizedKeysFile {d / 'authorized_keys'}
PidFile {d / 'sshd.pid'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
LogLevel ERROR
""")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=subprocess.DEVNULL,
                            stderr=open(d / "sshd.log", "wb"))
    try:
        deadline = time.time() + 10
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.skip(f"sshd exited: {(d / 'sshd.log').read_text()[-300:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        else:
            pytest.skip("sshd did not start listening")
        yield {"dir": d, "port": port, "user": getpass.getuser()}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _edgekit_cmd() -> str:
    """The "device" runs this checkout's edgekit (sshd gives the command a fresh environment)."""
    repo = Path(__file__).resolve().parents[1]
    return f"env PYTHONPATH={shlex.quote(str(repo))} {shlex.quote(sys.executable)} -m edgekit.cli"


def _host(sshd, **kw) -> RemoteHost:
    d = sshd["dir"]
    return RemoteHost(f"{sshd['user']}@127.0.0.1", port=kw.pop("port", sshd["port"]), identity=str(d / "id"),
                      ssh_options=["StrictHostKeyChecking=no", f"UserKnownHostsFile={d / 'known_hosts'}",
                                   "LogLevel=ERROR"], edgekit=_edgekit_cmd(), **kw)


def test_remote_build_and_profile_cpu_path(sshd, tiny_onnx, tmp_path):
    from edgekit.artifact import read_manifest, sha256_file

    host = _host(sshd)
    out = remote_build(str(tiny_onnx), "cpu", tmp_path / "engine", host, threads=1)
    m = read_manifest(out)
    assert m.kind == "engine" and m.config["runtime"] == "onnxruntime" and m.target == "cpu"
    assert (out / m.files["model"]).is_file()
    # the uploaded input is the file we have: its hash is recorded by the device's build
    assert m.inputs["model"]["sha256"] == sha256_file(tiny_onnx)
    result = remote_profile(out, host, json_out=tmp_path / "p.json",
                            extra_args=["--warmup-ms", "10", "--duration-s", "0.2", "--iterations", "10"])
    assert result.settings["remote"] == host.spec and result.latency_ms.count >= 10
    assert result.runtime == "onnxruntime" and (tmp_path / "p.json").is_file()


def test_remote_errors(sshd, tmp_path):
    host = _host(sshd)
    unreachable = _host(sshd, port=_free_port(), connect_timeout=3)
    with pytest.raises(UnavailableError, match="is unreachable: .*Connection refused") as e:
        unreachable.check_reachable()
    assert e.value.exit_code == 2
    with pytest.raises(UnavailableError, match="command timed out after 1 s"):
        host.run("sleep 5", timeout=1)
    with pytest.raises(UnavailableError, match="lacks TensorRT"):
        require_remote_tensorrt(host)
    with pytest.raises(BadInputError, match=r"on .*@127.0.0.1: unknown target 'no-such-board'"):
        remote_build("efficientnet-lite0", "no-such-board", tmp_path / "x", host)
    assert not (tmp_path / "x").exists()  # nothing half-written
    with pytest.raises(BadInputError, match="bad remote"):
        RemoteHost("-oProxyCommand=evil")


def test_remote_trtexec_path_with_fake_trtexec(sshd, tmp_path, monkeypatch):
    """``--remote``: trtexec runs on the device over SSH (here a FAKE trtexec on the loopback
    "device"); the engine and JSON come back sha256-verified and profile like any engine."""
    spec = importlib.util.spec_from_file_location("_ek_test_tensorrt", Path(__file__).parent / "runtimes" / "tensorrt" / "test_runtime.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    from edgekit.artifact import read_manifest
    from edgekit.build import build_engine
    from edgekit.profiling import profile_engine
    from edgekit.runtimes.base import BuildOptions

    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    fake = helpers._fake_trtexec(tmp_path)
    onnx_path = helpers._cnn_onnx(tmp_path / "m.onnx")  # the graph the fake's exports describe
    d = sshd["dir"]
    extra = {"remote": f"{sshd['user']}@127.0.0.1", "ssh_port": sshd["port"], "ssh_identity": str(d / "id"),
             "ssh_options": ["StrictHostKeyChecking=no", f"UserKnownHostsFile={d / 'known_hosts'}", "LogLevel=ERROR"],
             "trtexec": str(fake)}
    out = build_engine(onnx_path, "h100-sxm", tmp_path / "e", BuildOptions("fp16", extra=extra))
    m = read_manifest(out)
    assert m.config["path"] == "trtexec" and m.metrics["remote"] == extra["remote"]
    assert m.metrics["verified_sha256"] is True and "model.plan" in m.metrics["fetched"]
    assert m.config["device"]["tensorrt_version"] == "10.3.0"  # from the fake's banner, over SSH
    assert (out / "model.plan").read_bytes().startswith(b"FAKE-PLAN")
    r = profile_engine(out)
    assert r.source == "trtexec" and r.quantized_nodes == 3
    # the loopback "device" has no GPU to probe: the results' GPU is not recorded, so they stay unverified
    assert r.provenance is not None and r.provenance.status == "unverified"
    assert r.provenance.reasons[0].startswith("the GPU and its SM are not recorded")
    # a device without trtexec: a clear error
    with pytest.raises(UnavailableError, match="has no TensorRT"):
        build_engine(onnx_path, "h100-sxm", tmp_path / "e2",
                     BuildOptions("fp16", extra={**extra, "trtexec": "/nonexistent/trtexec"}))
