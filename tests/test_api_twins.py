"""The Python API is the CLI: the README's chain (compress, export, build, profile, check) run as
API calls gives what the commands give, byte for byte; export, build and load of the compressed
folder run in a fresh interpreter that never imported the compression steps."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from click.testing import CliRunner

import edgekit
from edgekit.cli import cli
from edgekit.compress import StepContext

MODEL = "edgekit.pipelines.examples:tiny_mlp"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _cli(*args: object) -> None:
    r = CliRunner().invoke(cli, [str(a) for a in args])
    assert r.exit_code == 0, r.output


def test_readme_chain_as_api_calls_in_a_fresh_interpreter_matches_the_commands(tmp_path: Path):
    calib = tmp_path / "calib.npz"
    np.savez(calib, input=np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32))
    c, a = tmp_path / "cli", tmp_path / "api"
    _cli("compress", MODEL, "--bits", "8", "--calib-samples", "16", "--calib", calib, "-o", c / "int8")
    _cli("export", c / "int8", "-o", c / "onnx")
    _cli("build", c / "int8", "--target", "cpu", "-o", c / "engine")
    _cli("profile", c / "engine", "--warmup-ms", "0", "--duration-s", "0", "--iterations", "5", "--no-nodes",
         "--json", c / "profile.json")

    edgekit.compress(MODEL, [("int8", {"calib_samples": 16})], a / "int8", StepContext(calib=str(calib)))
    # a fresh interpreter that never imported the compression steps loads, exports and builds the folder
    api = textwrap.dedent(f"""
        import json, sys
        import edgekit
        from edgekit.profiling import ProfileConfig
        edgekit.export_onnx({str(a / "int8")!r}, {str(a / "onnx")!r})
        edgekit.build_engine({str(a / "int8")!r}, "cpu", {str(a / "engine")!r})
        profile = edgekit.profile_engine({str(a / "engine")!r},
                                         ProfileConfig(warmup_ms=0, duration_s=0, iterations=5, node_profile=False))
        verdict = edgekit.check_budget(profile, budget_ms=1000.0)
        steps = [s.name for s in edgekit.load_model({str(a / "int8")!r}).steps]
        print(json.dumps({{"passed": verdict.passed, "steps": steps, "count": profile.latency_ms.count}}))
    """)
    out = subprocess.run([sys.executable, "-c", api], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"passed": True, "steps": ["int8"], "count": 5}

    # the same compressed weights, exported graph and engine graph, byte for byte
    assert _sha(a / "int8" / "model.safetensors") == _sha(c / "int8" / "model.safetensors")
    assert _manifest(a / "int8")["config"]["steps"] == _manifest(c / "int8")["config"]["steps"]
    for folder in ("onnx", "engine"):
        ma, mc = _manifest(a / folder), _manifest(c / folder)
        assert ma["files"] == mc["files"]
        for name in ma["files"].values():
            if name.endswith(".onnx"):
                assert _sha(a / folder / name) == _sha(c / folder / name), (folder, name)
    assert json.loads((c / "profile.json").read_text())["latency_ms"]["count"] == 5
    assert _manifest(a / "onnx")["metrics"]["parity"] == _manifest(c / "onnx")["metrics"]["parity"]
    assert _manifest(a / "engine")["metrics"]["quality"] == _manifest(c / "engine")["metrics"]["quality"]
    assert _manifest(a / "engine")["metrics"]["quality"]["status"] == "verified"
