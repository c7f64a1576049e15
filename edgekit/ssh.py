"""SSH transport to a device: run commands, move files, verify them.

``RemoteHost("user@host")`` wraps the system ``ssh`` client (BatchMode: keys only, never a
password prompt; ConnectTimeout; keep-alives). Files travel as tar streams over the same
SSH connection (no scp/sftp subsystem or rsync needed on the device; ``tar`` and
``sha256sum`` are), and every transferred file's sha256 is compared on both sides.

It knows nothing of runtimes or edgekit commands: the TensorRT runtime uses it to run
trtexec on the device (``--remote``), and ``edgekit.remote`` to run edgekit there.

Errors: an unreachable host or a command that times out raises ``UnavailableError``
(exit 2) naming the host; a failed command raises the edgekit error its exit code means.

What a device sends back is not trusted: downloads stream to disk (never whole into
memory), within the free space, and only regular files and folders inside the target
folder are written (no links, devices, FIFOs, absolute paths or ``..``). What data may
ask of ssh is limited too: a destination is ``[user@]host[:port]`` and nothing else, and
``-o`` options from a recipe (``check_data_options``) come from an allow-list of options
that neither run a command here (ProxyCommand, LocalCommand, KnownHostsCommand, Match
exec, ...), load code (PKCS11Provider), read other configuration (Include), forward
anything to the device (ForwardAgent, forwarded ports) nor name files.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import stat
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.artifact import sha256_file
from edgekit.errors import BadInputError, CheckFailedError, EdgekitError, UnavailableError
from edgekit.limits import format_bytes, free_space
from edgekit.options import option
from edgekit.schema import check_fields

# ``-o`` options a recipe may give (compared without case, as ssh does): connection and
# cryptography settings only. Everything else can run a program or load code on this machine,
# forward something to the device, or write a file; give those on the command line
# (``--ssh-option``) or in your own ~/.ssh/config.
SSH_OPTIONS_FROM_DATA = (
    "AddressFamily", "CheckHostIP", "Ciphers", "Compression", "ConnectionAttempts", "ConnectTimeout",
    "HostKeyAlgorithms", "HostKeyAlias", "IdentitiesOnly", "IPQoS", "KexAlgorithms", "LogLevel", "MACs",
    "Port", "PreferredAuthentications", "PubkeyAcceptedAlgorithms", "PubkeyAcceptedKeyTypes",
    "PubkeyAuthentication", "RekeyLimit", "ServerAliveCountMax", "ServerAliveInterval",
    "StrictHostKeyChecking", "TCPKeepAlive", "UpdateHostKeys", "User", "VerifyHostKeyDNS",
)
_OPTION = re.compile(r"\s*([A-Za-z][A-Za-z0-9]*)\s*(?:=|\s)\s*(.*)", re.DOTALL)
_OPTION_VALUE = re.compile(r"[A-Za-z0-9@.:,+=/%_-]*")  # no quotes, spaces, $, `, ;, |, &, <, >
_MAX_TRAILING = 1 << 20  # bytes a transfer may hold after its archive ends (tar pads to 10 KiB records)
_DESTINATION = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?(?:[A-Za-z0-9][A-Za-z0-9._-]*|\[[0-9A-Fa-f:.]+\])"
                          r"(?::[0-9]{1,5})?")

_UNREACHABLE = ("connection refused", "timed out", "could not resolve", "no route to host", "permission denied",
                "host key verification failed", "connection closed", "network is unreachable",
                "connection reset", "name or service not known")


@dataclass
class RemoteHost:
    """An SSH destination. ``spec`` is ``user@host`` or ``user@host:port``."""

    spec: str
    port: int | None = None
    identity: str | None = None
    ssh_options: list[str] = field(default_factory=list)  # extra ``-o Key=Value`` pairs, as "Key=Value"
    connect_timeout: int = 10
    command_timeout: float = 600.0
    build_timeout: float = 3600.0
    edgekit: str = "edgekit"  # the edgekit command on the device (a shell word sequence)
    multiplex: bool = True  # one SSH connection for all commands (ControlMaster; exits 30 s after last use)

    def __post_init__(self) -> None:
        check_destination(self.spec)
        host = self.spec
        if host.count(":") == 1 and host.rsplit(":", 1)[1].isdigit():
            host, port = host.rsplit(":", 1)
            self.port = self.port or int(port)
        self.destination = host

    @classmethod
    def from_options(cls, spec: str, extra: dict[str, Any] | None = None) -> RemoteHost:
        """From BuildOptions.extra: ``ssh_port``, ``ssh_identity``, ``ssh_options``,
        ``connect_timeout``, ``remote_timeout``, ``build_timeout``, ``remote_edgekit``."""
        e = extra or {}
        return cls(spec, port=e.get("ssh_port"), identity=e.get("ssh_identity"),
                   ssh_options=list(e.get("ssh_options") or []), connect_timeout=int(e.get("connect_timeout", 10)),
                   command_timeout=float(e.get("remote_timeout", 600)),
                   build_timeout=float(e.get("build_timeout", 3600)),
                   edgekit=str(e.get("remote_edgekit") or os.environ.get("EDGEKIT_REMOTE_EDGEKIT") or "edgekit"))

    # -- plumbing --

    def ssh_argv(self, command: str) -> list[str]:
        argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout}",
                "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4"]
        if self.multiplex:
            argv += ["-o", "ControlMaster=auto", "-o", f"ControlPath={_control_dir()}/%C", "-o", "ControlPersist=30"]
        if self.port:
            argv += ["-p", str(self.port)]
        if self.identity:
            argv += ["-i", str(self.identity)]
        for opt in self.ssh_options:
            argv += ["-o", opt]
        return argv + [self.destination, command]

    def run(self, command: str, *, timeout: float | None = None, check: bool = True,
            stdin: bytes | None = None, text: bool = True) -> subprocess.CompletedProcess[Any]:
        """Run a shell command on the device. Unreachable / timed out -> UnavailableError."""
        timeout = timeout or self.command_timeout
        kwargs: dict[str, Any] = {"capture_output": True, "timeout": timeout}
        if stdin is not None:
            kwargs["input"] = stdin
            text = False
        else:
            kwargs["stdin"] = subprocess.DEVNULL  # ssh must not read our terminal
        try:
            proc = subprocess.run(self.ssh_argv(command), text=text, **kwargs)
        except FileNotFoundError:
            raise UnavailableError("the ssh client is not installed here (apt-get install openssh-client)") from None
        except subprocess.TimeoutExpired:
            raise UnavailableError(f"remote {self.spec}: command timed out after {timeout:g} s: "
                                   f"{command[:120]}") from None
        stderr = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode(errors="replace")
        if proc.returncode == 255 and any(s in stderr.lower() for s in _UNREACHABLE):
            last = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:] or ["no detail"]
            raise UnavailableError(f"remote {self.spec} is unreachable: {last[0].strip()}")
        if check and proc.returncode != 0:
            raise _remote_error(self.spec, command, proc.returncode, stderr)
        return proc

    def close(self) -> None:
        """Stop the shared SSH connection (it would exit by itself 30 s after last use)."""
        if self.multiplex:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={_control_dir()}/%C"]
                               + (["-p", str(self.port)] if self.port else []) + [self.destination],
                               capture_output=True, timeout=10, stdin=subprocess.DEVNULL)

    def __enter__(self) -> RemoteHost:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def check_reachable(self) -> None:
        self.run("true", timeout=self.connect_timeout + 10)

    @contextlib.contextmanager
    def workdir(self) -> Iterator[str]:
        """A fresh temporary folder on the device, removed afterwards."""
        wd = self.run("mktemp -d \"${TMPDIR:-/tmp}/edgekit.XXXXXX\"").stdout.strip()
        if not wd.startswith("/"):
            raise UnavailableError(f"remote {self.spec}: mktemp gave no folder ({wd[:80]!r})")
        try:
            yield wd
        finally:
            with contextlib.suppress(EdgekitError):
                self.run(f"rm -rf {shlex.quote(wd)}", timeout=60)

    def remote_hashes(self, folder: str, names: list[str] | None = None) -> dict[str, str]:
        """sha256 of files in a remote folder: ``names`` (relative), or every file."""
        q = shlex.quote(folder)
        if names:
            cmd = f"cd {q} && sha256sum -- {' '.join(shlex.quote(n) for n in names)}"
        else:
            cmd = f"cd {q} && find . -type f -exec sha256sum -- {{}} +"
        return _parse_sha256sum(self.run(cmd).stdout)

    def put(self, paths: list[Path], remote_dir: str, names: list[str] | None = None) -> dict[str, str]:
        """Upload files (or folders, recursively) into ``remote_dir``; verify sha256."""
        names = names or [Path(p).name for p in paths]
        buf = io.BytesIO()
        local: dict[str, str] = {}
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for p, name in zip(paths, names, strict=True):
                p = Path(p)
                tar.add(str(p), arcname=name)
                files = [(f, f"{name}/{f.relative_to(p)}") for f in p.rglob("*") if f.is_file()] if p.is_dir() else [(p, name)]
                for f, rel in files:
                    local[rel] = sha256_file(f)
        q = shlex.quote(remote_dir)
        out = self.run(f"mkdir -p {q} && tar -C {q} -xf - && cd {q} && sha256sum -- "
                       + " ".join(shlex.quote(n) for n in sorted(local)), stdin=buf.getvalue(),
                       timeout=self.command_timeout).stdout
        remote = _parse_sha256sum(out.decode(errors="replace") if isinstance(out, bytes) else out)
        bad = [n for n, h in local.items() if remote.get(n) != h]
        if bad:
            raise UnavailableError(f"remote {self.spec}: upload corrupted {bad[:3]} (sha256 differs)")
        return local

    def get(self, remote_dir: str, names: list[str] | None, local_dir: Path,
            optional: list[str] | tuple[str, ...] = ()) -> list[str]:
        """Fetch ``names`` (relative to ``remote_dir``; None = the whole folder) into
        ``local_dir``; verify sha256. Missing ``optional`` names are skipped. The transfer
        streams to disk and only regular files and folders are written (``_extract``)."""
        local_dir = Path(local_dir)
        q = shlex.quote(remote_dir)
        if names is not None:
            hashes = _parse_sha256sum(self.run(
                f"cd {q} && for f in {' '.join(shlex.quote(n) for n in names)}; do "
                f"if [ -f \"$f\" ]; then sha256sum -- \"$f\"; fi; done; true").stdout)
            present = [n for n in names if n in hashes]
            missing = [n for n in names if n not in present and n not in optional]
            if missing:
                raise BadInputError(f"remote {self.spec}: {remote_dir} lacks {missing}")
            if not present:
                return []
            cmd = f"cd {q} && tar -cf - -- {' '.join(shlex.quote(n) for n in present)}"
        else:
            hashes = self.remote_hashes(remote_dir)
            cmd = f"cd {q} && tar -cf - ."
        local_dir.mkdir(parents=True, exist_ok=True)
        self._extract(cmd, local_dir)
        bad = [n for n, h in hashes.items() if not (local_dir / n).is_file() or sha256_file(local_dir / n) != h]
        if bad:
            raise UnavailableError(f"remote {self.spec}: download corrupted {bad[:3]} (sha256 differs)")
        return sorted(hashes)

    def _extract(self, command: str, local_dir: Path) -> None:
        """Run ``command`` (it writes a tar stream) and unpack the stream into ``local_dir``
        as it arrives: regular files and folders only, inside ``local_dir``, within the free
        space there. Anything else the device sends is refused, naming it."""
        found = free_space(local_dir)
        room = found[1] if found is not None else None
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(self.ssh_argv(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=err)
            except FileNotFoundError:
                raise UnavailableError("the ssh client is not installed here (apt-get install openssh-client)") from None
            timer = threading.Timer(self.command_timeout, proc.kill)
            timer.start()
            try:
                if proc.stdout is None:  # stdout=PIPE always gives one
                    raise RuntimeError("ssh without a stdout pipe")
                total = 0
                with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                    for m in tar:
                        name = m.name[2:] if m.name.startswith("./") else m.name
                        if name in ("", "."):
                            continue
                        kind = _member_kind(m)
                        if kind is not None:
                            raise UnavailableError(f"remote {self.spec}: refusing {kind} {name!r} in the transfer "
                                                   "(only regular files and folders are accepted)")
                        if name.startswith("/") or ".." in Path(name).parts or not name.isprintable():
                            raise UnavailableError(f"remote {self.spec}: refusing unsafe path {m.name!r} in the transfer")
                        total += m.size
                        if room is not None and total > room:
                            raise UnavailableError(f"remote {self.spec}: the transfer is larger than the "
                                                   f"{format_bytes(room)} free in {local_dir}")
                        m.name = name
                        tar.extract(m, local_dir, set_attrs=False, filter="data")
                trailing = 0  # after the archive's end: tar's padding of its last record, then EOF
                while chunk := proc.stdout.read(1 << 16):
                    trailing += len(chunk)
                    if trailing > _MAX_TRAILING:
                        raise UnavailableError(f"remote {self.spec}: the transfer goes on after its end")
                proc.wait()
            except tarfile.TarError as e:
                if not timer.is_alive():
                    raise UnavailableError(f"remote {self.spec}: download timed out after "
                                           f"{self.command_timeout:g} s") from None
                proc.wait()
                err.seek(0)
                detail = err.read().decode(errors="replace").strip().splitlines()
                raise UnavailableError(f"remote {self.spec}: the download is not a valid transfer ({e})"
                                       + (f": {detail[-1][:200]}" if detail else "")) from None
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            if proc.returncode != 0:
                err.seek(0)
                raise _remote_error(self.spec, command, proc.returncode, err.read().decode(errors="replace"))


def _member_kind(m: tarfile.TarInfo) -> str | None:
    """What a transfer member is when it is not a regular file or a folder (None when it is)."""
    if m.isreg() or m.isdir():
        return None
    kinds = {tarfile.SYMTYPE: "symbolic link", tarfile.LNKTYPE: "hard link", tarfile.CHRTYPE: "character device",
             tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "FIFO"}
    return kinds.get(m.type, f"special file (tar type {m.type!r})")


def check_destination(spec: str) -> str:
    """``spec`` as an SSH destination, ``[user@]host[:port]``, or BadInputError: anything
    else (an option such as ``-oProxyCommand=...``, spaces, shell characters) is refused."""
    if not isinstance(spec, str) or not _DESTINATION.fullmatch(spec):
        raise BadInputError(f"bad remote {spec!r} (use user@host or user@host:port)")
    return spec


def check_data_options(options: list[str]) -> None:
    """``-o`` options a recipe gives: each ``Key=Value`` with a key from
    ``SSH_OPTIONS_FROM_DATA`` and a plain value, else BadInputError naming it."""
    allowed = {name.lower(): name for name in SSH_OPTIONS_FROM_DATA}
    for opt in options:
        m = _OPTION.fullmatch(opt) if isinstance(opt, str) else None
        if m is None:
            raise BadInputError(f"ssh option {opt!r} must be Key=Value")
        if m[1].lower() not in allowed:
            raise BadInputError(f"ssh option {m[1]!r} may not come from a recipe (allowed there: "
                                f"{', '.join(SSH_OPTIONS_FROM_DATA)}); options that run commands, load code, "
                                "forward or name files go on the command line (--ssh-option) or in ~/.ssh/config")
        if not _OPTION_VALUE.fullmatch(m[2]):
            raise BadInputError(f"ssh option {m[1]!r} has the value {m[2]!r}; a recipe's ssh option values are "
                                "plain words (letters, digits and @.:,+=/%_-)")


def _control_dir() -> str:
    """The folder of the shared connections' sockets: whoever can enter it can run commands
    on the device as this user, so it must be this user's own, private, real folder."""
    d = Path(tempfile.gettempdir()) / f"edgekit-ssh-{os.getuid()}"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError as e:
        raise UnavailableError(f"cannot use the SSH control folder {d}: {e.strerror or e}; set TMPDIR to a "
                               "private folder") from None
    problem = ("is not a folder" if not stat.S_ISDIR(st.st_mode) else
               f"belongs to another user (uid {st.st_uid})" if st.st_uid != os.getuid() else
               f"can be used by other users (mode {stat.S_IMODE(st.st_mode):o})" if st.st_mode & 0o077 else None)
    if problem:
        raise BadInputError(f"the SSH control folder {d} {problem}: another user could take over this machine's "
                            "connections to the device through it; remove it or set TMPDIR to a private folder")
    return str(d)


def _parse_sha256sum(out: str) -> dict[str, str]:
    hashes = {}
    for line in out.splitlines():
        if "  " in line:
            h, name = line.split("  ", 1)
            hashes[name[2:] if name.startswith("./") else name] = h.strip().lstrip("\\")
    return hashes


def _remote_error(spec: str, command: str, rc: int, stderr: str) -> EdgekitError:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error:")]
    msg = (errs[-1][len("error:"):].strip() if errs else (lines[-1] if lines else "no output"))[:400]
    text = f"on {spec}: {msg}"
    if rc == 1:
        return CheckFailedError(text)
    if rc == 2 and errs:
        return BadInputError(text)
    if rc == 127:
        return UnavailableError(f"remote {spec}: command not found ({command.split()[0]}): {msg}")
    return UnavailableError(f"remote {spec}: `{command[:80]}` failed (exit {rc}): {msg}")


@dataclass(frozen=True)
class RemoteOptions:
    """How ``edgekit remote`` reaches the device; its fields declare the flags of ``remote
    build`` and ``remote profile`` (``edgekit.options``).

    host: ``user@host[:port]`` (required). port, identity, ssh_options: ssh's ``-p``, ``-i`` and
    ``-o Key=Value``. remote_edgekit: the edgekit command on the device (None:
    ``$EDGEKIT_REMOTE_EDGEKIT``, else ``edgekit``). timeout: seconds for the remote command.
    """

    host: str | None = field(default=None, metadata=option(
        "--host", basic=True, metavar="USER@HOST[:PORT]", help="The device (required)."))
    port: int | None = field(default=None, metadata=option("--port", bounds=(1, 65535), help="SSH port."))
    identity: str | None = field(default=None, metadata=option(
        "-i", "--identity", metavar="FILE", help="SSH private key."))
    ssh_options: tuple[str, ...] = field(default=(), metadata=option(
        "--ssh-option", metavar="KEY=VALUE", help="Extra ssh -o Key=Value (repeatable)."))
    remote_edgekit: str | None = field(default=None, metadata=option(
        "--remote-edgekit", help="The edgekit command on the device (default: $EDGEKIT_REMOTE_EDGEKIT, else "
                                 "edgekit)."))
    timeout: float = field(default=3600.0, metadata=option(
        "--timeout", basic=True, help="Seconds for the remote command (the build, or the profile)."))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.host is None:
            raise BadInputError("give the device: --host USER@HOST[:PORT]")
        if not self.timeout > 0:
            raise BadInputError(f"--timeout must be > 0 seconds, got {self.timeout}")

    def remote_host(self) -> RemoteHost:
        """The SSH destination these options name (checked as it is made)."""
        assert self.host is not None  # __post_init__
        return RemoteHost.from_options(self.host, {
            "ssh_port": self.port, "ssh_identity": self.identity, "ssh_options": list(self.ssh_options),
            "remote_edgekit": self.remote_edgekit, "build_timeout": self.timeout, "remote_timeout": self.timeout})
