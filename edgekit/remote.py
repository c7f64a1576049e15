"""Run builds and profiles on another machine over SSH.

``RemoteHost("user@host")`` wraps the system ``ssh`` client (BatchMode: keys only, never a
password prompt; ConnectTimeout; keep-alives). Files travel as tar streams over the same
SSH connection (no scp/sftp subsystem or rsync needed on the device; ``tar`` and
``sha256sum`` are), and every transferred file's sha256 is compared on both sides.

- ``remote_build(model, target, out, host)`` uploads the model (an ONNX file or an edgekit
  folder; a zoo name is resolved on the device), runs ``edgekit build`` there and fetches
  the engine folder into ``out`` (atomically).
- ``remote_profile(engine_dir, host)`` uploads an engine folder, runs ``edgekit profile``
  there, fetches the profile JSON.
- ``RemoteHost.probe()`` reports the device's GPU, SM and TensorRT (trtexec or Python);
  the TensorRT runtime uses the host to run trtexec on the device (``--remote``).

Errors: an unreachable host or a command that times out raises ``UnavailableError``
(exit 2) naming the host; a device without TensorRT raises ``UnavailableError``; an
edgekit error on the device is re-raised here with its exit code.
"""
from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError, CheckFailedError, EdgekitError, UnavailableError

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
        if not self.spec or any(c.isspace() for c in self.spec) or self.spec.startswith("-"):
            raise BadInputError(f"bad remote {self.spec!r} (use user@host or user@host:port)")
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
        from edgekit.artifact import sha256_file

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
        ``local_dir``; verify sha256. Missing ``optional`` names are skipped."""
        from edgekit.artifact import sha256_file

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
        data = self.run(cmd, text=False, timeout=self.command_timeout).stdout
        local_dir.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            members = []
            for m in tar.getmembers():
                name = m.name[2:] if m.name.startswith("./") else m.name
                if name in ("", "."):
                    continue
                if m.issym() or m.islnk() or name.startswith("/") or ".." in Path(name).parts:
                    raise UnavailableError(f"remote {self.spec}: refusing unsafe path {m.name!r} in the transfer")
                m.name = name
                members.append(m)
            for m in members:
                tar.extract(m, local_dir, set_attrs=False)
        bad = [n for n, h in hashes.items() if sha256_file(local_dir / n) != h]
        if bad:
            raise UnavailableError(f"remote {self.spec}: download corrupted {bad[:3]} (sha256 differs)")
        return sorted(hashes)

    def probe(self, trtexec: str | None = None) -> Any:
        """The device's GPU, SM and TensorRT (a ``DeviceInfo``)."""
        from edgekit.runtimes.tensorrt import PROBE_SH, parse_probe

        env = f"EDGEKIT_TRTEXEC={shlex.quote(trtexec)} " if trtexec else ""
        out = self.run(f"{env}bash -c {shlex.quote(PROBE_SH)}", timeout=self.connect_timeout + 60).stdout
        return parse_probe(out)

    def require_tensorrt(self) -> Any:
        info = self.probe()
        if not info.trtexec and not info.python_tensorrt:
            raise UnavailableError(f"remote {self.spec} lacks TensorRT: no trtexec on PATH or at "
                                   "/usr/src/tensorrt/bin/trtexec and no tensorrt Python module")
        return info


def _control_dir() -> str:
    import tempfile

    d = Path(tempfile.gettempdir()) / f"edgekit-ssh-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
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


def _upload_model(host: RemoteHost, model: str, wd: str) -> str:
    p = Path(model)
    if p.exists():
        host.put([p], f"{wd}/input")
        return f"{wd}/input/{p.name}"
    return model  # a zoo name or entry point, resolved on the device


def remote_build(model: str, target: str, out: str | os.PathLike[str], host: RemoteHost, *,
                 precision: str | None = None, runtime: str | None = None, threads: int | None = None,
                 extra_args: list[str] | None = None) -> Path:
    """``edgekit build`` on the device; the engine folder comes back into ``out``.

    >>> remote_build("model.onnx", "jetson-agx-orin-64", "engine", RemoteHost("me@orin"))  # doctest: +SKIP
    """
    from edgekit.artifact import check_output_dir, staged_dir

    check_output_dir(out, (model, target))  # before the remote build
    with host:
        return _remote_build(model, target, out, host, staged_dir, precision, runtime, threads, extra_args)


def _remote_build(model: str, target: str, out: Any, host: RemoteHost, staged_dir: Any, precision: str | None,
                  runtime: str | None, threads: int | None, extra_args: list[str] | None) -> Path:
    host.check_reachable()
    with host.workdir() as wd:
        remote_model = _upload_model(host, model, wd)
        remote_target = target
        if Path(target).is_file():
            host.put([Path(target)], f"{wd}/target")
            remote_target = f"{wd}/target/{Path(target).name}"
        argv = ["build", remote_model, "--target", remote_target, "-o", f"{wd}/out"]
        if precision:
            argv += ["--precision", precision]
        if runtime:
            argv += ["--runtime", runtime]
        if threads:
            argv += ["--threads", str(threads)]
        argv += list(extra_args or [])
        host.run(f"{host.edgekit} {shlex.join(argv)}", timeout=host.build_timeout)
        with staged_dir(out, (model, target)) as tmp:
            host.get(f"{wd}/out", None, tmp)
    return Path(out)


def remote_profile(engine_dir: str | os.PathLike[str], host: RemoteHost, *, json_out: str | os.PathLike[str] | None = None,
                   extra_args: list[str] | None = None) -> Any:
    """``edgekit profile`` on the device; returns the ProfileResult (saved to ``json_out``)."""

    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise BadInputError(f"engine folder {str(engine_dir)!r} does not exist")
    with host:
        return _remote_profile(engine_dir, host, json_out, extra_args)


def _remote_profile(engine_dir: Path, host: RemoteHost, json_out: Any, extra_args: list[str] | None) -> Any:
    from edgekit.profiling import ProfileResult

    host.check_reachable()
    with host.workdir() as wd:
        host.put([engine_dir], wd, names=["engine"])
        argv = ["profile", f"{wd}/engine", "--json", f"{wd}/profile.json"] + list(extra_args or [])
        host.run(f"{host.edgekit} {shlex.join(argv)}", timeout=host.build_timeout)
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            host.get(wd, ["profile.json"], Path(d))
            result = ProfileResult.load(Path(d) / "profile.json")
    result.settings["remote"] = host.spec
    if json_out is not None:
        result.save(json_out)
    return result
