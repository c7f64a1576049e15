"""Hostile model and data files: nothing in them is unpickled or run, and every bad file is
one ``error:`` line, exit 2, no traceback, nothing written.

A corpus of crafted files for every loader that accepts one (``.pt2``, Hugging Face
folders with ``.bin`` or safetensors, GGUF, ``.npy``/``.npz``, images, text), each carrying
a payload that would create a marker file if it ever ran; and property-based corruption
(truncation at random offsets, bit flips, huge declared sizes) of tiny safetensors and
GGUF files. Where the threat is not obvious, a test first shows that the library alone
runs the payload, then that edgekit refuses the file.
"""
from __future__ import annotations

import builtins
import contextlib
import io
import json
import logging
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgekit.cli import cli
from edgekit.errors import BadInputError
from edgekit.sources.models import load_model
from edgekit.sources.weights import check_gguf, check_safetensors

PROPERTY = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Payload:
    """Pickles to ``open(marker, "w")``: unpickling it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker), protocol=2)  # torch.save's protocol: the refusal names the global


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PAYLOAD-RAN"


def run_cli(*args: object, stdin: str | None = None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=stdin)


def assert_refused(result, tmp_path: Path, marker: Path, *expected: str) -> str:
    """Exit 2, one ``error:`` line holding ``expected``, no traceback, no output, no payload run."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for text in expected:
        assert text in lines[0], lines[0]
    assert not marker.exists(), "the payload ran"
    assert not list(tmp_path.glob("out*")), "something was written"
    return lines[0]


def assert_bad_input(spec: str | Path, *expected: str) -> str:
    """The API contract behind the CLI's line: a BadInputError whose message is one line."""
    with pytest.raises(BadInputError) as info:
        load_model(str(spec))
    msg = str(info.value)
    assert "\n" not in msg, msg
    for text in expected:
        assert text in msg, msg
    return msg


# ----------------------------------------------------------------------------------------------
# .pt2 (torch.export.save)


class ConstantModel(torch.nn.Module):
    """A parameter, a buffer and a plain tensor attribute (a lifted tensor constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("offset", torch.full((3,), 0.5))
        self.scale = torch.tensor([1.0, 2.0, 3.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) + self.offset) * self.scale


@pytest.fixture(scope="module")
def good_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = ConstantModel().eval()
    ep = torch.export.export(model, (torch.randn(2, 4),),
                             dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    assert "scale" in ep.constants  # the file carries a tensor constant besides weights
    path = tmp_path_factory.mktemp("pt2") / "good.pt2"
    torch.export.save(ep, path)
    return path


def rewrite_pt2(src: Path, dst: Path, edit) -> Path:
    """Copy a .pt2 archive entry by entry (through torch's own writer), letting ``edit``
    change the entries (a dict of path -> bytes, paths relative to the archive folder)."""
    from torch.export.pt2_archive import PT2ArchiveWriter

    with zipfile.ZipFile(src) as z:
        root = z.namelist()[0].split("/")[0]
        entries = {n[len(root) + 1:]: z.read(n) for n in z.namelist()}
    for written_by_torch in (".data/version", "byteorder", ".data/serialization_id"):
        entries.pop(written_by_torch, None)
    edit(entries)
    with PT2ArchiveWriter(str(dst)) as w:
        for name, data in entries.items():
            w.write_bytes(name, data)
    return dst


def _program(entries: dict) -> dict:
    return json.loads(entries["models/model.json"])


def _set_program(entries: dict, program: dict) -> None:
    entries["models/model.json"] = json.dumps(program).encode()


def _pickled_weight(marker: Path):
    def edit(entries):
        config = json.loads(entries["data/weights/model_weights_config.json"])
        meta = config["config"]["linear.weight"]
        meta["use_pickle"] = True
        entries["data/weights/" + meta["path_name"]] = evil_pickle(marker)
        entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()
    return edit


def _pickled_constant(marker: Path):
    def edit(entries):
        config = json.loads(entries["data/constants/model_constants_config.json"])
        meta = config["config"]["scale"]
        meta["use_pickle"] = True
        buf = io.BytesIO()
        torch.save({"x": Payload(marker)}, buf)
        entries["data/constants/" + meta["path_name"]] = buf.getvalue()
        entries["data/constants/model_constants_config.json"] = json.dumps(config).encode()
    return edit


def _custom_object(prefix: str, payload: bytes):
    def edit(entries):
        config = json.loads(entries["data/constants/model_constants_config.json"])
        config["config"]["obj"] = {"path_name": f"{prefix}0", "is_param": False, "use_pickle": True,
                                   "tensor_meta": None}
        entries[f"data/constants/{prefix}0"] = payload
        entries["data/constants/model_constants_config.json"] = json.dumps(config).encode()
    return edit


def _legacy_weights(marker: Path):
    def edit(entries):
        entries["data/weights/model.pt"] = evil_pickle(marker)
    return edit


def _node_target(target: str):
    def edit(entries):
        program = _program(entries)
        node = program["graph_module"]["graph"]["nodes"][0]
        node["target"] = target
        node["inputs"] = [{"name": "command", "arg": {"as_string": "true"}, "kind": 1}]
        _set_program(entries, program)
    return edit


def _sym_expr(marker: Path):
    def edit(entries):
        program = _program(entries)
        values = program["graph_module"]["graph"]["tensor_values"]
        first = values[next(iter(values))]
        first["sizes"][0] = {"as_expr": {"expr_str": f"Integer(open({str(marker)!r}, 'w').close() or 2)",
                                         "hint": {"as_int": 2}}}
        _set_program(entries, program)
    return edit


def _guard(marker: Path):
    def edit(entries):
        program = _program(entries)
        program["guards_code"] = [f"open({str(marker)!r}, 'w') is not None"]
        _set_program(entries, program)
    return edit


def _arg_names(names: list[str]):
    def edit(entries):
        program = _program(entries)
        program["graph_module"]["module_call_graph"][0]["signature"]["forward_arg_names"] = names
        _set_program(entries, program)
    return edit


def _stack_trace(text: str):
    def edit(entries):
        program = _program(entries)
        program["graph_module"]["graph"]["nodes"][0]["metadata"]["stack_trace"] = text
        _set_program(entries, program)
    return edit


def _extra_entry(name: str, data: bytes):
    def edit(entries):
        entries[name] = data
    return edit


def test_torch_export_load_alone_runs_a_pickled_sample_input(good_pt2, tmp_path, marker):
    """The threat: torch.export.load falls back to the full unpickler for sample inputs."""
    evil = rewrite_pt2(good_pt2, tmp_path / "evil.pt2", _extra_entry("data/sample_inputs/model.pt",
                                                                      evil_pickle(marker)))
    logging.disable(logging.CRITICAL)
    try:
        with pytest.raises(RuntimeError):
            torch.export.load(evil)
    finally:
        logging.disable(logging.NOTSET)
    assert marker.exists()  # torch ran it
    marker.unlink()
    line = assert_refused(run_cli("export", evil, "-o", tmp_path / "out"), tmp_path, marker,
                          "entry 'data/sample_inputs/model.pt' is a pickle that only arbitrary code can load",
                          "GLOBAL io.open was not an allowed global")
    assert "weights_only` set to `False`" not in line  # torch's advice to load unsafely is not repeated


def test_torch_export_load_alone_runs_a_symbolic_expression(good_pt2, tmp_path, marker):
    """The threat: sympy.sympify evaluates the serialized shape expressions as Python."""
    evil = rewrite_pt2(good_pt2, tmp_path / "evil.pt2", _sym_expr(marker))
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.suppress(Exception):  # whatever torch makes of the rest, the payload already ran
            torch.export.load(evil)
    finally:
        logging.disable(logging.NOTSET)
    assert marker.exists()
    marker.unlink()
    assert_refused(run_cli("export", evil, "-o", tmp_path / "out"), tmp_path, marker,
                   "models/model.json: symbolic expression", "only sympy constructors, numbers and symbol names")


PT2_CORPUS = {
    "pickled weight": (_pickled_weight, "entry 'data/weights/weight_0' is a pickle that only arbitrary code can load"),
    "pickled tensor constant": (_pickled_constant, "entry 'data/constants/tensor_0' is a pickle that only"),
    "legacy pickled weights": (_legacy_weights, "entry 'data/weights/model.pt' is a pickle that only"),
    "opaque object": (lambda m: _custom_object("opaque_obj_", evil_pickle(m)),
                      "entry 'data/constants/opaque_obj_0' (constant 'obj') is a custom object"),
    "harmless opaque object": (lambda m: _custom_object("opaque_obj_", pickle.dumps({"a": 1})),
                               "is a custom object, which only unpickling can load"),
    "torchbind object": (lambda m: _custom_object("custom_obj_", b"PK\x03\x04"),
                         "entry 'data/constants/custom_obj_0' (constant 'obj') is a custom object"),
    "guard": (_guard, "models/model.json: guard \"open("),
    "os.system target": (lambda m: _node_target("torch.os.system"), "node target 'torch.os.system' is not an operator"),
    "load_library target": (lambda m: _node_target("torch.ops.load_library"), "node target 'torch.ops.load_library'"),
    "argument name": (lambda m: _arg_names(["x=open('m','w')"]), "forward_arg_names \"x=open('m','w')\" holds '='"),
    "carriage return": (lambda m: _stack_trace('File "a.py", line 1\ropen("m", "w")'),
                        "stack_trace text 'File \"a.py\", line 1\\ropen(\"m\", \"w\")' holds the control character"),
    "AOTInductor library": (lambda m: _extra_entry("data/aotinductor/model/model.so", b"\x7fELF"),
                            "entry 'data/aotinductor/model/model.so' is AOTInductor compiled code"),
}


@pytest.mark.parametrize("case", list(PT2_CORPUS))
def test_hostile_pt2_is_refused_naming_the_entry(case, good_pt2, tmp_path, marker):
    make_edit, expected = PT2_CORPUS[case]
    evil = rewrite_pt2(good_pt2, tmp_path / "evil.pt2", make_edit(marker))
    assert_refused(run_cli("export", evil, "-o", tmp_path / "out"), tmp_path, marker, expected)


def test_pt2_archives_torch_would_read_another_way_are_refused(good_pt2, tmp_path, marker):
    # a top-level "version" entry: torch's fallback reader would unpickle serialized_*.pt files
    legacy = tmp_path / "legacy.pt2"
    shutil.copy(good_pt2, legacy)
    with zipfile.ZipFile(legacy, "a") as z:
        z.writestr("version", "8.0")
        z.writestr("serialized_example_inputs.pt", evil_pickle(marker))
    assert_refused(run_cli("export", legacy, "-o", tmp_path / "out"), tmp_path, marker,
                   "entry 'version' lies outside the archive's folder 'good'")
    # compressed entries (a zip bomb's way in)
    deflated = tmp_path / "deflated.pt2"
    with zipfile.ZipFile(good_pt2) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    assert_refused(run_cli("export", deflated, "-o", tmp_path / "out"), tmp_path, marker,
                   "is compressed; torch.export.save stores entries uncompressed")
    (tmp_path / "text.pt2").write_text("not a zip")
    assert_refused(run_cli("export", tmp_path / "text.pt2", "-o", tmp_path / "out"), tmp_path, marker,
                   "text.pt2 is not a .pt2 archive (not a readable zip file")


@settings(PROPERTY)
@given(cut=st.floats(0.0, 0.999))
def test_truncated_pt2_is_one_line(good_pt2, tmp_path, cut):
    data = good_pt2.read_bytes()
    bad = tmp_path / "cut.pt2"
    bad.write_bytes(data[:int(cut * len(data))])
    assert_bad_input(bad, "cut.pt2")


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".ckpt", ".bin", ".pkl"])
def test_pickled_checkpoints_are_never_loaded(suffix, tmp_path, marker):
    path = tmp_path / f"model{suffix}"
    torch.save({"weight": Payload(marker)}, path)
    assert_refused(run_cli("export", path, "-o", tmp_path / "out"), tmp_path, marker,
                   f"is of a kind edgekit does not load ({suffix})", "edgekit never unpickles a checkpoint")


def test_good_pt2_with_constants_loads_and_matches(good_pt2):
    torch.manual_seed(0)
    reference = ConstantModel().eval()
    handle = load_model(str(good_pt2))
    assert [(s.name, s.shape, s.dtype) for s in handle.inputs] == [("input", ("batch", 4), "float32")]
    x = torch.randn(5, 4)
    with torch.no_grad():
        np.testing.assert_allclose(handle.module(x).numpy(), reference(x).numpy(), rtol=0, atol=1e-6)
    handle.module.eval()  # torch's ExportedProgram.module() forbids this; edgekit's steps call it


def test_good_pt2_exports_from_the_cli(good_pt2, tmp_path):
    r = run_cli("export", good_pt2, "-o", tmp_path / "onnx")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "onnx" / "model.onnx").is_file()


def test_static_batch_pt2_keeps_its_shapes(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).eval()
    path = tmp_path / "static.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(2, 4),)), path)
    handle = load_model(str(path))
    assert handle.inputs[0].shape == (2, 4) and handle.dynamic_axes == {}
    assert handle.sample_inputs(1)["input"].shape == (2, 4)  # the program runs only at batch 2


# ----------------------------------------------------------------------------------------------
# Hugging Face folders


def _tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "[PAD] [UNK] [CLS] [SEP] the a cat dog sat on mat".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                            bos_token="[CLS]").save_pretrained(folder)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama as safetensors and as pytorch_model.bin, each with a tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    model = _tiny_llama()
    out = {}
    for name, safe in (("safetensors", True), ("bin", False)):
        model.save_pretrained(root / name, safe_serialization=safe)
        _tiny_tokenizer(root / name)
        out[name] = root / name
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _remote_code_folder(src: Path, dst: Path, marker: Path) -> Path:
    folder = _copy(src, dst)
    _edit_json(folder / "config.json", model_type="evil_llama", architectures=["EvilForCausalLM"],
               auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                         "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    code = f"open({str(marker)!r}, 'w').close()\nfrom transformers import LlamaConfig\n\n\n" \
           "class EvilConfig(LlamaConfig):\n    model_type = 'evil_llama'\n"
    (folder / "configuration_evil.py").write_text(code)
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return folder


def test_transformers_alone_runs_remote_code_on_yes(hf_folders, tmp_path, marker, monkeypatch):
    """The threat: transformers asks on stdin and runs the folder's code on "y"."""
    import transformers
    import transformers.dynamic_module_utils as dynamic

    folder = _remote_code_folder(hf_folders["safetensors"], tmp_path / "remote", marker)
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # keep the copied code here
    monkeypatch.setattr(builtins, "input", lambda prompt="": "y")
    transformers.AutoConfig.from_pretrained(str(folder))
    assert marker.exists()


def test_remote_code_folder_is_refused_even_with_yes_on_stdin(hf_folders, tmp_path, marker):
    folder = _remote_code_folder(hf_folders["safetensors"], tmp_path / "remote", marker)
    assert_refused(run_cli("export", folder, "-o", tmp_path / "out", stdin="y\ny\n"), tmp_path, marker,
                   "needs custom code to load (config.json auto_map: AutoConfig -> configuration_evil.EvilConfig",
                   "edgekit never runs code from a model folder")


def test_remote_code_in_a_real_process_with_yes_piped(hf_folders, tmp_path, marker):
    """As CI would run it: a real process, "y" piped to standard input."""
    folder = _remote_code_folder(hf_folders["safetensors"], tmp_path / "remote", marker)
    r = subprocess.run([sys.executable, "-m", "edgekit.cli", "export", str(folder), "-o", str(tmp_path / "out")],
                       input="y\n" * 4, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "needs custom code" in r.stderr
    assert "Do you wish to run the custom code" not in r.stdout + r.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_tokenizer_remote_code_is_refused(hf_folders, tmp_path, marker):
    folder = _copy(hf_folders["safetensors"], tmp_path / "tok")
    _edit_json(folder / "tokenizer_config.json", tokenizer_class="EvilTokenizer",
               auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})
    (folder / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    assert_refused(run_cli("export", folder, "-o", tmp_path / "out", stdin="y\n"), tmp_path, marker,
                   "needs custom code for its tokenizer (tokenizer_config.json auto_map")


def test_pickle_vocabulary_is_not_loaded_even_when_the_environment_allows_it(hf_folders, tmp_path, marker,
                                                                            monkeypatch):
    """TransfoXL's tokenizer unpickles vocab.pkl when TRUST_REMOTE_CODE=True is set."""
    folder = _copy(hf_folders["safetensors"], tmp_path / "pkl")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TransfoXLTokenizer"}))
    (folder / "vocab.pkl").write_bytes(evil_pickle(marker))
    monkeypatch.setenv("TRUST_REMOTE_CODE", "True")
    assert_refused(run_cli("export", folder, "-o", tmp_path / "out"), tmp_path, marker,
                   "the tokenizer cannot be loaded")
    assert os.environ["TRUST_REMOTE_CODE"] == "True"  # the user's setting is put back


def test_pickled_payload_in_pytorch_model_bin_is_refused(hf_folders, tmp_path, marker):
    folder = _copy(hf_folders["bin"], tmp_path / "bin")
    torch.save({"model.embed_tokens.weight": Payload(marker)}, folder / "pytorch_model.bin")
    assert_refused(run_cli("export", folder, "-o", tmp_path / "out"), tmp_path, marker,
                   "pytorch_model.bin holds a pickle that only arbitrary code can load (Unsupported global: "
                   "GLOBAL io.open", "only through the weights-only unpickler")


def test_corrupt_pytorch_model_bin_is_one_line(hf_folders, tmp_path, marker):
    folder = _copy(hf_folders["bin"], tmp_path / "bin")
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    assert_refused(run_cli("export", folder, "-o", tmp_path / "out"), tmp_path, marker,
                   "pytorch_model.bin is not a readable PyTorch checkpoint")


def test_good_pytorch_model_bin_loads_the_same_model(hf_folders):
    reference = _tiny_llama()
    handle = load_model(str(hf_folders["bin"]))
    ids = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        got = handle.module(ids, torch.ones_like(ids))
        want = reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_safetensors_are_preferred_over_a_bin(hf_folders, tmp_path, marker):
    folder = _copy(hf_folders["safetensors"], tmp_path / "both")
    torch.save({"model.embed_tokens.weight": Payload(marker)}, folder / "pytorch_model.bin")
    assert load_model(str(folder)).kind == "causal-lm"
    assert not marker.exists()


def test_corrupt_model_safetensors_is_one_line(hf_folders, tmp_path, marker):
    folder = _copy(hf_folders["safetensors"], tmp_path / "st")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    assert_refused(run_cli("export", folder, "-o", tmp_path / "out"), tmp_path, marker,
                   "model.safetensors is not a valid safetensors file: tensor", "(truncated file?)")


def test_config_cannot_declare_more_parameters_than_the_weights_hold(hf_folders, tmp_path):
    folder = _copy(hf_folders["safetensors"], tmp_path / "big")
    _edit_json(folder / "config.json", hidden_size=65536, intermediate_size=1 << 20)
    assert_bad_input(folder, "the config describes", "parameters but the weight files hold 3,120 values")
    _edit_json(folder / "config.json", hidden_size=16, intermediate_size=32, num_hidden_layers=10**9)
    assert_bad_input(folder, "config.json declares num_hidden_layers = 1000000000 (edgekit loads at most 1024)")


def test_missing_and_non_finite_weights_are_refused(hf_folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(hf_folders["safetensors"], tmp_path / "missing")
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "q_proj" not in k}, folder / "model.safetensors",
              metadata={"format": "pt"})
    assert_bad_input(folder, "lacks 1 weights the architecture needs (first: model.layers.0.self_attn.q_proj.weight)")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert_bad_input(folder, "weight model.norm.weight holds 1 NaN or infinite values of 16")


def test_non_finite_weights_are_counted_across_chunks(monkeypatch):
    """The finite check reads a weight in chunks (no weight-sized temporaries) and counts
    every bad value, whichever chunk it is in."""
    import torch

    from edgekit.sources import weights

    monkeypatch.setattr(weights, "FINITE_CHECK_CHUNK", 4)
    layer = torch.nn.Linear(5, 3)
    weights.check_finite_parameters(layer, "m")
    with torch.no_grad():
        layer.weight.view(-1)[[3, 9, 14]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    with pytest.raises(BadInputError, match=r"^m: weight weight holds 3 NaN or infinite values of 15 "):
        weights.check_finite_parameters(layer, "m")


def test_sentence_transformers_modules_are_read_strictly(tmp_path):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    folder = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=32)).save_pretrained(folder)
    _tiny_tokenizer(folder)
    (folder / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Pooling",
                                                      "path": "../../elsewhere"}]))
    assert_bad_input(folder, "modules.json points the pooling module at '../../elsewhere', outside the folder")
    (folder / "modules.json").write_text("[{")
    assert_bad_input(folder, "modules.json is not valid JSON")
    (folder / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Normalize"}]))
    assert load_model(str(folder)).extra["normalize"] is True


# --- safetensors headers, property-based ------------------------------------------------------


@settings(PROPERTY)
@given(cut=st.floats(0.0, 0.9999))
def test_truncated_safetensors_is_refused(hf_folders, tmp_path_factory, cut):
    folder = _copy(hf_folders["safetensors"], tmp_path_factory.mktemp("cut") / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: int(cut * len(data))])
    assert_bad_input(folder, "model.safetensors")


@settings(PROPERTY)
@given(data=st.data())
def test_bit_flipped_safetensors_loads_or_is_one_line(hf_folders, tmp_path_factory, data):
    folder = _copy(hf_folders["safetensors"], tmp_path_factory.mktemp("flip") / "m")
    raw = bytearray((folder / "model.safetensors").read_bytes())
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    # flips where they matter most: the header length, the JSON header, the first weights
    pos = data.draw(st.integers(0, min(len(raw), header_end + 256) - 1))
    raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    (folder / "model.safetensors").write_bytes(bytes(raw))
    try:
        handle = load_model(str(folder))
    except BadInputError as e:
        assert "\n" not in str(e)
    else:
        assert all(bool(torch.isfinite(p).all()) for p in handle.module.parameters())


@settings(PROPERTY)
@given(length=st.integers(0, 2**64 - 1), shape=st.lists(st.integers(0, 2**62), min_size=1, max_size=4))
def test_huge_declared_safetensors_sizes_are_refused(tmp_path_factory, length, shape):
    folder = tmp_path_factory.mktemp("huge")
    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}).encode()
    (folder / "a.safetensors").write_bytes(struct.pack("<Q", length) + header + bytes(16))
    (folder / "b.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    for name in ("a.safetensors", "b.safetensors"):
        if name == "a.safetensors" and length == len(header):
            continue
        if name == "b.safetensors" and np.prod(shape, dtype=object) * 4 == 16:
            continue
        with pytest.raises(BadInputError) as info:
            check_safetensors(folder / name)
        assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------
# GGUF


def write_tiny_gguf(path: Path, seed: int = 0, nan_in: str | None = None) -> Path:
    """A one-layer Llama with a 32-token GPT-2-style vocabulary, written with the gguf
    package's writer: about 16 kB, converted by transformers in well under a second."""
    import gguf

    vocab, hidden, ff, heads = 32, 16, 32, 2
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>"] + [chr(97 + i) for i in range(vocab - 4)] + ["ab", "cd", "abcd"])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["a b", "c d", "ab cd"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    shapes = {"token_embd.weight": (vocab, hidden), "blk.0.attn_norm.weight": (hidden,),
              "blk.0.ffn_norm.weight": (hidden,), "blk.0.attn_q.weight": (hidden, hidden),
              "blk.0.attn_k.weight": (hidden, hidden), "blk.0.attn_v.weight": (hidden, hidden),
              "blk.0.attn_output.weight": (hidden, hidden), "blk.0.ffn_gate.weight": (ff, hidden),
              "blk.0.ffn_up.weight": (ff, hidden), "blk.0.ffn_down.weight": (hidden, ff),
              "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for name, shape in shapes.items():
        values = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        if name == nan_in:
            values.flat[0] = np.nan
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF conversions are cached: give each test its own, empty cache."""
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path_factory.mktemp("cache")))


def _gguf_data_start(path: Path) -> int:
    """Where the tensor data of a GGUF file begins (the end of its header, aligned)."""
    import gguf

    return int(gguf.GGUFReader(str(path)).data_offset)


def test_tiny_gguf_loads(tiny_gguf):
    handle = load_model(str(tiny_gguf))
    info = check_gguf(tiny_gguf)
    assert handle.kind == "causal-lm" and handle.extra["params"] == info.elements == 3632
    assert info.metadata["general.architecture"] == "llama" and info.metadata["tokenizer.ggml.tokens"] == 32


@settings(PROPERTY)
@given(cut=st.floats(0.0, 0.9999))
def test_truncated_gguf_is_refused(tiny_gguf, tmp_path_factory, cut):
    bad = tmp_path_factory.mktemp("cut") / "cut.gguf"
    data = tiny_gguf.read_bytes()
    bad.write_bytes(data[: int(cut * len(data))])
    assert_bad_input(bad, "cut.gguf")


@settings(PROPERTY, max_examples=8)  # a flip that still loads costs a conversion
@given(data=st.data())
def test_bit_flipped_gguf_header_loads_or_is_one_line(tiny_gguf, tmp_path_factory, data):
    raw = bytearray(tiny_gguf.read_bytes())
    pos = data.draw(st.integers(0, _gguf_data_start(tiny_gguf) - 1))
    raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    bad = tmp_path_factory.mktemp("flip") / "flip.gguf"
    bad.write_bytes(bytes(raw))
    try:
        handle = load_model(str(bad))
    except BadInputError as e:
        assert "\n" not in str(e)
    else:
        assert all(bool(torch.isfinite(p).all()) for p in handle.module.parameters())


def test_gguf_with_nan_weights_is_one_line(tmp_path, marker):
    bad = write_tiny_gguf(tmp_path / "nan.gguf", nan_in="blk.0.ffn_up.weight")
    assert_refused(run_cli("export", bad, "-o", tmp_path / "out"), tmp_path, marker,
                   "nan.gguf: weight model.layers.0.mlp.up_proj.weight holds 1 NaN or infinite values of 512")


# offsets in the tiny file: magic 0-3, version 4-7, tensor count 8-15, metadata count 16-23,
# then the first key's length (u64) at 24
HUGE_FIELDS = {"tensor count": 8, "metadata count": 16, "first key length": 24}


@settings(PROPERTY)
@given(field=st.sampled_from(sorted(HUGE_FIELDS)), value=st.integers(2**20, 2**64 - 1))
def test_huge_declared_gguf_counts_are_refused(tiny_gguf, tmp_path_factory, field, value):
    raw = bytearray(tiny_gguf.read_bytes())
    raw[HUGE_FIELDS[field]:HUGE_FIELDS[field] + 8] = struct.pack("<Q", value)
    bad = tmp_path_factory.mktemp("huge") / "huge.gguf"
    bad.write_bytes(bytes(raw))
    msg = assert_bad_input(bad, "huge.gguf is not a valid GGUF file")
    assert "declares" in msg or "past the end of the file" in msg


def test_gguf_tensor_beyond_the_file_and_bad_version_are_refused(tiny_gguf, tmp_path):
    raw = bytearray(tiny_gguf.read_bytes())
    start = _gguf_data_start(tiny_gguf)
    bad = tmp_path / "short.gguf"
    bad.write_bytes(bytes(raw[: start + 64]))
    assert_bad_input(bad, "short.gguf is not a valid GGUF file: tensor", "(truncated?)")
    raw[4:8] = struct.pack("<I", 99)
    bad.write_bytes(bytes(raw))
    r = run_cli("export", bad, "-o", tmp_path / "out")
    assert_refused(r, tmp_path, tmp_path / "none", "version 99 (edgekit reads versions 2, 3)")


# ----------------------------------------------------------------------------------------------
# Data files (calibration / evaluation), through `edgekit compress --calib`

TINY_MODELS = '''
import torch
from torch import nn


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    model.example_inputs = (torch.randn(2, 16),)
    return model
'''


@pytest.fixture
def tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An entry point (code by design) for a 16-input MLP."""
    pkg = tmp_path / "models_pkg"
    pkg.mkdir()
    (pkg / "untrusted_tiny_models.py").write_text(TINY_MODELS)
    monkeypatch.syspath_prepend(str(pkg))
    return "untrusted_tiny_models:mlp"


def calibrate(model: str, data: Path, tmp_path: Path):
    return run_cli("compress", model, "--bits", "8", "--calib", f"{data}@all", "--calib-samples", "8",
                   "-o", tmp_path / "out")


def _npz_with_member(path: Path, name: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(name, payload)
    return path


def _npy_with_header(path: Path, shape: tuple[int, ...], data: bytes) -> Path:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    path.write_bytes(buf.getvalue() + data)
    return path


def _object_npy_bytes(marker: Path) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.array([Payload(marker), 1], dtype=object), allow_pickle=True)
    return buf.getvalue()


DATA_CORPUS = {
    "npz object array": (lambda d, m: _npz_with_member(d / "x.npz", "input.npy", _object_npy_bytes(m)),
                         "x.npz: array 'input' holds Python objects (dtype object), which only unpickling can load"),
    "npy object array": (lambda d, m: (d / "x.npy").write_bytes(_object_npy_bytes(m)) and d / "x.npy",
                         "x.npy holds Python objects (dtype object)"),
    "npy that is a pickle": (lambda d, m: (d / "x.npy").write_bytes(evil_pickle(m)) and d / "x.npy",
                             "x.npy is not a valid .npy array"),
    "npz that is a pickle": (lambda d, m: (d / "x.npz").write_bytes(evil_pickle(m)) and d / "x.npz",
                             "x.npz is not a valid .npz archive"),
    "npz member not an array": (lambda d, m: _npz_with_member(d / "x.npz", "input.pkl", evil_pickle(m)),
                                "member 'input.pkl' is not a .npy array"),
    "strings": (lambda d, m: np.save(d / "x.npy", np.array([["a"] * 16] * 8))
                or d / "x.npy", "x.npy has dtype <U1; data arrays are numeric (bool, int, uint, float)"),
    "complex": (lambda d, m: np.save(d / "x.npy", np.ones((8, 16), np.complex64)) or d / "x.npy",
                "x.npy has dtype complex64"),
    "scalar": (lambda d, m: np.save(d / "x.npy", np.float32(1)) or d / "x.npy",
               "x.npy is a single float32 value; data arrays hold samples along axis 0"),
    "wrong rank": (lambda d, m: np.save(d / "x.npy", np.ones((8, 4, 4), np.float32)) or d / "x.npy",
                   "input 'input' has shape (8, 4, 4); the model expects ('batch', 16)"),
    "wrong width": (lambda d, m: np.save(d / "x.npy", np.ones((8, 15), np.float32)) or d / "x.npy",
                    "input 'input' has shape (8, 15); the model expects ('batch', 16)"),
    "nan": (lambda d, m: np.save(d / "x.npy", np.where(np.eye(8, 16) > 0, np.nan, 1).astype(np.float32))
            or d / "x.npy", "x.npy holds 8 NaN or infinite values of 128; calibration and evaluation data"),
    "inf in npz": (lambda d, m: np.savez(d / "x.npz", input=np.full((8, 16), np.inf, np.float32)) or d / "x.npz",
                   "x.npz: array 'input' holds 128 NaN or infinite values"),
    "huge declared shape": (lambda d, m: _npy_with_header(d / "x.npy", (2**31, 16), bytes(64)),
                            "declares a float32 array of shape (2147483648, 16) (128.0 GiB)"),
    "truncated npy": (lambda d, m: _npy_with_header(d / "x.npy", (8, 16), bytes(100)),
                      "(512 bytes) but holds 100 bytes of data (truncated?)"),
    "empty image folder": (lambda d, m: (d / "imgs").mkdir() or d / "imgs", "image folder"),
    "undecodable image": (lambda d, m: (d / "imgs").mkdir() or (d / "imgs" / "a.png").write_bytes(b"\x89PNG junk")
                          and d / "imgs", "cannot read image"),
    "text not utf-8": (lambda d, m: (d / "t.txt").write_bytes(b"caf\xe9 au lait\n" * 4) and d / "t.txt",
                       "t.txt is not UTF-8 (byte 0xe9 at offset 3)"),
    "binary as text": (lambda d, m: (d / "t.txt").write_bytes(b"abc\x00def\n" * 4) and d / "t.txt",
                       "t.txt holds NUL bytes (offset 3); it is binary, not text"),
}


@pytest.mark.parametrize("case", list(DATA_CORPUS))
def test_hostile_data_file_is_one_line(case, tmp_path, marker, tiny_model):
    make, expected = DATA_CORPUS[case]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = make(data_dir, marker)
    assert_refused(calibrate(tiny_model, path, tmp_path), tmp_path, marker, expected)


def test_truncated_image_names_the_file(tmp_path, marker, tiny_model):
    from PIL import Image

    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(folder / "ok.png")
    Image.fromarray(np.full((64, 64, 3), 7, np.uint8)).save(folder / "cut.png")
    (folder / "cut.png").write_bytes((folder / "cut.png").read_bytes()[:60])
    assert_refused(calibrate(tiny_model, folder, tmp_path), tmp_path, marker, f"cannot read image {folder / 'cut.png'}")


def test_good_data_files_still_load(tmp_path):
    from edgekit.sources.data import load_samples

    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.savez_compressed(tmp_path / "x.npz", input=x, labels=np.arange(8))
    (tmp_path / "t.txt").write_bytes("\ufeffcafé au lait\n".encode())
    np.testing.assert_array_equal(load_samples(str(tmp_path / "x.npy@all"), split="eval").inputs["input"], x)
    s = load_samples(str(tmp_path / "x.npz@all"), split="eval")
    np.testing.assert_array_equal(s.inputs["input"], x)
    np.testing.assert_array_equal(s.labels, np.arange(8))
    assert load_samples(str(tmp_path / "t.txt@all"), split="eval").text == "café au lait"
