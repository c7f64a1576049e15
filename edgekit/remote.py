"""Run edgekit itself on a device over SSH: ``edgekit remote build`` and ``remote profile``.

- ``remote_build(model, target, out, host)`` uploads the model (an ONNX file or an edgekit
  folder; a zoo name is resolved on the device), runs ``edgekit build`` there and fetches
  the engine folder into ``out`` (atomically).
- ``remote_profile(engine_dir, host)`` uploads an engine folder, runs ``edgekit profile``
  there, fetches the profile JSON.

This works for every runtime (the device runs edgekit's own build and profile), so it
lives beside build and profiling, not in a runtime; the SSH transport is ``edgekit.ssh``.
An edgekit error on the device is re-raised here with its message and exit code.
"""
from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path

from edgekit.artifact import check_output_dir, staged_dir
from edgekit.errors import BadInputError
from edgekit.profiling import ProfileResult
from edgekit.ssh import RemoteHost

__all__ = ["RemoteHost", "remote_build", "remote_profile"]


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

    check_output_dir(out, (model, target))  # before the remote build
    with host:
        return _remote_build(model, target, out, host, precision, runtime, threads, extra_args)


def _remote_build(model: str, target: str, out: str | os.PathLike[str], host: RemoteHost, precision: str | None,
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
                   extra_args: list[str] | None = None) -> ProfileResult:
    """``edgekit profile`` on the device; returns the ProfileResult (saved to ``json_out``)."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise BadInputError(f"engine folder {str(engine_dir)!r} does not exist")
    with host:
        return _remote_profile(engine_dir, host, json_out, extra_args)


def _remote_profile(engine_dir: Path, host: RemoteHost, json_out: str | os.PathLike[str] | None,
                    extra_args: list[str] | None) -> ProfileResult:
    host.check_reachable()
    with host.workdir() as wd:
        host.put([engine_dir], wd, names=["engine"])
        argv = ["profile", f"{wd}/engine", "--json", f"{wd}/profile.json"] + list(extra_args or [])
        host.run(f"{host.edgekit} {shlex.join(argv)}", timeout=host.build_timeout)
        with tempfile.TemporaryDirectory() as d:
            host.get(wd, ["profile.json"], Path(d))
            result = ProfileResult.load(Path(d) / "profile.json")
    result.settings["remote"] = host.spec
    if json_out is not None:
        result.save(json_out)
    return result
