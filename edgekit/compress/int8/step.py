"""INT8 post-training quantization and quantization-aware training (the "int8" step).

    compress("efficientnet-lite0", [("int8", Int8Config())], "out/int8", StepContext(target=cpu))

What it does, in order (``apply``):

1. picks the Q/DQ *scheme* from the target unless given: ONNX Runtime on x86 ("u8s8":
   uint8 activations, int8 weights: what its VNNI kernels run fast), TensorRT targets
   ("trt": symmetric int8 on both, Q/DQ at conv/matmul inputs and on residual adds);
2. traces the model into a fake-quant ``GraphModule`` (``qdq.prepare_qdq``): batch norms
   folded, per-channel int8 weights, per-tensor activations placed on tensors so that
   the engines fuse them;
3. optionally equalizes ranges across layers (``equalize.py``: cross-layer equalization,
   Nagel et al. 2019, only across ReLU where it is exact);
4. calibrates the activations in one streaming pass (bounded histograms), picks ranges
   by minmax / percentile / entropy / mse (default: mse), rounds the weights against each
   layer's output error on calibration inputs (``rounding.py``, default; same int8 grid),
   then corrects the bias shift that weight quantization causes (empirical bias
   correction); ``keep_float`` layers (e.g. "first") keep float weights and inputs;
5. optionally fine-tunes (QAT, ``qat.py``: straight-through estimator, optional
   learnable scales, checkpoints and resume);
6. with ``max_accuracy_drop``, keeps the most sensitive layers in float until the drop,
   measured on calib-split samples held out of calibration, is within it
   (``sensitivity.py``); then evaluates against the float model on the eval split.

The result is the fake-quant handle (``STEP.transitions``: float -> "fake-quant"); export turns it into
a QDQ ONNX graph (``rewrite_onnx`` -> ``qdq_onnx.rewrite_qdq``). An ONNX-only model (no
PyTorch module) is quantized from its graph instead (``onnx_graph.py``).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import torch
import torch.fx as fx
import torch.nn as nn

from edgekit import interrupts
from edgekit.compress import Step, StepContext, config_to_dict, step_rewrite
from edgekit.compress.int8 import qdq, qdq_onnx
from edgekit.compress.int8.calibration import (
    check_agreement,
    load_split,
    run_module,
    score,
    tensor_batches,
)
from edgekit.compress.int8.calibration import quality as quality_of
from edgekit.compress.int8.config import TORCH_CALIB_METHOD, Int8Config
from edgekit.compress.int8.equalize import correct_bias, equalize, relu6_to_relu
from edgekit.compress.int8.onnx_graph import eval_limit, quantize_onnx_handle  # the ONNX-graph path
from edgekit.compress.int8.qat import train_qat
from edgekit.compress.int8.rounding import round_model
from edgekit.compress.int8.sensitivity import exclusive_input_quants, fall_back
from edgekit.compress.int8.smooth import smooth
from edgekit.compress.int8.technique_configs import MIN_CALIB_SAMPLES, CalibrationConfig, FallbackConfig
from edgekit.compress.quality import BOUNDS_8BIT
from edgekit.errors import BadInputError, CheckFailedError, bad_choice
from edgekit.export.onnx import ExportConfig, export_onnx
from edgekit.memory import release_memory, reuse_freed_memory
from edgekit.onnx_int8_kernels import describe_semantics, semantics_for_target, session_for
from edgekit.runtimes import get_runtime
from edgekit.sources.data import Samples
from edgekit.sources.handle import ModelHandle, StepRecord
from edgekit.targets import HOST_TARGET, Target, load_target

# ONNX Runtime's INT8 engine against the PyTorch fake-quant model: the engine requantizes in
# integer arithmetic, so values may land one quantization step away and the difference grows
# through the layers. (atol, rtol) for export parity; tests pin tighter bounds per model.
PARITY_TOLERANCE = (0.25, 0.1)

def resolve_scheme(config: Int8Config, target: Target | None) -> str:
    """The Q/DQ flavour: explicit, else the one the target's runtimes require
    (``Runtime.int8_scheme``: the first runtime's, or on a GPU target any of its runtimes',
    e.g. TensorRT's "trt"), else the one the CPU's integer kernels compute exactly: "u8s8" where
    they sum in int32 (VNNI, AMX, arm64), "u8s8p" (8-bit weights on the pair-safe grid, ``pairs``)
    where they sum pairs of products in a saturating int16 (x86 without VNNI), "u8s7" (7-bit weights,
    exact however a kernel pairs its products) where the target does not say its CPU. Without a
    target, this machine's CPU."""
    return scheme_choice(config, target)[0]


def scheme_choice(config: Int8Config, target: Target | None) -> tuple[str, str]:
    """(scheme, why) for ``resolve_scheme``."""
    if config.scheme is not None:
        return config.scheme, "given"
    if target is None:
        target = load_target(HOST_TARGET)
    required = [get_runtime(name).int8_scheme for name in target.runtimes]
    if required and required[0] is not None:
        return required[0], f"what {target.runtimes[0]} runs on target {target.name!r}"
    if target.has_gpu:
        gpu = next((s for s in required if s is not None), None)
        if gpu is not None:
            return gpu, f"what the GPU runtimes of target {target.name!r} run"
    kernel = target.int8_kernel
    if kernel is None:
        return "u8s7", (f"target {target.name!r} does not say its CPU (arch, isa): 7-bit weights, exact on every "
                        "CPU's integer kernels")
    if kernel.saturates:
        return "u8s8p", (f"target {target.name!r}: {kernel.description}; 8-bit weights on the pair-safe grid "
                         "keep those sums exact")
    return "u8s8", f"target {target.name!r}: {kernel.description}"


# ------------------------------------------------------------------------------------------
# Data


def resolve_u8u8_layers(config: Int8Config, plan: qdq.QuantPlan, scheme: str) -> list[str]:
    """Layer names from ``Int8Config.u8u8_layers`` under ``scheme`` ("first": the first quantizable
    layer); none under schemes other than "u8s8p" and "u8s7". A name the model lacks is refused, naming
    the layers."""
    if scheme not in qdq.SATURATION_SAFE:
        return []
    order = list(plan.layers)
    out: list[str] = []
    for k in config.u8u8_layers:
        name = order[0] if k == "first" else k
        if name not in plan.layers:
            raise bad_choice("layer for exact 8-bit weights", k, ["first", *order])
        if name not in out:
            out.append(name)
    return out


# Schemes under which an image stem stays float unless ``keep_float`` says otherwise: the first layer when it
# is a convolution over at most STEM_CHANNELS input channels, and the depthwise convolution that alone reads
# its output (MobileNet, EfficientNet). On x86 without VNNI both run slower on the int8 kernels than on the
# float ones (EfficientNet-Lite0 on an AVX2 AMD EPYC: the stem 0.62 ms as QLinearConv against 0.44 ms, its
# im2col rows 27 wide, with an explicit pad and an NHWC transpose around it; the 32-channel depthwise conv at
# 112x112 0.32 against 0.24 ms), the stem's odd channel count makes the pair-safe grid keep two pairings,
# and the first activations carry the largest share of the INT8 error (benchmarks/RESULTS.md, issue 26:
# "The image stem in float").
STEM_FLOAT_SCHEMES = ("u8s8p",)
STEM_CHANNELS = 4


def image_stem(gm: fx.GraphModule, plan: qdq.QuantPlan) -> list[str]:
    """The layers an image stem is made of: the first quantizable layer when it is a (non-grouped)
    convolution reading at most ``STEM_CHANNELS`` channels, and the depthwise convolution that alone
    reads its output (through its activation, quantizers and padding), if there is one; else none."""
    layer_of = qdq.quantized_layers(gm)
    first = next(iter(plan.layers), None)
    stem = next((n for n, name in layer_of.items() if name == first), None)
    if stem is None or not qdq.is_conv(gm, stem):
        return []
    w = qdq.get_attr(gm, qdq.param_paths(gm, stem)[0])
    if qdq.conv_groups(stem) != 1 or w.dim() < 3 or w.shape[1] > STEM_CHANNELS:
        return []
    n = stem
    for _ in range(8):  # the activation, its quantizer, a pad and the quantizer again
        if len(n.users) != 1:
            break
        (n,) = n.users
        if n in layer_of:
            depthwise = qdq.is_conv(gm, n) and qdq.conv_groups(n) > 1 and qdq.conv_groups(n) == w.shape[0]
            return [str(first), layer_of[n]] if depthwise else [str(first)]
    return [str(first)]


def resolve_keep_float(keep: tuple[str, ...], plan: qdq.QuantPlan, scheme: str, gm: fx.GraphModule) -> list[str]:
    """Layer names from ``Int8Config.keep_float`` ("first" / "last": the first / last
    quantizable layer in graph order; "none": nothing). Not given: the image stem's layers under
    ``STEM_FLOAT_SCHEMES`` (``image_stem``), else nothing."""
    if not keep:
        return image_stem(gm, plan) if scheme in STEM_FLOAT_SCHEMES else []
    order = list(plan.layers)
    out: list[str] = []
    for k in keep:
        if k == "none":
            continue
        name = order[0] if k == "first" else order[-1] if k == "last" else k
        if name not in plan.layers:
            raise bad_choice("layer to keep in float", k, ["first", "last", "none", *order])
        if name not in out:
            out.append(name)
    return out


def _calibration_samples(handle: ModelHandle, config: CalibrationConfig, fallback: FallbackConfig | None,
                         ctx: StepContext) -> tuple[Samples, Samples | None]:
    """(calibration samples, fallback samples): with a fallback, the calib split's samples after
    the first ``config.samples`` are held out for the fallback's measurements (the calibration
    samples themselves when the split has no more); else (samples, None)."""
    extra = int(fallback.samples) if fallback is not None else 0
    try:
        samples = load_split(handle, ctx, "calib", config.samples + extra)
    except BadInputError:
        if not extra:
            raise
        samples = load_split(handle, ctx, "calib", None)  # a split smaller than the limit
    need = min(MIN_CALIB_SAMPLES, config.samples)
    if len(samples) < need:
        raise BadInputError(f"calibration data {samples.source!r} has {len(samples)} samples; INT8 calibration "
                            f"needs at least {need}")
    if not extra:
        return samples, None
    n = min(config.samples, len(samples))
    calib = samples.subset(slice(0, n))
    held = samples.subset(slice(n, len(samples))) if len(samples) - n >= MIN_CALIB_SAMPLES else calib
    return calib, held


def parity_tolerance(module: nn.Module, handle: ModelHandle) -> dict[str, float]:
    """Export parity tolerance of the INT8 engine against the fake-quant model: PARITY_TOLERANCE,
    with atol widened to 5% of the output's largest magnitude on the model's sample inputs
    (about six int8 steps of the output: the engine requantizes every layer in integer
    arithmetic, so off-by-one roundings add up through a deep network)."""
    atol, rtol = PARITY_TOLERANCE
    try:
        feeds = handle.sample_inputs(2)
        with torch.no_grad():
            out = module(*[torch.from_numpy(feeds[s.name]) for s in handle.inputs])
        outs = out if isinstance(out, (tuple, list)) else (out,)
        absmax = max(float(o.detach().abs().max()) for o in outs if torch.is_tensor(o))
        atol = max(atol, 0.05 * absmax)
    except Exception as e:  # the sample inputs are a convenience; fall back to the fixed tolerance
        interrupts.reraise(e)
    return {"atol": round(atol, 6), "rtol": rtol}


# ------------------------------------------------------------------------------------------
# The step


class Phases:
    """Wall and CPU seconds (this process, all threads) per phase of the step: where the time goes."""

    def __init__(self) -> None:
        self.record: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            got = self.record.setdefault(name, {"wall": 0.0, "cpu": 0.0})
            got["wall"] = round(got["wall"] + time.perf_counter() - w0, 3)
            got["cpu"] = round(got["cpu"] + time.process_time() - c0, 3)


def apply(handle: ModelHandle, config: Int8Config, ctx: StepContext) -> ModelHandle:

    scheme, why = scheme_choice(config, ctx.target)
    kernels = semantics_for_target(ctx.target if ctx.target is not None else load_target(HOST_TARGET))
    if scheme == "trt":
        kernels = "float-qdq"  # TensorRT's explicit quantization, whatever the target says of its CPU
    if config.smooth_alpha is not None and not (handle.kind == "causal-lm" and handle.module is not None):
        # smoothing folds scales into a PyTorch decoder's norms and linears: asked of anything else it
        # would do nothing, and an option that does nothing is refused rather than ignored
        raise BadInputError(f"--smooth-alpha applies to causal LMs with their PyTorch weights; {handle.name!r} is "
                            f"{'an ONNX graph' if handle.module is None else 'a ' + handle.kind + ' model'} "
                            "(leave --smooth-alpha out)")
    # the model kind's defaults (a causal LM's calibration windows and smoothing): what the step records is what ran
    smoothing_asked = config.smooth_alpha is not None
    config = config.for_model(handle.kind, smoothable=handle.kind == "causal-lm" and handle.module is not None)
    if config.u8u8_layers and (handle.module is None or handle.kind == "causal-lm"):
        # layer names of the fake-quant PyTorch graph: a graph quantized from ONNX has none of them
        raise BadInputError(f"u8u8_layers applies to models quantized through their PyTorch graph; {handle.name!r} is "
                            "quantized from its ONNX graph (leave u8u8_layers out)")
    if handle.module is None:
        if handle.onnx_path is None:
            raise BadInputError(f"model {handle.name!r} has neither a PyTorch module nor an ONNX graph to quantize")
        if config.method != "ptq":
            raise BadInputError(f"model {handle.name!r} is an ONNX file without a PyTorch module: only --method ptq "
                                "is possible (QAT needs the PyTorch model)")
        if config.max_accuracy_drop is not None:
            raise BadInputError(f"--max-accuracy-drop needs the PyTorch model; {handle.name!r} is ONNX-only")
        return _with_record(*quantize_onnx_handle(handle, config.onnx_graph_config(), ctx, scheme, kernels), config)
    if any(s.name == "int8" for s in handle.steps):
        raise BadInputError(f"model {handle.name!r} is already INT8-quantized")
    with reuse_freed_memory():  # every pass allocates and frees the same activations batch after batch
        quantized = _quantize_module(handle, handle.module, config, ctx, scheme, why, kernels)
    # None: not traceable by torch.fx (e.g. Hugging Face control flow): quantize its exported ONNX graph
    return quantized or _quantize_via_onnx(handle, config, ctx, scheme, kernels, smoothing_asked)


def _quantize_module(handle: ModelHandle, module: nn.Module, config: Int8Config, ctx: StepContext, scheme: str,
                     why: str, kernels: str) -> ModelHandle | None:
    """The PyTorch path of ``apply``: fake-quant graph, calibration, rounding, bias correction, the gate;
    None where torch.fx cannot trace the model (``module``: ``handle``'s)."""
    torch.manual_seed(ctx.seed)
    names = [s.name for s in handle.inputs]
    t_start = time.perf_counter()
    phases = Phases()
    with phases("load_data"):
        calib, held_out = _calibration_samples(handle, config.calibration_config(), config.fallback_config(), ctx)
    float_module = module.eval()
    reference = copy.deepcopy(float_module)

    work = copy.deepcopy(float_module)
    meta: dict[str, Any] = {"scheme": scheme, "scheme_reason": why, "equalized": [], "relu6_to_relu": False}
    try:
        gm, plan = qdq.prepare_qdq(work, scheme)
    except qdq.TraceError as e:
        if config.method != "ptq" or config.max_accuracy_drop is not None or config.u8u8_layers:
            raise BadInputError(f"model {handle.name!r} cannot be traced by torch.fx ({e}); only plain PTQ "
                                "through its ONNX graph is possible (no --method qat, no --max-accuracy-drop, "
                                "no u8u8_layers)") from None
        return None
    kept_float = resolve_keep_float(config.keep_float, plan, scheme, gm)
    u8u8 = resolve_u8u8_layers(config, plan, scheme)
    if not config.keep_float and set(kept_float) & set(u8u8):
        kept_float = []  # a stem layer asked to be integer (u8u8_layers): the default float stem gives way
    elif kept_float and not config.keep_float:
        meta["keep_float_reason"] = (f"scheme {scheme}: the image stem ({', '.join(kept_float)}) runs faster on float "
                                     "kernels than on these CPUs' int8 ones, and keeps the image and the first "
                                     "activations exact (--keep-float none quantizes it)")
    for name in kept_float:  # before bias correction, which skips float layers
        qdq.weight_quant(gm, plan.layers[name]).enabled = False
    # exact 8-bit weights (u8 x u8 kernels) for the layers 7-bit weights cost most, before weight scales,
    # GPTQ rounding and bias correction, which then work on their 8-bit grid
    meta["u8u8_layers"] = qdq.promote_u8u8(gm, plan, u8u8)
    if config.equalize:
        with phases("equalize"):
            meta["equalized"] = equalize(gm, plan)
    nhwc = qdq.channels_last_ok(gm, calib, names)  # NHWC-ordered inputs: faster convolutions in every pass below
    with phases("calibrate"):
        qdq.update_weight_scales(gm, plan)
        calibrate(gm, calib, names, config.calibration_config(), channels_last=nhwc)
    float_inputs: list[str] = []
    if kept_float:  # their inputs too, else ONNX Runtime quantizes the float weights itself
        for q in exclusive_input_quants(gm, set(kept_float)):
            qdq.act_quant(gm, q).mode = "float"
            float_inputs.append(plan.activations[q])
    meta["float_activations"] = float_inputs
    with qdq.fast_fake_quant(gm):  # inference passes: the fast, bit-identical fake-quant
        rounding = config.rounding_config()
        if rounding.rounding == "gptq":
            with phases("gptq_rounding"):
                meta["gptq"] = round_model(gm, plan, calib, names, channels_last=nhwc)
        if rounding.bias_correction:
            with phases("bias_correction"):
                meta["bias_corrected"] = correct_bias(gm, plan, float_module, calib, names, channels_last=nhwc)
        meta["bias_range_fixed_channels"] = qdq.fit_bias_range(gm)
    qdq.clip_weights_to_grid(gm, plan)
    ptq_seconds = time.perf_counter() - t_start

    # evaluation data and the FP32 reference outputs on it
    evaluator = handle.evaluator
    ev = None
    try:
        ev = load_split(handle, ctx, "eval", eval_limit(handle, config.eval_samples))
    except BadInputError:
        if ctx.eval is not None:
            raise
    metrics: dict[str, Any] = {"scheme": scheme, "calib_method": config.calib_method or TORCH_CALIB_METHOD,
                               "calib_samples": len(calib), "ptq_seconds": round(ptq_seconds, 3)}
    with phases("evaluate_float"):
        # 8 images a batch: freed memory is kept for reuse here, and 32 images' activations (150 MB a tensor
        # at 224x224) left 0.5 GB of it behind
        ref_out = run_module(reference, ev, names, 8, channels_last=nhwc) if ev is not None else None
    if ev is not None and ref_out is not None:
        metrics["fp32"] = score(ref_out, ref_out, ev.labels, evaluator)

    if config.method == "qat":
        metrics["qat"] = train_qat(gm, reference, handle, load_split(handle, ctx, "train", None), config.qat_config(),
                                   ctx, names, run_key=config_to_dict(config))
        meta["bias_range_fixed_channels"] = qdq.fit_bias_range(gm)
        qdq.clip_weights_to_grid(gm, plan)

    float_layers: list[str] = list(kept_float)
    with qdq.fast_fake_quant(gm):
        fallback = config.fallback_config()
        if fallback is not None and held_out is not None:  # held out exactly then
            # measured on calibration-split samples held out of range calibration, never on eval
            held_ref = run_module(reference, held_out, names)
            report = fall_back(gm, plan, held_out, names, held_ref, score(held_ref, held_ref, held_out.labels, evaluator),
                               fallback, evaluator, promote=scheme in qdq.SATURATION_SAFE)
            report["held_out_of_calibration"] = held_out is not calib
            float_layers += [n for n in report["float_layers"] if n not in float_layers]
            meta["float_activations"] = [t for t in plan.activations.values()
                                         if t in float_inputs or t in report["float_activations"]]
            metrics["fallback"] = report
            meta["u8u8_layers"] = qdq.u8u8_layers(gm, plan)
            if report.get("u8u8_layers"):
                meta["bias_range_fixed_channels"] += qdq.fit_bias_range(gm)
                qdq.clip_weights_to_grid(gm, plan)
    if meta["u8u8_layers"]:
        meta["u8u8_reason"] = ("exact 8-bit weights stored as uint8 (zero point 128): ONNX Runtime runs these layers "
                               "on u8 x u8 kernels, exact without VNNI, where 7-bit weights cost the most accuracy")
    gm.eval()
    meta["kernels"] = kernels
    meta.update({"layers": sorted(plan.layers), "float_layers": float_layers,
                 "activations": len(plan.activations), "folded_bn": len(plan.folded_bn),
                 # read by export_onnx (effective_tolerances), and kept in the saved record
                 "parity": parity_tolerance(gm, handle)})
    new = copy.copy(handle)
    new.module = gm
    new.steps = [*handle.steps, StepRecord("int8", config_to_dict(config), meta)]
    new.step_rewrites = step_rewrite  # export applies the steps' graph rewrites
    new.extra = {**handle.extra, "int8_scheme": scheme, "parity_tolerance": PARITY_TOLERANCE}
    metrics["parity_tolerance"] = {"atol": PARITY_TOLERANCE[0], "rtol": PARITY_TOLERANCE[1]}
    if ev is not None and ref_out is not None:
        # the PyTorch passes' freed memory back to the system before ONNX Runtime's sessions take theirs
        release_memory(collect=False)
        metrics["int8_fake_quant"], metrics["int8_engine"] = _evaluate_graph(new, ev, ref_out, evaluator, ctx, phases)
    metrics["seconds"] = phases.record
    ctx.metrics["int8"] = metrics
    return new


# How far the engine may fall below the fake-quant model it was exported from, in the quality measure
# (top-1 agreement / accuracy / mean cosine): integer requantization rounds differently by a step now
# and then; a kernel that computes something else (int16 overflow) costs tens of points.
ENGINE_DROP = 0.03


def _evaluate_graph(handle: ModelHandle, ev: Samples, ref_out: Any, evaluator: str | None, ctx: StepContext,
                    phases: Phases) -> tuple[dict[str, Any], dict[str, Any]]:
    """The INT8 graph the model exports to, against the float model on the evaluation data, twice:
    with Q/DQ computed in float (what the fake-quant model computes: the "int8_fake_quant" figures) and as
    the target's integer kernels run it (this machine's ONNX Runtime when they are this machine's, else
    their model: ``onnx_int8_kernels``; the "int8_engine" figures). One export; where the target's
    kernels are Q/DQ in float (TensorRT), one evaluation serves both. The engine more than
    ``ENGINE_DROP`` below the fake-quant figures: ``CheckFailedError`` (exit 1) now, before anything is
    written, unless the loss is accepted."""
    import numpy as np

    kernels = next(str(r.meta.get("kernels")) for r in reversed(handle.steps) if r.name == "int8")
    names = [s.name for s in handle.inputs]
    first = handle.inputs[0].shape[0] if handle.inputs and handle.inputs[0].shape else None
    batch = first if isinstance(first, int) else 16

    def evaluate(path: Path, semantics: str) -> dict[str, Any]:
        sess = session_for(path, semantics)
        outs = [np.asarray(sess.run(None, {n: np.ascontiguousarray(b[n]) for n in names})[0], np.float32)
                for b in ev.batches(batch)]
        return score(np.concatenate(outs), ref_out, ev.labels, evaluator)

    with tempfile.TemporaryDirectory(prefix="edgekit-int8-engine-") as tmp:
        with phases("export"):
            path = Path(export_onnx(handle, Path(tmp) / "onnx", ExportConfig(skip_parity=True))) / "model.onnx"
        with phases("evaluate_fake_quant"):
            fake = {**evaluate(path, "float-qdq"), "via": describe_semantics("float-qdq")}
        with phases("engine_check"):
            result = dict(fake) if kernels == "float-qdq" else evaluate(path, kernels)
    result["kernels"] = describe_semantics(kernels)
    result.pop("via", None)
    drop = quality_of(fake) - quality_of(result)
    bound = max(ENGINE_DROP, 3.0 / max(len(ev), 1))  # three samples' worth on a small evaluation set
    result["drop_from_fake_quant"] = round(drop, 4)
    check_agreement(result, evaluator, len(ev), f"the INT8 graph on {result['kernels']}", ctx.accept_quality_loss)
    if drop > bound and not ctx.accept_quality_loss:
        raise CheckFailedError(
            f"the INT8 graph loses {100 * drop:.1f} points against its fake-quant model on {result['kernels']} "
            f"({100 * quality_of(result):.1f}% vs {100 * quality_of(fake):.1f}%, bound {100 * bound:.1f}); the "
            f"kernels compute something else than the scheme {handle.steps[-1].meta.get('scheme')!r} assumes: "
            "nothing written (accept the loss with --accept-quality-loss)")
    return fake, result


def _quantize_via_onnx(handle: ModelHandle, config: Int8Config, ctx: StepContext, scheme: str,
                       kernels: str, smoothing_asked: bool = True) -> ModelHandle:
    """Export the float model, then quantize the graph (``onnx_graph``); the result is ONNX-only.
    ``smoothing_asked`` False: the smoothing is a causal LM's default, skipped (and said so in the metrics)
    on a model with no norm or linear its scales fold into, where an explicit alpha is refused."""
    # The float graph is needed only while quantizing: the result lives in its own folder.
    if ctx.work_dir is not None:
        Path(ctx.work_dir).mkdir(parents=True, exist_ok=True)
    smoothed: dict[str, Any] | None = None
    if config.smooth_config() is not None and handle.kind == "causal-lm" and handle.module is not None:
        try:
            handle, smoothed = _smoothed(handle, config, ctx)
        except BadInputError as e:
            if smoothing_asked:
                raise
            smoothed = {"alpha": None, "skipped": str(e)}
            config = dataclasses.replace(config, smooth_alpha=0.0)  # recorded as what ran: no smoothing
    with tempfile.TemporaryDirectory(prefix="edgekit-int8-", dir=ctx.work_dir) as work:
        folder, source = None, "exported-onnx (torch.fx could not trace the model)"
        if handle.kind == "causal-lm" and handle.module is not None:
            from edgekit.export.lm import export_forward_graph  # the causal-LM exporter: only for a causal LM

            # a decoder the fused graph writes: that graph, without its cache, in seconds and about the
            # model's size in memory (the dynamo trace of SmolLM2-135M: 130-180 CPU s, 3.9 GB)
            folder = export_forward_graph(handle, Path(work) / "fp32-onnx")
            if folder is not None:
                source = "the fused decoder graph, one forward without a cache (export/lm.py)"
        if folder is None:
            folder = export_onnx(handle, Path(work) / "fp32-onnx", ExportConfig(skip_parity=True))
        release_memory()  # what the exporter freed (GBs for a decoder) goes back before the graph is loaded
        onnx_handle = copy.copy(handle)
        onnx_handle.onnx_path = Path(folder) / "model.onnx"
        onnx_handle.module = None
        out = _with_record(*quantize_onnx_handle(onnx_handle, config.onnx_graph_config(), ctx, scheme, kernels), config)
    out.steps[-1].meta["from"] = source
    out.steps[-1].meta["smoothing"] = smoothed
    if smoothed is not None:
        ctx.metrics["int8"]["smoothing"] = {k: v for k, v in smoothed.items() if k != "pairs"}
    return out


def _with_record(new: ModelHandle, meta: dict[str, Any], config: Int8Config) -> ModelHandle:
    """The ONNX-graph path's result with the step's record (the whole step config, as on the PyTorch path)."""
    new.steps = [*new.steps, StepRecord("int8", config_to_dict(config), meta)]
    return new


def _smoothed(handle: ModelHandle, config: Int8Config, ctx: StepContext) -> tuple[ModelHandle, dict[str, Any]]:
    """A copy of the causal LM with SmoothQuant's scales folded in (``smooth.py``), calibrated on the
    same calibration windows the graph's ranges come from; the float function is unchanged."""
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        samples = load_split(handle, ctx, "calib", config.calib_samples)
    except BadInputError:  # a split smaller than the ask: all of it, as the graph's calibration then reads
        samples = load_split(handle, ctx, "calib", None)
    names = [s.name for s in handle.inputs]
    if handle.module is None:
        raise ValueError("smoothing needs the model's PyTorch module")
    module = copy.deepcopy(handle.module)
    module.eval()

    def run(m: nn.Module) -> None:
        with torch.no_grad():
            for args in tensor_batches(samples, names, 8):
                m(*args)

    smoothing = config.smooth_config()
    if smoothing is None:
        raise ValueError("smoothing asked for without a smoothing alpha")
    pairs = smooth(module, run, smoothing)
    ratios = [p["act_max"] / max(p["act_median"], 1e-12) for p in pairs]
    record = {"alpha": config.smooth_alpha, "calib_samples": len(samples), "groups": len(pairs),
              "pairs": sorted({f"{p['producer']} -> {', '.join(p['consumers'])}" for p in pairs}),
              "max_outlier_ratio": round(max(ratios), 2) if ratios else None,
              "seconds": {"wall": round(time.perf_counter() - t0, 3), "cpu": round(time.process_time() - c0, 3)}}
    new = copy.copy(handle)
    new.module = module
    return new, record


def calibrate(gm: nn.Module, samples: Samples, names: list[str], config: CalibrationConfig, batch_size: int = 16,
              channels_last: bool = False) -> None:
    """One streaming pass over the calibration data, then ranges by ``config.method``."""

    gm.eval()
    qdq.set_mode(gm, "observe")
    with torch.no_grad(), qdq.fast_fake_quant(gm):  # each weight quantized once for the whole pass
        for args in tensor_batches(samples, names, batch_size, channels_last):
            gm(*args)
    qdq.finish_calibration(gm, config.method or TORCH_CALIB_METHOD, config.percentile)
    for m in qdq.act_quants(gm):
        m.observer = None  # free the histograms


def rebuild(handle: ModelHandle, config: Int8Config, record: StepRecord) -> ModelHandle:
    """Recreate the fake-quant structure (weights come from the artifact)."""

    if handle.module is None:
        return handle
    meta = record.meta
    work = handle.module.eval()
    if meta.get("relu6_to_relu"):
        relu6_to_relu(work)
    gm, plan = qdq.prepare_qdq(work, meta.get("scheme", "u8s8"), tuple(meta.get("float_layers", ())),
                               tuple(meta.get("u8u8_layers", ())))
    floats = set(meta.get("float_activations", ()))
    for qname, tensor in plan.activations.items():
        if tensor in floats:
            qdq.act_quant(gm, qname).mode = "float"
    if config.learnable_scales and config.method == "qat":
        for m in qdq.act_quants(gm):
            m.make_learnable()
    new = copy.copy(handle)
    new.module = gm.eval()
    new.extra = {**handle.extra, "int8_scheme": meta.get("scheme"), "parity_tolerance": PARITY_TOLERANCE}
    return new


def rewrite_onnx(model: onnx.ModelProto, handle: ModelHandle, record: StepRecord) -> onnx.ModelProto:
    u8u8 = (record.meta.get("u8u8_layers") or []) if record.meta.get("scheme") in qdq.SATURATION_SAFE else []
    return qdq_onnx.rewrite_qdq(model, u8_weights=len(u8u8))


STEP = Step(
    name="int8",
    config=Int8Config,
    apply=apply,
    description="INT8 PTQ/QAT: per-channel int8 weights, calibrated per-tensor activations, target-aware QDQ",
    rebuild=rebuild,
    rewrite_onnx=rewrite_onnx,
    transitions={"float": "fake-quant", "onnx": "onnx"},  # a PyTorch model gets Q/DQ wrappers; a graph, Q/DQ nodes
    bounds=lambda config: BOUNDS_8BIT,
    target_aware=True,  # the target's runtimes choose the Q/DQ scheme
)
