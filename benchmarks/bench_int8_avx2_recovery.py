"""EfficientNet-Lite0 INT8 on a CPU without VNNI (scheme "u8s7"): what exact 8-bit weights for the
sensitive layers buy back, in engine agreement and in speed.

One calibration of the default INT8 recipe (calib split images 0..127: trace, equalization, weight
scales, mse ranges), then one variant per set of layers given exact 8-bit weights
(``qdq.promote_u8u8``: stored as uint8 with zero point 128, run on ONNX Runtime's u8 x u8 kernels),
each finished as ``int8.apply`` finishes (GPTQ rounding and bias correction, on each layer's own grid).
Every variant: fake-quant top-1 agreement and mean KL against FP32 on the **validation** images (calib
split images 128..255 and train split images 0..255, never calibrated on; nothing here reads the eval
split). The all-7-bit baseline, the variant with the lowest validation KL and the every-layer variant
are also exported and built as ONNX Runtime CPU engines: engine agreement and KL on the same images
(this machine's integer kernels), which convolutions the engine runs as integer operators (and with
uint8 weights), and 1-thread CPU ms per batch-1 image of FP32 and INT8, interleaved (median of
``--rounds`` rounds of ``--images`` images each, per-process CPU time beside wall time).

    python benchmarks/bench_int8_avx2_recovery.py [--rounds 7] [--images 24]
        [--out benchmarks/results/int8_avx2_recovery.json]

``--test-report [LAYERS]`` reports instead a setting chosen here, once, on the **test** images (the eval
split's 363): ``compress`` of EfficientNet-Lite0 with ``int8`` for target ``cpu`` (the command
``edgekit compress efficientnet-lite0 --bits 8``; ``LAYERS``: comma-separated ``u8u8_layers``; left
out or ``none``: none, the default), its quality gate's engine figures (agreement and KL of this machine's ONNX Runtime
engine against FP32 on the eval split), then ``build_engine(..., "cpu")`` of it and of the FP32 model and
their 1-thread CPU ms, interleaved as above.

    python benchmarks/bench_int8_avx2_recovery.py --test-report [LAYERS] [--out ...int8_avx2_test.json]

``--candidates`` compares, on the **validation** images, integer-cost changes aimed at the activation error
(the stem's ReLU6 output, block 0's linear-bottleneck output ``conv2d_2``), each over ``--seeds``
calibration sets (seed 0: calib split 0..127, the default's; seed 1: train split 256..383; seed 2: train
384..511; none overlaps validation): the default recipe; asymmetric rounding (``round_model(alpha=,
reference=)``: from its quantized input each layer matches its output on the float model's input, GPTAQ's
reference, or on its own input before that input's quantizer); the activation-aware rescaling of
``conv2d_2`` across block 0's projection -> block 1's expand conv (``equalize_activation``, block 1's
expand conv on exact 8-bit weights); with ``--also``, GPTAQ's float-model reference too (and with the
rescaling). Every variant's fake-quant and ONNX Runtime
engine agreement and KL on validation, per seed, then mean and spread (min..max) over seeds. Seeds run in
``--jobs`` processes (1 torch thread each; CPU seconds per process).

    python benchmarks/bench_int8_avx2_recovery.py --candidates [--seeds 0,1,2] [--jobs 3] [--also]
        [--out benchmarks/results/int8_avx2_candidates.json]
    python benchmarks/bench_int8_avx2_recovery.py --table benchmarks/results/int8_avx2_candidates.json

``--schemes`` compares the weight grids for these CPUs, each on the whole default recipe, over ``--seeds``
calibration draws made as ``compress`` makes them (128 of the calib split's 256 images, photos and
Fashion-MNIST mixed, ``load_samples(..., seed=)``; seed 0 is the command's own draw): "u8s7" (7-bit
weights) and "u8s8p" (8-bit weights on the pair-safe grid, ``compress/int8/pairs.py``). **Validation** =
the train split's first 256 images (its 101 photos and 155 Fashion-MNIST images; no calib-split image, so
disjoint from every draw); the eval split is not read. Two more variants keep layers float on the pair-safe
grid, with their inputs (what ``keep_float`` does): "u8s8p, float stem" the RGB stem, "u8s8p, float stem +
depthwise" also the depthwise conv that reads it (the default since, ``step.image_stem``). Per variant and seed: fake-quant,
engine on the int16-pair kernels (this machine's where they are its own, else their numerical model) and
int32-model agreement and KL against FP32, the weight grid's mean bits over the 7-bit grid, and the 1-thread
CPU ms of this machine's ONNX Runtime engine beside FP32's (every engine in every round, 5 rounds of 16
images); ``--variants`` runs only the named ones (';'-separated), each paired against the first.

    python benchmarks/bench_int8_avx2_recovery.py --schemes [--seeds 0,1,2] [--jobs 2]
        [--variants "u8s8p;u8s8p, float stem;u8s8p, float stem + depthwise"]
        [--out benchmarks/results/int8_avx2_schemes.json]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EDGEKIT_PROGRESS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions  # noqa: E402

# The ranking of the sensitivity scan on the same validation images (benchmarks/RESULTS.md, issue 26:
# "Where EfficientNet-Lite0's INT8 error sits"): the weight units, most sensitive first.
RANKED = ("_blocks.1._expand_conv", "_blocks.3._expand_conv", "_blocks.1._project_conv")
EARLY = ("_conv_stem", "_blocks.0._project_conv", "_blocks.1._expand_conv", "_blocks.1._project_conv",
         "_blocks.2._expand_conv", "_blocks.2._project_conv", "_blocks.3._expand_conv")
VARIANTS: dict[str, tuple[str, ...] | None] = {
    "all 7-bit (default before)": (),
    "block 1 expand 8-bit": RANKED[:1],
    "stem + block 1 expand 8-bit": ("_conv_stem", RANKED[0]),
    "top 3 weight units 8-bit": RANKED,
    "stem + top 3 8-bit": ("_conv_stem", *RANKED),
    "blocks 0-1 8-bit (stem, block 0 project, block 1)": EARLY[:4],
    "stem to block 3 expand 8-bit (7 layers)": EARLY,
    "every layer 8-bit (u8u8 everywhere)": None,
}


def lscpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].strip()
    return ""


def one_thread_options() -> Any:
    """ONNX Runtime session options: one intra-op thread, warnings off (every engine here is timed so)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return so


def finish_recipe(v: Any, plan: Any, module: Any, calib: Any, names: list[str], nhwc: bool, alpha: float = 0.0,
                  reference: str = "model") -> float:
    """What ``int8.apply`` does after calibration, on the fake-quant model ``v`` in place: GPTQ rounding (towards
    ``reference`` with ``alpha > 0``), bias correction against the float ``module``, bias ranges, weights on their
    grids. Returns the rounding's CPU seconds."""
    from edgekit.compress.int8 import qdq
    from edgekit.compress.int8.equalize import correct_bias
    from edgekit.compress.int8.rounding import round_model

    c = time.process_time()
    with qdq.fast_fake_quant(v):
        round_model(v, plan, calib, names, channels_last=nhwc, alpha=alpha, reference=reference)
    rounding_cpu_s = time.process_time() - c
    with qdq.fast_fake_quant(v):
        correct_bias(v, plan, module, calib, names, channels_last=nhwc)
        qdq.fit_bias_range(v)
    qdq.clip_weights_to_grid(v, plan)
    return rounding_cpu_s


def cpu_ms(sess: Any, feeds: list[dict[str, Any]]) -> tuple[float, float]:
    """(CPU ms, wall ms) per image over ``feeds``, batch 1."""
    c, w = time.process_time(), time.perf_counter()
    for f in feeds:
        sess.run(None, f)
    return 1000 * (time.process_time() - c) / len(feeds), 1000 * (time.perf_counter() - w) / len(feeds)


def integer_convs(path: Path) -> dict[str, int]:
    """Op counts of the graph ONNX Runtime fuses (extended level), and the uint8-weight QLinearConvs."""
    from onnx import numpy_helper

    from edgekit.onnx_int8_kernels import fused_graph

    g = fused_graph(path).graph
    inits = {i.name: i for i in g.initializer}
    counts: dict[str, int] = {}
    for n in g.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
        if n.op_type == "QLinearConv" and n.input[3] in inits and numpy_helper.to_array(inits[n.input[3]]).dtype.kind == "u":
            counts["QLinearConv_u8_weights"] = counts.get("QLinearConv_u8_weights", 0) + 1
    return {k: counts.get(k, 0) for k in ("QLinearConv", "QLinearConv_u8_weights", "ConvInteger", "Conv", "QGemm",
                                         "DequantizeLinear", "QuantizeLinear")}


def engine_outputs(h: Any, module: Any, config: Any, record: dict[str, Any], out_dir: Path, val: Any,
                   names: list[str], so: Any) -> tuple[Path, Any, Any]:
    """A fake-quant model as the int8 step leaves it, exported (the step's graph rewrites applied) and run by
    ONNX Runtime on ``val``: (the graph's path, its session, its outputs)."""
    import numpy as np
    import onnxruntime as ort

    from edgekit.compress import config_to_dict, step_rewrite
    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.sources.handle import StepRecord

    handle = copy.copy(h)
    handle.module = module.eval()
    handle.steps = [*h.steps, StepRecord("int8", config_to_dict(config), record)]
    handle.step_rewrites = step_rewrite
    path = Path(export_onnx(handle, out_dir, ExportConfig(skip_parity=True))) / "model.onnx"
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    outs = np.concatenate([np.asarray(sess.run(None, {n: np.ascontiguousarray(b[n]) for n in names})[0])
                           for b in val.batches(16)])
    return path, sess, outs


def test_report(layers: str | None, rounds: int, images: int, out: str) -> None:
    import numpy as np
    import onnxruntime as ort

    from edgekit.artifact import read_manifest
    from edgekit.build import build_engine
    from edgekit.compress import StepContext, compress
    from edgekit.compress.int8.config import Int8Config
    from edgekit.runtimes.base import BuildOptions
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model
    from edgekit.targets import load_target

    t0, c0 = time.perf_counter(), time.process_time()
    config = Int8Config(u8u8_layers=tuple(k for k in (layers or "").split(",") if k and k != "none"))
    tmp = Path(tempfile.mkdtemp(prefix="edgekit-avx2-test-"))
    folder = compress("efficientnet-lite0", [("int8", config)], tmp / "int8", StepContext(target=load_target("cpu")))
    compress_cpu_s = time.process_time() - c0
    man = read_manifest(folder)
    m = man.metrics["int8"]
    meta = man.steps[-1]["meta"]
    engines = {}
    for name, src in (("fp32", "efficientnet-lite0"), ("int8", folder)):
        eng = build_engine(src, "cpu", tmp / f"engine-{name}", BuildOptions(threads=1))
        engines[name] = read_manifest(eng).path_of(eng, "model")
    so = one_thread_options()
    sess = {k: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"]) for k, p in engines.items()}
    h = load_model("efficientnet-lite0")
    ev = load_samples(None, h, split="eval", limit=images)
    names = [s.name for s in h.inputs]
    feeds = [{n: np.ascontiguousarray(ev.inputs[n][i:i + 1]) for n in names} for i in range(len(ev))]
    times: dict[str, list[tuple[float, float]]] = {"fp32": [], "int8": []}
    for r in range(rounds):
        for k in (("fp32", "int8") if r % 2 == 0 else ("int8", "fp32")):
            times[k].append(cpu_ms(sess[k], feeds))
    med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in times.items()}
    row = {"config": {"u8u8_layers": config.u8u8_layers}, "scheme": m["scheme"], "u8u8_layers": meta.get("u8u8_layers"),
           "eval_images": m["int8_engine"].get("samples") or len(load_samples(None, h, split="eval", limit=None)),
           "fake_quant": {k: m["int8_fake_quant"].get(k) for k in ("top1_agreement", "mean_kl")},
           "engine": {k: m["int8_engine"].get(k) for k in ("top1_agreement", "mean_kl", "kernels", "drop_from_fake_quant")},
           "fp32_cpu_ms": round(med["fp32"][0], 3), "int8_cpu_ms": round(med["int8"][0], 3),
           "fp32_wall_ms": round(med["fp32"][1], 3), "int8_wall_ms": round(med["int8"][1], 3),
           "speedup_cpu": round(med["fp32"][0] / med["int8"][0], 3), "ops": integer_convs(Path(engines["int8"])),
           "compress_cpu_s": round(compress_cpu_s, 1), "compress_seconds": m.get("seconds")}
    print(row)
    print(f"\n| setting | engine agreement (test) | engine KL | fake-quant agreement | CPU ms INT8 / FP32 | speed vs FP32 |"
          f"\n|---|---|---|---|---|---|\n| u8u8_layers={list(config.u8u8_layers)}"
          f" ({len(row['u8u8_layers'] or [])} layers) | {100 * row['engine']['top1_agreement']:.1f}% | "
          f"{row['engine']['mean_kl']:.4f} | {100 * row['fake_quant']['top1_agreement']:.1f}% | {row['int8_cpu_ms']:.2f} / "
          f"{row['fp32_cpu_ms']:.2f} | {row['speedup_cpu']:.2f}x |")
    atomic_write_json(Path(out), {
        "date": now_iso(), "machine": {**machine_info(), "flags": lscpu_flags(), "loadavg_end": os.getloadavg()},
        "versions": package_versions(), "settings": {"threads": 1, "rounds": rounds, "timing_images": images,
                                                     "split": "eval (test)"},
        "total_cpu_s": round(time.process_time() - c0, 1), "total_wall_s": round(time.perf_counter() - t0, 1),
        "row": row})
    print(f"\nwrote {out}")


# Calibration sets, one per seed: disjoint from validation (calib 128-255, train 0-255) and from each other.
CALIB_SETS = {0: ("calib", 0, 128), 1: ("train", 256, 384), 2: ("train", 384, 512), 3: ("train", 512, 640)}
BOTTLENECK_CONSUMER = "_blocks.1._expand_conv"  # reads conv2d_2, block 0's projection output (no activation)
# name -> (alpha of the asymmetric rounding, its reference (rounding.REFERENCES), rescale conv2d_2 with
# block 1's expand conv on exact 8-bit weights)
CANDIDATES: dict[str, tuple[float, str, bool]] = {
    "default (GPTQ, symmetric)": (0.0, "model", False),
    "asymmetric alpha 0.25 (own-input reference)": (0.25, "input", False),
    "asymmetric alpha 0.5 (own-input reference)": (0.5, "input", False),
    "rescale conv2d_2 + block 1 expand u8u8": (0.0, "model", True),
}
# Also measured, on seed 0 only (benchmarks/RESULTS.md, issue 26): GPTAQ's float-model reference at alpha
# 0.25 and 1.0 (84.4% -> 61.7% and 16.2% engine agreement) and with the rescaling (63.3%); select with --also.
MORE_CANDIDATES: dict[str, tuple[float, str, bool]] = {
    "GPTAQ alpha 0.25 (float-model reference)": (0.25, "model", False),
    "GPTAQ alpha 1.0 (float-model reference)": (1.0, "model", False),
    "rescale + GPTAQ alpha 0.25": (0.25, "model", True),
}


def candidate_seed(seed: int, variants: dict[str, tuple[float, str, bool]]) -> dict[str, Any]:
    """Every candidate on one calibration set, scored on validation (fake-quant and engine)."""
    import numpy as np
    import torch

    from edgekit.compress.int8 import qdq
    from edgekit.compress.int8.calibration import run_module, score
    from edgekit.compress.int8.config import Int8Config
    from edgekit.compress.int8.equalize import equalize, equalize_activation
    from edgekit.compress.int8.step import calibrate
    from edgekit.sources.data import Samples, load_samples
    from edgekit.sources.models import load_model

    torch.set_num_threads(1)
    c0, t0 = time.process_time(), time.perf_counter()
    h = load_model("efficientnet-lite0")
    names = [s.name for s in h.inputs]
    every = load_samples(None, h, split="calib", limit=256)
    split, lo, hi = CALIB_SETS[seed]
    calib = (every if split == "calib" else load_samples(None, h, split="train", limit=hi)).subset(slice(lo, hi))
    train = load_samples(None, h, split="train", limit=256)
    val = Samples("validation", "calib 128-255 + train 0-255",
                  {n: np.concatenate([every.inputs[n][128:], train.inputs[n]]) for n in names})
    module = h.module.eval()
    ref = run_module(module, val, names)
    config = Int8Config()
    tmp = Path(tempfile.mkdtemp(prefix="edgekit-avx2-candidates-"))
    so = one_thread_options()

    calibrated: dict[bool, tuple[Any, Any, bool, dict[str, Any]]] = {}
    for rescale in sorted({r for _, _, r in variants.values()}):
        c1 = time.process_time()
        gm, plan = qdq.prepare_qdq(copy.deepcopy(module), "u8s7")
        meta: dict[str, Any] = {"u8u8_layers": qdq.promote_u8u8(gm, plan, [BOTTLENECK_CONSUMER] if rescale else [])}
        meta["equalized"] = equalize(gm, plan)
        nhwc = qdq.channels_last_ok(gm, calib, names)
        if rescale:
            meta["activation_range_spread"] = equalize_activation(gm, [BOTTLENECK_CONSUMER], calib, names,
                                                                  channels_last=nhwc)
        qdq.update_weight_scales(gm, plan)
        calibrate(gm, calib, names, config.calibration_config(), channels_last=nhwc)
        meta["calibrate_cpu_s"] = round(time.process_time() - c1, 1)
        calibrated[rescale] = (gm, plan, nhwc, meta)

    rows = []
    for label, (alpha, reference, rescale) in variants.items():
        gm0, plan, nhwc, meta = calibrated[rescale]
        c1 = time.process_time()
        v = copy.deepcopy(gm0)
        rounding_cpu_s = finish_recipe(v, plan, module, calib, names, nhwc, alpha, reference)
        finish_cpu_s = time.process_time() - c1
        with qdq.fast_fake_quant(v):
            fake = score(run_module(v, val, names, channels_last=nhwc), ref, None, None)
        record = {"scheme": "u8s7", "u8u8_layers": meta["u8u8_layers"], "float_layers": [], "float_activations": [],
                  "equalized": meta["equalized"], "kernels": "int16-pairs"}
        path, _, outs = engine_outputs(h, v, config, record, tmp / f"s{seed}-{len(rows)}", val, names, so)
        engine = score(outs, ref, None, None)
        row = {"candidate": label, "seed": seed, "calibration": f"{split} {lo}-{hi - 1}", "alpha": alpha,
               "reference": reference if alpha > 0 else None, "rescale": rescale, "u8u8_layers": meta["u8u8_layers"],
               "activation_range_spread": meta.get("activation_range_spread"),
               "fake_quant_top1_agreement": round(fake["top1_agreement"], 4), "fake_quant_mean_kl": round(fake["mean_kl"], 5),
               "engine_top1_agreement": round(engine["top1_agreement"], 4), "engine_mean_kl": round(engine["mean_kl"], 5),
               "rounding_cpu_s": round(rounding_cpu_s, 1), "finish_cpu_s": round(finish_cpu_s, 1),
               "calibrate_cpu_s": meta["calibrate_cpu_s"], "ops": integer_convs(path), "loadavg": os.getloadavg()}
        print(row, flush=True)
        rows.append(row)
    return {"seed": seed, "rows": rows, "cpu_s": round(time.process_time() - c0, 1),
            "wall_s": round(time.perf_counter() - t0, 1)}


# (label, scheme, layers kept float with their exclusive inputs): the weight grids, and the pair-safe grid
# with the RGB stem in float (its 27-wide im2col rows run slower on the int8 kernels than on the float
# ones here, and its odd channel count coarsens its pair-safe grid), then also the depthwise conv that
# reads the stem (32 channels at 112x112, also slower as int8 here)
SCHEME_CANDIDATES = (("u8s7", "u8s7", ("none",)), ("u8s8p", "u8s8p", ("none",)),
                     ("u8s8p, float stem", "u8s8p", ("first",)),
                     ("u8s8p, float stem + depthwise", "u8s8p", ("first", "_blocks.0._depthwise_conv")))


def scheme_seed(seed: int, only: tuple[str, ...] = (), rounds: int = 5, images: int = 16) -> dict[str, Any]:
    """The weight grids (``only``: these variants) on one calibration draw, scored on validation, and their
    engines timed interleaved, ``rounds`` rounds of ``images`` batch-1 images (see ``--schemes``)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from edgekit.compress.int8 import qdq
    from edgekit.compress.int8.calibration import run_module, score
    from edgekit.compress.int8.config import Int8Config
    from edgekit.compress.int8.equalize import equalize
    from edgekit.compress.int8.sensitivity import exclusive_input_quants
    from edgekit.compress.int8.step import calibrate, resolve_keep_float
    from edgekit.onnx_int8_kernels import session_for
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    torch.set_num_threads(1)
    c0, t0 = time.process_time(), time.perf_counter()
    h = load_model("efficientnet-lite0")
    names = [s.name for s in h.inputs]
    calib = load_samples(None, h, split="calib", limit=128, seed=seed)
    val = load_samples(None, h, split="train", limit=None).subset(slice(0, 256))
    module = h.module.eval()
    ref = run_module(module, val, names)
    config = Int8Config()
    tmp = Path(tempfile.mkdtemp(prefix="edgekit-avx2-schemes-"))
    so = one_thread_options()

    def outputs(sess: Any) -> Any:
        return np.concatenate([np.asarray(sess.run(None, {n: np.ascontiguousarray(b[n]) for n in names})[0])
                               for b in val.batches(16)])

    rows: list[dict[str, Any]] = []
    sessions: dict[str, Any] = {}
    for label, scheme, keep in SCHEME_CANDIDATES:
        if only and label not in only:
            continue
        c1 = time.process_time()
        gm, plan = qdq.prepare_qdq(copy.deepcopy(module), scheme)
        kept = resolve_keep_float(keep, plan, scheme, gm)
        for name in kept:
            qdq.weight_quant(gm, plan.layers[name]).enabled = False
        equalized = equalize(gm, plan)
        nhwc = qdq.channels_last_ok(gm, calib, names)
        qdq.update_weight_scales(gm, plan)
        bits = []
        for name, qname in plan.layers.items():
            wq = qdq.weight_quant(gm, qname)
            if wq.reduced:  # the grid's step against the 7-bit grid's on the same weights
                w = qdq.get_attr(gm, name + ".weight").detach().reshape(wq.scale.shape[0], -1)
                bits.append(float(torch.log2(w.abs().amax(1) / 64 / wq.scale).mean()))
        calibrate(gm, calib, names, config.calibration_config(), channels_last=nhwc)
        float_inputs = []
        for q in exclusive_input_quants(gm, set(kept)):  # as the int8 step floats a kept layer's inputs
            qdq.act_quant(gm, q).mode = "float"
            float_inputs.append(plan.activations[q])
        finish_recipe(gm, plan, module, calib, names, nhwc)
        quantize_cpu_s = time.process_time() - c1
        with qdq.fast_fake_quant(gm):
            fake = score(run_module(gm, val, names, channels_last=nhwc), ref, None, None)
        record = {"scheme": scheme, "u8u8_layers": [], "float_layers": kept, "float_activations": float_inputs,
                  "equalized": equalized, "kernels": "int16-pairs"}
        path, sess, _ = engine_outputs(h, gm, config, record, tmp / f"s{seed}-{len(rows)}", val, names, so)
        sessions[label] = sess
        engine = score(outputs(session_for(path, "int16-pairs")), ref, None, None)
        exact = score(outputs(session_for(path, "int32")), ref, None, None)
        row = {"variant": label, "scheme": scheme, "float_layers": kept, "seed": seed, "calibration": f"calib split, 128 of 256 drawn with seed {seed}",
               "grid_bits_over_7bit": round(statistics.mean(bits), 3) if bits else None,
               "fake_quant_top1_agreement": round(fake["top1_agreement"], 4), "fake_quant_mean_kl": round(fake["mean_kl"], 5),
               "engine_top1_agreement": round(engine["top1_agreement"], 4), "engine_mean_kl": round(engine["mean_kl"], 5),
               "int32_top1_agreement": round(exact["top1_agreement"], 4), "int32_mean_kl": round(exact["mean_kl"], 5),
               "quantize_cpu_s": round(quantize_cpu_s, 1), "ops": integer_convs(path), "loadavg": os.getloadavg()}
        print(row, flush=True)
        rows.append(row)
    # this machine's own kernels, every engine and FP32 in every round (per-process CPU time beside wall time)
    from edgekit.export.onnx import ExportConfig, export_onnx

    fp32_path = Path(export_onnx(h, tmp / f"s{seed}-fp32", ExportConfig(skip_parity=True))) / "model.onnx"
    sessions["fp32"] = ort.InferenceSession(str(fp32_path), so, providers=["CPUExecutionProvider"])
    feeds = [{n: np.ascontiguousarray(val.inputs[n][i:i + 1]) for n in names} for i in range(images)]
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in sessions}
    for _ in range(rounds):
        for label, sess in sessions.items():
            times[label].append(cpu_ms(sess, feeds))
    for row in rows:
        t = times[row["variant"]]
        row["engine_cpu_ms"] = round(statistics.median(c for c, _ in t), 2)
        row["engine_wall_ms"] = round(statistics.median(w for _, w in t), 2)
        row["fp32_cpu_ms"] = round(statistics.median(c for c, _ in times["fp32"]), 2)
        row["speed_vs_fp32"] = round(row["fp32_cpu_ms"] / row["engine_cpu_ms"], 3)
    return {"seed": seed, "rows": rows, "cpu_s": round(time.process_time() - c0, 1),
            "wall_s": round(time.perf_counter() - t0, 1)}


def schemes(seeds: list[int], jobs: int, out: str, only: tuple[str, ...]) -> None:
    import functools
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.perf_counter()
    load_start = os.getloadavg()
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        runs = list(pool.map(functools.partial(scheme_seed, only=only), seeds))
    rows = [r for run in runs for r in run["rows"]]
    print("\n| variant | seed | grid bits over 7-bit | fake-quant agreement | fake-quant KL | engine agreement (int16 pairs) | "
          "engine KL | int32-model agreement | engine CPU ms | quantize CPU s |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['seed']} | {r['grid_bits_over_7bit']} | {100 * r['fake_quant_top1_agreement']:.1f}% | "
              f"{r['fake_quant_mean_kl']:.4f} | {100 * r['engine_top1_agreement']:.1f}% | {r['engine_mean_kl']:.4f} | "
              f"{100 * r['int32_top1_agreement']:.1f}% | {r['engine_cpu_ms']} | {r['speed_vs_fp32']:.2f}x | {r['quantize_cpu_s']} |")
    first = rows[0]["variant"]  # every other variant paired against the first on the same draw
    base = {r["seed"]: r for r in rows if r["variant"] == first}
    paired = [{"variant": r["variant"], "against": first, "seed": r["seed"],
               "agreement_points": round(100 * (r["engine_top1_agreement"] - base[r["seed"]]["engine_top1_agreement"]), 1),
               "kl_ratio": round(r["engine_mean_kl"] / base[r["seed"]]["engine_mean_kl"], 3),
               "cpu_ms_ratio": round(r["engine_cpu_ms"] / base[r["seed"]]["engine_cpu_ms"], 3)}
              for r in rows if r["variant"] != first]
    print(f"\npaired against {first!r} on the same draw:", paired)
    atomic_write_json(Path(out), {
        "date": now_iso(), "machine": {**machine_info(), "flags": lscpu_flags(), "loadavg_start": load_start,
                                       "loadavg_end": os.getloadavg()},
        "versions": package_versions(),
        "settings": {"threads": 1, "jobs": jobs, "seeds": seeds, "calibration": "calib split, 128 of 256 per seed",
                     "validation": "train split images 0-255 (101 photos, 155 Fashion-MNIST)",
                     "timing": "this machine's ONNX Runtime engines, 1 thread, 5 interleaved rounds of 16 batch-1 "
                               "validation images, medians"},
        "per_seed_cpu_s": {run["seed"]: run["cpu_s"] for run in runs}, "total_wall_s": round(time.perf_counter() - t0, 1),
        "paired": paired, "rows": rows})
    print(f"\nwrote {out}")


def spread(values: list[float], digits: int = 1) -> str:
    """mean (min..max)"""
    return f"{statistics.mean(values):.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"


def summarize(rows: list[dict[str, Any]], labels: list[str], seeds: int) -> list[dict[str, Any]]:
    """Per candidate: mean and range over seeds, and the paired difference to the default on the same
    calibration set (what decides: the seeds move every variant together). Prints the table."""
    keys = ("engine_top1_agreement", "engine_mean_kl", "fake_quant_top1_agreement", "fake_quant_mean_kl", "rounding_cpu_s")
    base = {r["seed"]: r for r in rows if r["candidate"] == labels[0]}
    summary = []
    print(f"\n| candidate | engine agreement, mean (min..max) over {seeds} seeds, % | paired change vs default, points | "
          "engine KL | paired KL change | fake-quant agreement, % | fake-quant KL | rounding CPU s |"
          "\n|---|---|---|---|---|---|---|---|")
    for label in labels:
        mine = [r for r in rows if r["candidate"] == label]
        pick = {k: [r[k] for r in mine] for k in keys}
        pct = {k: [round(100 * x, 1) for x in pick[k]] for k in ("engine_top1_agreement", "fake_quant_top1_agreement")}
        d_agree = [round(100 * (r["engine_top1_agreement"] - base[r["seed"]]["engine_top1_agreement"]), 1) for r in mine]
        d_kl = [round(r["engine_mean_kl"] - base[r["seed"]]["engine_mean_kl"], 5) for r in mine]
        summary.append({"candidate": label, **{f"{k}_mean": round(statistics.mean(v), 5) for k, v in pick.items()},
                        **{f"{k}_min": min(v) for k, v in pick.items()}, **{f"{k}_max": max(v) for k, v in pick.items()},
                        "paired_engine_agreement_points": d_agree, "paired_engine_kl": d_kl})
        print(f"| {label} | {spread(pct['engine_top1_agreement'])} | {spread(d_agree)} | {spread(pick['engine_mean_kl'], 4)} | "
              f"{spread(d_kl, 4)} | {spread(pct['fake_quant_top1_agreement'])} | {spread(pick['fake_quant_mean_kl'], 4)} | "
              f"{spread(pick['rounding_cpu_s'])} |")
    return summary


def candidates(seeds: list[int], jobs: int, out: str, also: bool) -> None:
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.perf_counter()
    load_start = os.getloadavg()
    variants = {**CANDIDATES, **(MORE_CANDIDATES if also else {})}
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            runs = list(pool.map(candidate_seed, seeds, [variants] * len(seeds)))
    else:
        runs = [candidate_seed(s, variants) for s in seeds]
    rows = [r for run in runs for r in run["rows"]]
    summary = summarize(rows, list(variants), len(seeds))
    atomic_write_json(Path(out), {
        "date": now_iso(), "machine": {**machine_info(), "flags": lscpu_flags(), "loadavg_start": load_start,
                                       "loadavg_end": os.getloadavg()},
        "versions": package_versions(),
        "settings": {"threads": 1, "jobs": jobs, "seeds": {s: CALIB_SETS[s] for s in seeds},
                     "validation": "calib 128-255 + train 0-255 (384 images)", "scheme": "u8s7"},
        "per_seed_cpu_s": {run["seed"]: run["cpu_s"] for run in runs}, "total_wall_s": round(time.perf_counter() - t0, 1),
        "summary": summary, "rows": rows})
    print(f"\nwrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--images", type=int, default=24, help="batch-1 images per timing round")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "int8_avx2_recovery.json"))
    ap.add_argument("--test-report", nargs="?", const="", default=None, metavar="LAYERS",
                    help="report on the test images instead: compress + build with these u8u8_layers (default: none)")
    ap.add_argument("--candidates", action="store_true",
                    help="compare the activation-error candidates over calibration seeds on validation")
    ap.add_argument("--seeds", default="0,1,2", help="calibration sets for --candidates (0-3)")
    ap.add_argument("--jobs", type=int, default=1, help="--candidates: seeds run in this many processes")
    ap.add_argument("--also", action="store_true", help="--candidates: also GPTAQ's float-model reference")
    ap.add_argument("--schemes", action="store_true",
                    help="compare the weight grids u8s7 and u8s8p (and u8s8p with the stem in float) over calibration "
                         "draws on validation")
    ap.add_argument("--variants", default="", help="--schemes: only these variants, ';'-separated (default: all)")
    ap.add_argument("--table", metavar="JSON", help="print a --candidates result's table again (and store its summary)")
    args = ap.parse_args()
    if args.table:
        import json

        result = json.loads(Path(args.table).read_text())
        labels = list(dict.fromkeys(r["candidate"] for r in result["rows"]))
        result["summary"] = summarize(result["rows"], labels, len(result["settings"]["seeds"]))
        atomic_write_json(Path(args.table), result)
        return
    if args.schemes:
        out = args.out if args.out != ap.get_default("out") else str(ROOT / "benchmarks" / "results" / "int8_avx2_schemes.json")
        labels = tuple(label for label, _, _ in SCHEME_CANDIDATES)
        only = tuple(v.strip() for v in args.variants.split(";")) if args.variants else ()
        for v in only:
            if v not in labels:
                ap.error(f"--variants: {v!r}; valid variants are {'; '.join(labels)}")
        schemes([int(k) for k in args.seeds.split(",")], args.jobs, out, only)
        return
    if args.candidates:
        seeds = [int(k) for k in args.seeds.split(",")]
        if any(k not in CALIB_SETS for k in seeds):
            ap.error(f"--seeds: {args.seeds!r}; valid seeds are {sorted(CALIB_SETS)}")
        out = args.out if args.out != ap.get_default("out") else str(ROOT / "benchmarks" / "results" / "int8_avx2_candidates.json")
        candidates(seeds, args.jobs, out, args.also)
        return
    if args.test_report is not None:
        out = args.out if args.out != ap.get_default("out") else str(ROOT / "benchmarks" / "results" / "int8_avx2_test.json")
        test_report(args.test_report or None, args.rounds, args.images, out)
        return
    import numpy as np
    import onnxruntime as ort
    import torch

    from edgekit.compress.int8 import qdq
    from edgekit.compress.int8.calibration import run_module, score
    from edgekit.compress.int8.config import Int8Config
    from edgekit.compress.int8.equalize import equalize
    from edgekit.compress.int8.step import calibrate
    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.sources.data import Samples, load_samples
    from edgekit.sources.models import load_model

    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), time.process_time()
    h = load_model("efficientnet-lite0")
    every = load_samples(None, h, split="calib", limit=256)
    train = load_samples(None, h, split="train", limit=256)
    calib = every.subset(slice(0, 128))
    names = [s.name for s in h.inputs]
    val = Samples("validation", "calib 128-255 + train 0-255",
                  {n: np.concatenate([every.inputs[n][128:], train.inputs[n]]) for n in names})
    module = h.module.eval()
    ref = run_module(module, val, names)

    # the default recipe's calibration, once (what int8.apply does before GPTQ rounding)
    config = Int8Config()
    gm, plan = qdq.prepare_qdq(copy.deepcopy(module), "u8s7")
    equalized = equalize(gm, plan)
    nhwc = qdq.channels_last_ok(gm, calib, names)
    qdq.update_weight_scales(gm, plan)
    calibrate(gm, calib, names, config.calibration_config(), channels_last=nhwc)
    calib_cpu_s = time.process_time() - c0
    print(f"calibrated in {calib_cpu_s:.0f} CPU s ({time.perf_counter() - t0:.0f} s wall)", flush=True)

    rows, models = [], {}
    for label, chosen in VARIANTS.items():
        c1 = time.process_time()
        v = copy.deepcopy(gm)
        layers = qdq.promote_u8u8(v, plan, qdq.u8u8_candidates(v, plan) if chosen is None else list(chosen))
        finish_recipe(v, plan, module, calib, names, nhwc)
        with qdq.fast_fake_quant(v):
            fake = score(run_module(v, val, names, channels_last=nhwc), ref, None, None)
        row = {"variant": label, "u8u8_layers": layers, "fake_quant_top1_agreement": round(fake["top1_agreement"], 4),
               "fake_quant_mean_kl": round(fake["mean_kl"], 5), "finish_cpu_s": round(time.process_time() - c1, 1)}
        rows.append(row)
        models[label] = v
        print(row, flush=True)

    best = min(rows[1:-1], key=lambda r: r["fake_quant_mean_kl"])["variant"]
    tmp = Path(tempfile.mkdtemp(prefix="edgekit-avx2-recovery-"))
    fp32_path = Path(export_onnx(h, tmp / "fp32", ExportConfig(skip_parity=True))) / "model.onnx"
    so = one_thread_options()
    fp32 = ort.InferenceSession(str(fp32_path), so, providers=["CPUExecutionProvider"])
    feeds = [{n: np.ascontiguousarray(val.inputs[n][i:i + 1]) for n in names} for i in range(args.images)]
    for row in rows:
        if row["variant"] not in (rows[0]["variant"], best, rows[-1]["variant"]):
            continue
        meta = {"scheme": "u8s7", "u8u8_layers": row["u8u8_layers"], "float_layers": [], "float_activations": [],
                "equalized": equalized, "kernels": "int16-pairs"}
        path, sess, outs = engine_outputs(h, models[row["variant"]], config, meta, tmp / f"v{rows.index(row)}", val, names,
                                    so)
        engine = score(outs, ref, None, None)
        cpu_f, cpu_q, wall_f, wall_q = [], [], [], []
        for r in range(args.rounds):  # interleaved, the order alternating
            pair = [(fp32, cpu_f, wall_f), (sess, cpu_q, wall_q)]
            for s, cl, wl in (pair if r % 2 == 0 else pair[::-1]):
                c, w = cpu_ms(s, feeds)
                cl.append(c)
                wl.append(w)
        row.update({"engine_top1_agreement": round(engine["top1_agreement"], 4),
                    "engine_mean_kl": round(engine["mean_kl"], 5),
                    "fp32_cpu_ms": round(statistics.median(cpu_f), 3), "int8_cpu_ms": round(statistics.median(cpu_q), 3),
                    "fp32_wall_ms": round(statistics.median(wall_f), 3), "int8_wall_ms": round(statistics.median(wall_q), 3),
                    "ops": integer_convs(path), "loadavg": os.getloadavg()})
        row["speedup_cpu"] = round(row["fp32_cpu_ms"] / row["int8_cpu_ms"], 3)
        print(row, flush=True)

    print("\n| variant | 8-bit layers | fake-quant agreement | fake-quant KL | engine agreement | engine KL | "
          "CPU ms INT8 / FP32 | speed vs FP32 | QLinearConv (u8 weights) | float Conv |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        eng = (f"{100 * r['engine_top1_agreement']:.1f}% | {r['engine_mean_kl']:.4f} | {r['int8_cpu_ms']:.2f} / "
               f"{r['fp32_cpu_ms']:.2f} | {r['speedup_cpu']:.2f}x | {r['ops']['QLinearConv']} "
               f"({r['ops']['QLinearConv_u8_weights']}) | {r['ops']['Conv']}") if "ops" in r else "- | - | - | - | - | -"
        print(f"| {r['variant']} | {len(r['u8u8_layers'])} | {100 * r['fake_quant_top1_agreement']:.1f}% | "
              f"{r['fake_quant_mean_kl']:.4f} | {eng} |")
    atomic_write_json(Path(args.out), {
        "date": now_iso(), "machine": {**machine_info(), "flags": lscpu_flags(), "loadavg_end": os.getloadavg()},
        "versions": package_versions(),
        "settings": {"threads": 1, "rounds": args.rounds, "timing_images": args.images, "calibration": "calib 0-127",
                     "validation": "calib 128-255 + train 0-255 (384 images)"},
        "lowest_validation_kl": best, "calibration_cpu_s": round(calib_cpu_s, 1), "total_cpu_s": round(time.process_time() - c0, 1),
        "total_wall_s": round(time.perf_counter() - t0, 1), "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
