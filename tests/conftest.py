"""Shared tiny fixtures: a tiny MLP, CNN and transformer-ish block as ModelHandles, and a
tiny exported ONNX file. Each builds in milliseconds; weights are seeded."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekit import interrupts
from edgekit.sources.handle import InputSpec, ModelHandle


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n 2``, what scripts/test.sh runs) every worker computes on one thread,
    and so do the commands its tests start: two workers with two spinning threads each on a 2-core
    machine cost more than they give."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _sigint_state_restored():
    """A CLI test routes SIGINT through edgekit (interrupts.install): give the next test the
    process's handler and edgekit's interrupt state as they were, whatever the test order."""
    import signal

    handlers = {signum: signal.getsignal(signum) for signum in interrupts.SIGNALS}
    state = {k: getattr(interrupts, k) for k in ("_installed", "_exiting", "_running", "_seen", "_defer_depth",
                                                  "_pending", "_first")}
    written = list(interrupts._written)
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    for k, v in state.items():
        setattr(interrupts, k, v)
    interrupts._written[:] = written


@pytest.fixture
def python_sigint(monkeypatch):
    """The process as a plain Python program sees Ctrl-C: Python's own SIGINT handler and
    edgekit's handler not installed (what a test of the library API, not the CLI, assumes)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    for name, value in (("_installed", False), ("_exiting", False), ("_running", False), ("_seen", 0),
                        ("_defer_depth", 0), ("_pending", False), ("_first", None)):
        monkeypatch.setattr(interrupts, name, value)
    yield
    signal.signal(signal.SIGINT, previous)


def _seeded(fn):
    import torch

    torch.manual_seed(0)
    m = fn()
    m.eval()
    return m


def make_tiny_mlp() -> ModelHandle:
    from torch import nn

    module = _seeded(lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)))
    return ModelHandle(name="tiny-mlp", source="tests:tiny_mlp", kind="generic", module=module,
                       inputs=[InputSpec("input", ("batch", 16), "float32")], outputs=["logits"],
                       dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})


def make_tiny_cnn() -> ModelHandle:
    from torch import nn

    module = _seeded(lambda: nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU6(),  # depthwise, as in EfficientNet-Lite
        nn.Conv2d(8, 16, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)))
    return ModelHandle(name="tiny-cnn", source="tests:tiny_cnn", kind="image-classifier", module=module,
                       inputs=[InputSpec("input", ("batch", 3, 32, 32), "float32")], outputs=["logits"],
                       dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                       extra={"num_classes": 10})


def make_tiny_transformer() -> ModelHandle:
    import torch
    from torch import nn

    class Block(nn.Module):
        """Embedding + one pre-norm attention/MLP block + masked mean pooling: an encoder in
        miniature, with plain q/k/v/out Linear layers (what quantizers look for)."""

        def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4) -> None:
            super().__init__()
            self.heads = heads
            self.embed = nn.Embedding(vocab, dim)
            self.norm1 = nn.LayerNorm(dim)
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
            self.norm2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            x = self.embed(input_ids)  # (b, s, d)
            b, s, d = x.shape
            h = self.norm1(x)
            q, k, v = (t(h).reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (self.q, self.k, self.v))
            bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -1e4
            att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + bias, dim=-1)
            x = x + self.o((att @ v).transpose(1, 2).reshape(b, s, d))
            x = x + self.mlp(self.norm2(x))
            m = attention_mask.unsqueeze(-1).to(x.dtype)
            return (x * m).sum(1) / m.sum(1).clamp(min=1.0)

    module = _seeded(Block)

    def make_inputs(batch: int = 1, **dims: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        seq = dims.get("sequence", 8)
        return {"input_ids": rng.integers(0, 50, size=(batch, seq)).astype(np.int64),
                "attention_mask": np.ones((batch, seq), dtype=np.int64)}

    return ModelHandle(name="tiny-transformer", source="tests:tiny_transformer", kind="text-encoder",
                       module=module, make_inputs=make_inputs,
                       inputs=[InputSpec("input_ids", ("batch", 8), "int64"),
                               InputSpec("attention_mask", ("batch", 8), "int64")],
                       outputs=["embedding"],
                       dynamic_axes={"input_ids": {0: "batch"}, "attention_mask": {0: "batch"},
                                     "embedding": {0: "batch"}})


@pytest.fixture
def tiny_mlp() -> ModelHandle:
    return make_tiny_mlp()


@pytest.fixture
def tiny_cnn() -> ModelHandle:
    return make_tiny_cnn()


@pytest.fixture
def tiny_transformer() -> ModelHandle:
    return make_tiny_transformer()


@pytest.fixture(scope="session")
def tiny_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CNN as a plain ONNX file (dynamic batch), built with onnx.helper: no exporter,
    so it takes milliseconds and stands for "an ONNX file edgekit did not produce"."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3, "conv.weight")
    b = numpy_helper.from_array(np.zeros(4, np.float32), "conv.bias")
    fw = numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "fc.weight")
    nodes = [
        helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "fc.weight"], ["logits"], name="fc"),
    ]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])], [w, b, fw])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    onnx.save_model(model, str(path))
    return path


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads spin against each other."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# A local transport for the SSH code: a fake ``ssh`` that runs the remote command here with bash
# (what sshd would run on the device) and logs its argv, for tests that need no sshd.
FAKE_SSH = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SSH_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
i = 0
while i < len(args) and args[i].startswith("-"):
    if args[i] == "-O":
        sys.exit(0)  # "ssh -O exit": no shared connection to stop
    i += 2 if args[i] in ("-o", "-p", "-i", "-l", "-F", "-J") else 1
os.execvp("bash", ["bash", "-c", " ".join(args[i + 1:])])
"""


def install_local_ssh(root, monkeypatch):
    """Put the fake ``ssh`` first on PATH (its argv log: ``root/ssh.log``) and make ``root/tmp``
    the TMPDIR (the device's ``mktemp`` and the control folder); returns the log."""
    import os
    import sys
    import tempfile

    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH.format(python=sys.executable))
    ssh.chmod(0o755)
    log = root / "ssh.log"
    log.touch()
    (root / "tmp").mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    monkeypatch.setenv("TMPDIR", str(root / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    return log


@pytest.fixture
def local_ssh(tmp_path, monkeypatch):
    """A fake ``ssh`` on PATH: the "device" is this machine; every ssh argv is logged (the log's path)."""
    return install_local_ssh(tmp_path, monkeypatch)


@pytest.fixture(scope="session")
def host_probe_json() -> str:
    """This machine's probe (``edgekit targets --probe``) as JSON text: the one cached for this
    machine, measured once if there is none. Tests that point ``EDGEKIT_CACHE`` at a fresh folder
    put it there (``seed_host_probe``) so that a ``cpu`` estimate does not measure the machine again."""
    from edgekit.estimate.probe import probe_machine

    return probe_machine().path.read_text()


@pytest.fixture
def seed_host_probe(host_probe_json: str):
    """Write the session's probe into the current ``EDGEKIT_CACHE``."""
    def seed() -> None:
        from edgekit.targets.host_probe import probe_path

        path = probe_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(host_probe_json)
    return seed


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything the test modules imported (torch, transformers, onnx: millions of objects) lives until
    the end: move it out of the garbage collector's reach, so that each full collection (the library's
    ``release_memory`` and Python's own) walks only what the tests create."""
    import gc

    gc.collect()
    gc.freeze()
