"""How fast ONNX Runtime's CPU kernels run on this machine, at one thread: the kernel rates
the ``cpu`` target's estimate scales from (``edgekit.estimate.probe``).

Each rate times a chain of identical layers, in the graph forms the rest of edgekit gives
ONNX Runtime, opened as ``edgekit build`` opens an engine (optimization level all, one
intra-op thread), so the kernels timed are the ones real graphs run:

* fp32 ``MatMul`` (MLAS sgemm) at 256 and at 16 rows, and ``Conv`` 3x3 (the NCHWc convolution ORT
  makes of it);
* depthwise 3x3 and 5x5 ``Conv`` (NCHWc depthwise kernel): a depthwise kernel's time is a cost
  per output plus a cost per tap, and the two sizes give both;
* INT8 as the int8 step emits it: Q/DQ around a ``MatMul`` with a float output (ORT fuses it
  into ``MatMulIntegerToFloat``, u8 x s8) and around a ``Conv`` with a quantized output
  (``QLinearConv``, NHWC; depthwise too). Weights are 7-bit where this CPU's int8 kernels
  sum u8 x s8 pairs in saturating int16 (the int8 step's pair-safe 8-bit codes there run the same kernel), full
  int8 elsewhere; the kernel and its speed are the same, the values are what will run.

A rate is the chain's operations over the median process CPU time of its runs (CPU time, so
a busy machine's waits do not count), after warm-up; each kernel is timed in three rounds,
interleaved with the others, and keeps the best round (a busy moment then hits one round). Which operator ORT actually ran for each
chain is read back from its optimized graph and recorded with the rate.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgekit.errors import CheckFailedError, UnavailableError
from edgekit.onnx_checks import session_options

CHAIN = 4  # identical layers per timed graph: the reorders / quantization at its ends weigh little
MEASURE_S = 0.3  # process CPU seconds each kernel is timed for, over all rounds (after warm-up)
MIN_RUNS = 5
ROUNDS = 3  # each kernel is timed in this many interleaved rounds; its rate is the best round's median


@dataclass(frozen=True)
class KernelRate:
    key: str  # "class:precision" (edgekit.targets.host_probe.RATE_KEYS)
    tops: float  # operations per second / 1e12 (a multiply-add is 2)
    kernel: str  # what was timed: the operator ORT ran, shapes, precision
    runs: int


def _ort() -> Any:
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise UnavailableError(f"onnxruntime is not installed, so this machine's kernels cannot be timed: {e}") from None
    return ort


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any]) -> bytes:
    from onnx import helper

    graph = helper.make_graph(nodes, "probe", inputs, outputs, initializer=inits)
    return bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
                 .SerializeToString())


def _session(model: bytes) -> tuple[Any, list[str]]:
    """An ORT session as ``edgekit build`` opens one at one thread, and the ops of its optimized graph."""
    import onnx

    ort = _ort()
    with tempfile.TemporaryDirectory(prefix="edgekit-probe-") as tmp:
        opt = os.path.join(tmp, "opt.onnx")
        so = session_options("all", 1)
        so.optimized_model_filepath = opt
        sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        ops = [n.op_type for n in onnx.load(opt).graph.node]
    return sess, ops


def _time(sess: Any, feeds: dict[str, np.ndarray], measure_s: float) -> tuple[float, int]:
    """Median process CPU seconds per run, and the number of runs."""
    for _ in range(2):
        sess.run(None, feeds)
    times: list[float] = []
    start = time.process_time()
    while len(times) < MIN_RUNS or time.process_time() - start < measure_s:
        t0 = time.process_time()
        sess.run(None, feeds)
        times.append(time.process_time() - t0)
        if len(times) >= 2000:
            break
    return statistics.median(times), len(times)


def _weights(rng: np.random.Generator, shape: tuple[int, ...], seven_bit: bool) -> np.ndarray:
    lo, hi = (-64, 64) if seven_bit else (-128, 128)
    return rng.integers(lo, hi, shape).astype(np.int8)


def _f32(name: str, shape: list[int]) -> Any:
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _matmul_fp32(rng: np.random.Generator, m: int, k: int) -> tuple[bytes, dict[str, np.ndarray], float]:
    from onnx import helper, numpy_helper

    inits = [numpy_helper.from_array((rng.standard_normal((k, k)) / np.sqrt(k)).astype(np.float32), f"w{i}")
             for i in range(CHAIN)]
    nodes = [helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"x{i + 1}"]) for i in range(CHAIN)]
    feeds = {"x0": rng.standard_normal((m, k)).astype(np.float32)}
    return _model(nodes, [_f32("x0", [m, k])], [_f32(f"x{CHAIN}", [m, k])], inits), feeds, 2.0 * m * k * k * CHAIN


def _matmul_int8(rng: np.random.Generator, m: int, k: int,
                 seven_bit: bool) -> tuple[bytes, dict[str, np.ndarray], float]:
    """The int8 step's "linear" form: a quantized activation, dequantized int8 weights, float outputs
    (``MatMulIntegerToFloat``). The layers read one input side by side: in a chain ORT would fuse
    each output's requantization into a ``QLinearMatMul`` instead."""
    from onnx import helper, numpy_helper

    inits = [numpy_helper.from_array(np.array(128, np.uint8), "xz")]
    nodes = []
    for i in range(CHAIN):
        inits += [numpy_helper.from_array(_weights(rng, (k, k), seven_bit), f"wq{i}"),
                  numpy_helper.from_array(np.full((k,), 0.5 / k, np.float32), f"ws{i}"),
                  numpy_helper.from_array(np.zeros((k,), np.int8), f"wz{i}"),
                  # a Q/DQ pair per consumer, scales apart so that ORT does not merge them into one
                  numpy_helper.from_array(np.array(0.05 + 0.001 * i, np.float32), f"xs{i}")]
        nodes += [helper.make_node("QuantizeLinear", ["x", f"xs{i}", "xz"], [f"q{i}"]),
                  helper.make_node("DequantizeLinear", [f"q{i}", f"xs{i}", "xz"], [f"d{i}"]),
                  helper.make_node("DequantizeLinear", [f"wq{i}", f"ws{i}", f"wz{i}"], [f"wd{i}"], axis=1),
                  helper.make_node("MatMul", [f"d{i}", f"wd{i}"], [f"y{i}"])]
    feeds = {"x": rng.standard_normal((m, k)).astype(np.float32)}
    return (_model(nodes, [_f32("x", [m, k])], [_f32(f"y{i}", [m, k]) for i in range(CHAIN)], inits), feeds,
            2.0 * m * k * k * CHAIN)


def _conv_fp32(rng: np.random.Generator, c: int, hw: int, group: int,
               k: int = 3) -> tuple[bytes, dict[str, np.ndarray], float]:
    from onnx import helper, numpy_helper

    inits, nodes = [], []
    for i in range(CHAIN):
        w = (rng.standard_normal((c, c // group, k, k)) / np.sqrt(k * k * c / group)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.zeros(c, np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", [f"x{i}", f"w{i}", f"b{i}"], [f"c{i}"], pads=[k // 2] * 4, group=group),
                  helper.make_node("Relu", [f"c{i}"], [f"x{i + 1}"])]
    feeds = {"x0": rng.standard_normal((1, c, hw, hw)).astype(np.float32)}
    ops = 2.0 * c * (c // group) * k * k * hw * hw * CHAIN
    return _model(nodes, [_f32("x0", [1, c, hw, hw])], [_f32(f"x{CHAIN}", [1, c, hw, hw])], inits), feeds, ops


def _conv_int8(rng: np.random.Generator, c: int, hw: int, group: int, seven_bit: bool,
               k: int = 3) -> tuple[bytes, dict[str, np.ndarray], float]:
    """The int8 step's CNN form: one quantized tensor between layers (its Q/DQ pair), Q/DQ on the
    weight and the int32 bias, ReLU folded into the output's quantization."""
    from onnx import helper, numpy_helper

    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.array(0, np.uint8), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q0"])]
    for i in range(CHAIN):
        inits += [numpy_helper.from_array(_weights(rng, (c, c // group, k, k), seven_bit), f"wq{i}"),
                  numpy_helper.from_array(np.full((c,), 0.01, np.float32), f"ws{i}"),
                  numpy_helper.from_array(np.zeros((c,), np.int8), f"wz{i}"),
                  numpy_helper.from_array(np.zeros((c,), np.int32), f"bq{i}"),
                  numpy_helper.from_array(np.full((c,), 0.0005, np.float32), f"bs{i}"),
                  numpy_helper.from_array(np.zeros((c,), np.int32), f"bz{i}")]
        nodes += [helper.make_node("DequantizeLinear", [f"q{i}", "s", "z"], [f"d{i}"]),
                  helper.make_node("DequantizeLinear", [f"wq{i}", f"ws{i}", f"wz{i}"], [f"wd{i}"], axis=0),
                  helper.make_node("DequantizeLinear", [f"bq{i}", f"bs{i}", f"bz{i}"], [f"bd{i}"], axis=0),
                  helper.make_node("Conv", [f"d{i}", f"wd{i}", f"bd{i}"], [f"c{i}"], pads=[k // 2] * 4, group=group),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
                  helper.make_node("QuantizeLinear", [f"r{i}", "s", "z"], [f"q{i + 1}"])]
    nodes.append(helper.make_node("DequantizeLinear", [f"q{CHAIN}", "s", "z"], ["y"]))
    feeds = {"x": np.abs(rng.standard_normal((1, c, hw, hw))).astype(np.float32)}
    ops = 2.0 * c * (c // group) * k * k * hw * hw * CHAIN
    return _model(nodes, [_f32("x", [1, c, hw, hw])], [_f32("y", [1, c, hw, hw])], inits), feeds, ops


def _ran(ops: list[str], wanted: tuple[str, ...]) -> str:
    """The compute operator ORT ran for the chain (the first of ``wanted`` its optimized graph holds)."""
    return next((w for w in wanted if w in ops), "/".join(sorted(set(ops))))


def measure_kernel_rates(seven_bit: bool, measure_s: float = MEASURE_S) -> list[KernelRate]:
    """One-thread rates of ONNX Runtime's CPU kernels: fp32 GEMM at 256 and 16 rows, int8 GEMM, fp32
    and int8 3x3 convolution, depthwise 3x3 and 5x5 convolution (``targets.host_probe.RATE_KEYS``)."""
    rng = np.random.default_rng(0)
    bits = "7-bit" if seven_bit else "8-bit"
    specs: list[tuple[str, Callable[[], tuple[bytes, dict[str, np.ndarray], float]], tuple[str, ...], str]] = [
        ("matmul:fp32", lambda: _matmul_fp32(rng, 256, 512), ("MatMul", "FusedMatMul", "Gemm"), "256x512x512 fp32"),
        ("matmul-m16:fp32", lambda: _matmul_fp32(rng, 16, 512), ("MatMul", "FusedMatMul", "Gemm"), "16x512x512 fp32"),
        ("conv:fp32", lambda: _conv_fp32(rng, 64, 56, 1), ("Conv",), "3x3 64->64 on 56x56 fp32 (+ReLU)"),
        ("depthwise-conv:fp32", lambda: _conv_fp32(rng, 240, 28, 240), ("Conv",), "depthwise 3x3 240 ch on 28x28 fp32"),
        ("depthwise-conv-5x5:fp32", lambda: _conv_fp32(rng, 240, 28, 240, k=5), ("Conv",),
         "depthwise 5x5 240 ch on 28x28 fp32"),
        ("matmul:int8", lambda: _matmul_int8(rng, 256, 512, seven_bit), ("MatMulIntegerToFloat", "MatMulInteger",
                                                                         "QLinearMatMul"),
         f"256x512x512 u8 x s8 ({bits} weights), float output"),
        ("conv:int8", lambda: _conv_int8(rng, 64, 56, 1, seven_bit), ("QLinearConv",),
         f"3x3 64->64 on 56x56 u8 x s8 ({bits} weights)"),
        ("depthwise-conv:int8", lambda: _conv_int8(rng, 240, 28, 240, seven_bit), ("QLinearConv",),
         f"depthwise 3x3 240 ch on 28x28 u8 x s8 ({bits} weights)"),
        ("depthwise-conv-5x5:int8", lambda: _conv_int8(rng, 240, 28, 240, seven_bit, k=5), ("QLinearConv",),
         f"depthwise 5x5 240 ch on 28x28 u8 x s8 ({bits} weights)"),
    ]
    built = []
    for key, make, wanted, shape in specs:
        model, feeds, ops = make()
        sess, graph_ops = _session(model)
        built.append((key, sess, feeds, ops, f"{_ran(graph_ops, wanted)} {shape}, {CHAIN} layers"))
    best: dict[str, float] = {}
    runs: dict[str, int] = {}
    for _ in range(ROUNDS):  # interleaved, so a busy moment of the machine does not hit one kernel only
        for key, sess, feeds, ops, _ in built:
            seconds, n = _time(sess, feeds, measure_s / ROUNDS)
            best[key] = max(best.get(key, 0.0), ops / seconds / 1e12)
            runs[key] = runs.get(key, 0) + n
    return [KernelRate(key, best[key], kernel, runs[key]) for key, _, _, _, kernel in built]


def node_overhead_us(runs: int = 300) -> float:
    """ONNX Runtime's time per node that does almost no work (one thread): a chain of 410 Adds on
    16 floats against a chain of 10, median process CPU time, per node."""
    from onnx import helper, numpy_helper

    ort = _ort()

    def chain(n: int) -> bytes:
        nodes = [helper.make_node("Add", [f"t{i}", "one"], [f"t{i + 1}"]) for i in range(n)]
        return _model(nodes, [_f32("t0", [1, 16])], [_f32(f"t{n}", [1, 16])],
                      [numpy_helper.from_array(np.ones(1, np.float32), "one")])

    med = {}
    x = {"t0": np.zeros((1, 16), np.float32)}
    for n in (10, 410):
        sess = ort.InferenceSession(chain(n), session_options("disable", 1), providers=["CPUExecutionProvider"])
        for _ in range(30):
            sess.run(None, x)
        times = []
        for _ in range(runs):
            t0 = time.process_time()
            sess.run(None, x)
            times.append(time.process_time() - t0)
        med[n] = statistics.median(times) * 1e6
    per_node = (med[410] - med[10]) / 400
    if not per_node > 0:  # the process clock's resolution or a stalled run: not a figure to keep
        raise CheckFailedError(f"the per-node overhead measured {per_node:.3f} us (not > 0): timer too coarse or "
                               "the machine too busy; run `edgekit targets --probe` again")
    return per_node


__all__ = ["CHAIN", "KernelRate", "measure_kernel_rates", "node_overhead_us"]
