"""The SSH transport against a hostile device and hostile data, over a LOCAL transport: a fake
``ssh`` on PATH that runs the remote command here with bash (what sshd would run on the
device), so these tests need no sshd and run everywhere. The "device" runs a fake edgekit
that plants what a compromised device could send back: FIFOs, devices, links, paths that
escape, more data than the disk holds. ``tests/test_remote.py`` runs the same code against
a real loopback sshd.
"""
from __future__ import annotations

import json
import os
import stat
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgekit.cli import cli
from edgekit.errors import BadInputError, UnavailableError
from edgekit.remote import remote_build
from edgekit.ssh import SSH_OPTIONS_FROM_DATA, RemoteHost, check_data_options, check_destination


def fake_edgekit(tmp_path: Path, plant: str) -> Path:
    """A device-side 'edgekit' whose ``build ... -o OUT`` writes an engine folder and ``plant``
    (shell commands run inside OUT)."""
    script = tmp_path / "device-edgekit"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        set -e
        out=""
        while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; shift; fi; shift; done
        mkdir -p "$out" && cd "$out"
        printf 'plan' > model.plan
        printf '{json.dumps({"kind": "engine", "files": {"model": "model.plan"}})}' > manifest.json
        {plant}
        """))
    script.chmod(0o755)
    return script


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def test_the_local_transport_fetches_a_clean_engine(local_ssh: Path, tmp_path: Path, tiny_onnx: Path) -> None:
    """The baseline the hostile cases differ from: a well-behaved device's folder arrives whole."""
    host = RemoteHost("me@device", edgekit=str(fake_edgekit(tmp_path, "mkdir -p results && echo 1 > results/t.json")))
    out = remote_build(str(tiny_onnx), "cpu", tmp_path / "engine", host)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.plan", "results"]
    assert (out / "results" / "t.json").read_text() == "1\n"
    assert json.loads((out / "manifest.json").read_text())["contents"] == ["manifest.json", "model.plan", "results"]


@pytest.mark.parametrize("plant, refused", [
    ("mkfifo pipe", "refusing FIFO 'pipe'"),
    ("mknod tty c 5 0", "refusing character device 'tty'"),
    ("ln -s /etc/passwd passwd", "refusing symbolic link 'passwd'"),
    ("printf x > a && ln a b", "refusing hard link '[ab]'"),
])
def test_a_device_cannot_plant_special_files_in_the_output(local_ssh: Path, tmp_path: Path, tiny_onnx: Path,
                                                          plant: str, refused: str) -> None:
    """`remote build --remote-edgekit X` fetched a character device and a FIFO into the local
    output: downloads now accept regular files and folders only; nothing is left behind."""
    if plant.startswith("mknod") and os.geteuid() != 0:
        pytest.skip("mknod needs root (CAP_MKNOD)")
    host = RemoteHost("me@device", edgekit=str(fake_edgekit(tmp_path, plant)))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(UnavailableError, match=rf"remote me@device: {refused} in the transfer") as e:
        remote_build(str(tiny_onnx), "cpu", tmp_path / "engine", host)
    assert e.value.exit_code == 2
    assert sorted(os.listdir(tmp_path)) == before  # no output, no staging folder


def test_the_cli_reports_a_planted_fifo_in_one_line(local_ssh: Path, tmp_path: Path, tiny_onnx: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    device = fake_edgekit(tmp_path, "mkfifo pipe")
    r = CliRunner().invoke(cli, ["remote", "build", str(tiny_onnx), "--target", "cpu", "-o", "engine",
                                 "--host", "me@device", "--remote-edgekit", str(device)])
    assert r.exit_code == 2, r.output
    assert one_line(r.stderr) == ("error: remote me@device: refusing FIFO 'pipe' in the transfer (only regular "
                                  "files and folders are accepted)")
    assert not (tmp_path / "engine").exists()


def test_a_device_cannot_send_more_than_the_disk_holds(local_ssh: Path, tmp_path: Path, tiny_onnx: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The transfer streams to disk (never whole into memory) and stops at the free space."""
    import edgekit.ssh as ssh

    monkeypatch.setattr(ssh, "free_space", lambda path: (Path(path), 64 * 1024))
    host = RemoteHost("me@device", edgekit=str(fake_edgekit(tmp_path, "head -c 200000 /dev/zero > big")))
    with pytest.raises(UnavailableError, match=r"the transfer is larger than the 64 KiB free in"):
        remote_build(str(tiny_onnx), "cpu", tmp_path / "engine", host)
    assert not (tmp_path / "engine").exists()


def test_a_shared_control_folder_is_refused(local_ssh: Path, tmp_path: Path) -> None:
    """`edgekit remote` used $TMPDIR/edgekit-ssh-<uid> even when another user owned it with
    mode 777: whoever can enter it can use this user's connections to the device."""
    control = tmp_path / "tmp" / f"edgekit-ssh-{os.getuid()}"
    control.mkdir(mode=0o777)
    control.chmod(0o777)
    host = RemoteHost("me@device")
    with pytest.raises(BadInputError, match=rf"the SSH control folder {control} can be used by other users "
                                            r"\(mode 777\): another user could take over"):
        host.run("true")
    if os.geteuid() == 0:  # root can hand the folder to another user
        control.chmod(0o700)
        os.chown(control, 12345, 12345)
        with pytest.raises(BadInputError, match=r"belongs to another user \(uid 12345\)"):
            host.run("true")
    assert local_ssh.read_text() == ""  # ssh never started


@pytest.mark.parametrize("spec", ["-oProxyCommand=touch PWNED", "me@host;touch PWNED", "me@$(touch PWNED)",
                                  "me@host com", "me@-host", "me@host:port", "", "me@host\n"])
def test_a_destination_is_user_at_host_and_nothing_else(spec: str) -> None:
    with pytest.raises(BadInputError, match="bad remote"):
        check_destination(spec)
    with pytest.raises(BadInputError, match="bad remote"):
        RemoteHost(spec)


@pytest.mark.parametrize("option", [
    "ProxyCommand=touch PWNED", "proxycommand touch PWNED", "LocalCommand=touch PWNED", "PermitLocalCommand=yes",
    "Include=/tmp/evil.conf", "Match=exec touch PWNED", "KnownHostsCommand=/tmp/evil.sh", "PKCS11Provider=/tmp/e.so",
    "ForwardAgent=yes", "LocalForward=8080 localhost:80", "UserKnownHostsFile=/home/me/.bashrc", "ProxyJump=evil",
    "Port=22;touch PWNED", "User=$(touch PWNED)", "LogLevel",
])
def test_recipe_ssh_options_are_allow_listed_by_name(option: str) -> None:
    with pytest.raises(BadInputError, match="ssh option"):
        check_data_options([option])


def test_allowed_options_pass() -> None:
    check_data_options([f"{name}=yes" for name in SSH_OPTIONS_FROM_DATA] + ["ConnectTimeout 5", "port=2222"])


def test_allowed_options_reach_ssh_and_ours_come_first(local_ssh: Path) -> None:
    """ssh takes the first value of an option: edgekit's own (BatchMode=yes) cannot be overridden."""
    RemoteHost("me@device", ssh_options=["BatchMode=no", "ConnectTimeout=5"]).run("true")
    argv = json.loads(local_ssh.read_text().splitlines()[0])
    assert argv.index("BatchMode=yes") < argv.index("BatchMode=no")


def test_downloaded_files_are_not_executable_by_accident(local_ssh: Path, tmp_path: Path, tiny_onnx: Path) -> None:
    """A setuid bit or odd mode from the device is not applied (set_attrs=False)."""
    host = RemoteHost("me@device", edgekit=str(fake_edgekit(tmp_path, "printf x > s && chmod 4755 s")))
    out = remote_build(str(tiny_onnx), "cpu", tmp_path / "engine", host)
    assert not stat.S_IMODE((out / "s").stat().st_mode) & stat.S_ISUID


def test_remote_options_make_the_host_of_remote_commands():
    """RemoteOptions (the flags of `edgekit remote build/profile`): the device is required, the
    one --timeout is the build's and the command's."""
    from edgekit.ssh import RemoteOptions

    h = RemoteOptions(host="me@orin:2222", identity="K", ssh_options=("Compression=yes",), timeout=60.0).remote_host()
    assert (h.destination, h.port, h.identity, h.ssh_options, h.build_timeout, h.command_timeout) == \
        ("me@orin", 2222, "K", ["Compression=yes"], 60.0, 60.0)
    with pytest.raises(BadInputError, match=r"^give the device: --host USER@HOST\[:PORT\]$"):
        RemoteOptions()
    with pytest.raises(BadInputError, match=r"^--timeout must be > 0 seconds, got 0.0$"):
        RemoteOptions(host="me@orin", timeout=0.0)
