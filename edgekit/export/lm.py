"""Packed low-bit layers in ONNX, and causal-LM export with the KV cache.

``rewrite_packed_graph(model, module)`` turns whatever the exporter traced for each
packed layer (``QuantLinear``: dequantize-then-matmul; ``QuantEmbedding``: dequantize-
then-gather) into one ONNX Runtime contrib op fed by the packed tensors:

* ``com.microsoft::MatMulNBits`` (CPU and CUDA) for linears: ``B`` uint8 ``(N, blocks,
  block * bits / 8)``, ``scales`` float ``(N * blocks)``, ``zero_points`` uint8 packed per
  row; ``block_size`` must be a power of two in 16..256, so per-channel and groups over 256
  are expressed exactly by repeating a group's scale and zero point over several blocks;
* ``com.microsoft::GatherBlockQuantized`` for the (tied) embedding table;
* or, with ``fmt="qdq"`` (the TensorRT route), standard ``DequantizeLinear`` with ``block_size``
  (opset 21) feeding the original MatMul / Gather: signed int4/int8 codes without zero points for
  symmetric weights (what TensorRT 10 imports), uint4/uint8 codes with zero points otherwise.
Bit widths MatMulNBits lacks (3) use the DequantizeLinear form.

The packed layers are found by content, not by names: an initializer whose bytes equal a
layer's ``qweight`` (the exporter may have reshaped or renamed it) or its dequantized float
weight (when the exporter folded the dequantization into a constant); the graph is walked
from there to the first MatMul / Gemm (the activation is its other input) or embedding
Gather. Everything the exporter emitted for the dequantization becomes dead and is removed.

``export_causal_lm(handle, out_dir)`` exports a causal LM in the ``text-generation-with-past``
form (``input_ids, attention_mask, position_ids, past_key_values.{i}.key/value`` ->
``logits, present.{i}.key/value``) with optimum's ONNX exporter, rewrites packed layers and
checks parity against the PyTorch model (which dequantizes the same codes) and, for a
compressed model, against the float model it came from (``check_against_float``) on a prefill and
a one-token decode step; for a rotary model also far into the context (``check_long_context``:
across every threshold its rope scaling declares, up to the end of its declared context). A graph
that fails parity is not written (``CheckFailedError``).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgekit.artifact import Manifest, staged_dir, write_manifest
from edgekit.errors import BadInputError, CheckFailedError, UnavailableError, bad_choice
from edgekit.export.lm_graph import (
    FusedGraphConfig,
    Initializer,
    fused_decoder_parts,
    save_parts,
    save_parts_external,
    supports_fused_graph,
)
from edgekit.export.packing import QuantEmbedding, QuantLinear, ScaledEmbedding, pack_codes, storage_bits
from edgekit.export.rope import check_starts, declared_context, model_rope, reset_rope_state, traceable_rope
from edgekit.kv_cache import KV_CACHE_METADATA, KVCacheDecoder
from edgekit.memory import float32_compute, release_memory, weights_on_disk
from edgekit.onnx_checks import verify_onnx_runs
from edgekit.sources.models import decode_step_inputs, load_model
from edgekit.sources.onnx_file import graph_inputs

log = logging.getLogger(__name__)


class AddInit(Protocol):
    """rewrite_packed_graph's initializer writer: adds ``arr`` as ``name`` (once), returns the name."""

    def __call__(self, name: str, arr: np.ndarray, dtype: int | None = None) -> str: ...


MATMULNBITS_BITS = (2, 3, 4, 8)
_MATCH_TYPES = (2, 6, 7, 1)  # onnx UINT8, INT32, INT64, FLOAT  # 3-bit codes are stored (and run) as 4-bit
FORMATS = ("matmulnbits", "qdq")
GRAPHS = ("auto", "fused", "traced")
# MatMulNBits' accuracy_level: 4 lets ONNX Runtime's CPU kernel quantize the activations to int8 per block
# and run integer dot products. Measured on SmolLM2 W4 g128 (RESULTS.md, issue 4): one-token decode 17.6 ms
# against 204.8 ms with fp32 compute (level 0) and 46.8 ms for FP32; perplexity 27.50 vs 27.29. The CUDA
# kernel ignores it. Export with accuracy_level=0 (--accuracy-level 0) for fp32 compute.
DEFAULT_ACCURACY_LEVEL = 4
# With int8 compute the logits move by up to ~6.5% of their largest magnitude on SmolLM2 (argmax 15/17 tokens).
INT8_COMPUTE_RTOL = 0.15


# nodes whose accuracy_level chooses int8 or fp32 activations (QMoE: packed mixture-of-experts layers)
ACCURACY_OPS = ("MatMulNBits", "QMoE")


def with_accuracy_level(proto: Any, level: int | None) -> Any:
    """A copy of ``proto`` whose MatMulNBits and QMoE nodes carry ``accuracy_level`` (None: removed)."""
    import copy

    return set_accuracy_level(copy.deepcopy(proto), level)


def set_accuracy_level(proto: Any, level: int | None) -> Any:
    """Set (None: remove) ``accuracy_level`` on the MatMulNBits and QMoE nodes of ``proto``, in place; returns it."""
    from onnx import helper

    for node in proto.graph.node:
        if node.op_type in ACCURACY_OPS:
            keep = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend(keep)
            if level is not None:
                node.attribute.append(helper.make_attribute("accuracy_level", level))
    return proto


# Digests stream a weight through this many elements at a time: converting or transposing a whole
# 262,144 x 640 table first would cost up to 1.3 GB (int64) for the one hash.
DIGEST_CHUNK = 1 << 22


def _digest(a: np.ndarray, dtype: Any = None) -> str:
    """sha1 of ``a`` (cast to ``dtype``) as C-order bytes, computed a block of leading rows at a time."""
    h = hashlib.sha1()
    if a.ndim < 2:
        h.update(np.ascontiguousarray(a if dtype is None else a.astype(dtype)).tobytes())
        return h.hexdigest()
    step = max(1, DIGEST_CHUNK // max(int(np.prod(a.shape[1:])), 1))
    for lo in range(0, a.shape[0], step):
        block = a[lo:lo + step]
        h.update(np.ascontiguousarray(block if dtype is None else block.astype(dtype)).tobytes())
    return h.hexdigest()


def _block_size(in_features: int, group_size: int, exact: bool = False) -> int | None:
    """The MatMulNBits block size expressing this grouping exactly (None if there is none):
    a power of two in 16..256 dividing the group, preferring one that also divides the
    input width (no padded last block; required with ``exact``, as GatherBlockQuantized does)."""
    g = in_features if group_size == -1 else group_size
    sizes = [b for b in (256, 128, 64, 32, 16) if g % b == 0]
    dividing = [b for b in sizes if in_features % b == 0]
    if dividing:
        return dividing[0]
    return None if (exact or group_size == -1 or not sizes) else sizes[0]


def _blocked_params(layer: Any, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(B (N, blocks, blob), scales (N*blocks,), zero_points (N*zp_bytes,), blocks) for MatMulNBits."""
    import torch

    K = layer._cols
    bits = storage_bits(layer.bits)
    g = K if layer.group_size == -1 else layer.group_size
    nb = -(-K // block)
    codes = layer.codes()
    codes = torch.nn.functional.pad(codes, (0, nb * block - K))
    B = pack_codes(codes, bits).reshape(codes.shape[0], nb, block * bits // 8)
    gidx = torch.arange(nb) * block // g
    scales = layer.scales[:, gidx].float()
    zeros = pack_codes(layer.zeros()[:, gidx], bits)
    return B.numpy(), scales.reshape(-1).numpy(), zeros.reshape(-1).numpy(), nb


def dq_weights(codes: np.ndarray, zeros: np.ndarray, bits: int) -> tuple[np.ndarray, int, np.ndarray | None]:
    """The DequantizeLinear form of packed codes: ``(data, onnx dtype, zero points or None)``.

    Symmetric weights (every zero point at the grid's middle, ``2**(bits-1)``) become signed
    codes without zero points (int4 for 3 and 4 bits, int8 for 8): the form TensorRT imports
    (zero point 0, signed). Asymmetric weights keep unsigned codes and their zero points
    (ONNX Runtime runs them; TensorRT refuses them and ``edgekit lint`` says so)."""
    from onnx import TensorProto

    narrow = bits in (3, 4)
    mid = 2 ** (bits - 1)
    if zeros.size and bool((zeros == mid).all()):
        signed = codes.astype(np.int16) - mid
        return signed.astype(np.int8), (TensorProto.INT4 if narrow else TensorProto.INT8), None
    return codes, (TensorProto.UINT4 if narrow else TensorProto.UINT8), zeros


class _Graph:
    """Producer/consumer maps over an onnx GraphProto."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.producer: dict[str, Any] = {}
        self.consumers: dict[str, list[Any]] = defaultdict(list)
        for node in graph.node:
            for o in node.output:
                self.producer[o] = node
            for i in node.input:
                if i:
                    self.consumers[i].append(node)


def _terminals(g: _Graph, start: str) -> tuple[list[tuple[Any, str]], set[str]]:
    """Walk from tensor ``start`` to the nodes that consume the dequantized weight:
    [(node, kind)] with kind "matmul" | "gather", and the set of chain tensors."""
    chain = {start}
    frontier = [start]
    found: list[tuple[Any, str]] = []
    seen_nodes: set[int] = set()
    while frontier:
        t = frontier.pop()
        for node in g.consumers.get(t, []):
            if id(node) in seen_nodes:
                continue
            if node.op_type in ("MatMul", "Gemm"):
                seen_nodes.add(id(node))
                found.append((node, "matmul"))
                continue
            if node.op_type == "Gather" and node.input[0] == t:
                prod = g.producer.get(t)
                if prod is None or prod.op_type != "Shape":
                    seen_nodes.add(id(node))
                    found.append((node, "gather"))
                    continue
            if node.op_type == "Shape":
                continue
            seen_nodes.add(id(node))
            for o in node.output:
                if o not in chain:
                    chain.add(o)
                    frontier.append(o)
    return found, chain


def rewrite_packed_graph(model: Any, module: Any, fmt: str = "matmulnbits", accuracy_level: int | None = None) -> Any:
    """Replace every packed layer's traced dequantization by MatMulNBits/GatherBlockQuantized
    (or blocked DequantizeLinear with ``fmt="qdq"``). Returns the (modified) ModelProto."""
    from onnx import helper, numpy_helper

    if fmt not in FORMATS:
        raise bad_choice("int4 ONNX format", fmt, FORMATS)
    layers = [(n, m) for n, m in module.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    if not layers:
        return model
    by_digest: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    sizes: set[int] = set()
    for name, m in layers:
        q = m.qweight.detach().cpu().numpy()
        for dt in (np.uint8, np.int32, np.int64):  # exporters may fold the first casts in
            by_digest[_digest(q, dt)].append((name, m))
        sizes.add(q.size)
        w = m.dequantize().detach().cpu().float().numpy()
        by_digest[_digest(w)].append((name, m))
        by_digest[_digest(w.T)].append((name, m))
        sizes.add(w.size)
        del w
    graph = model.graph
    g = _Graph(graph)
    matched: list[tuple[str, list[tuple[str, Any]]]] = []
    for init in graph.initializer:
        n = int(np.prod(init.dims)) if init.dims else 1
        if n not in sizes or init.data_type not in _MATCH_TYPES:
            continue
        d = _digest(numpy_helper.to_array(init))
        if d in by_digest:
            matched.append((init.name, by_digest[d]))
    # Constant nodes holding the weights (some exporters emit them instead of initializers)
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            t = node.attribute[0].t
            n = int(np.prod(t.dims)) if t.dims else 1
            if n in sizes and t.data_type in _MATCH_TYPES:
                d = _digest(numpy_helper.to_array(t))
                if d in by_digest:
                    matched.append((node.output[0], by_digest[d]))

    new_inits: dict[str, Any] = {}
    replaced: dict[int, list[Any]] = {}
    count = 0

    def add_init(name: str, arr: np.ndarray, dtype: int | None = None) -> str:
        if name not in new_inits:
            if dtype is None:
                new_inits[name] = numpy_helper.from_array(arr, name)
            else:
                new_inits[name] = helper.make_tensor(name, dtype, arr.shape, arr.flatten().tolist())
        return name

    for tensor, owners in matched:
        found, chain = _terminals(g, tensor)
        for node, kind in found:
            if id(node) in replaced:
                continue
            want = QuantEmbedding if kind == "gather" else QuantLinear
            owner = next(((n, m) for n, m in owners if isinstance(m, want)), None)
            if owner is None and kind == "gather":  # a tied table found through the head's codes
                owner = next(((n, m) for n, m in layers if isinstance(m, QuantEmbedding)
                              and m.qweight is owners[0][1].qweight), None)
            if owner is None:
                continue
            name, layer = owner
            safe = name.replace(".", "_")
            if kind == "matmul":
                a = next((i for i in node.input[:2] if i not in chain), None)
                if a is None:
                    continue
                if node.op_type == "Gemm":
                    attrs = {a_.name: helper.get_attribute_value(a_) for a_ in node.attribute}
                    if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
                        continue
                nodes = _linear_nodes(layer, safe, a, node, fmt, accuracy_level, add_init)
            else:
                head = next(((n, m) for n, m in layers if isinstance(m, QuantLinear) and m.qweight is layer.qweight), None)
                nodes = (_tied_gather_nodes(layer, safe, head, node.input[1], node.output[0], fmt, add_init)
                         or _gather_nodes(layer, safe, node.input[1], node.output[0], fmt, add_init))
            replaced[id(node)] = nodes
            count += 1
    if not count:
        return model
    out_nodes = []
    for node in graph.node:
        out_nodes.extend(replaced.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(out_nodes)
    graph.initializer.extend(new_inits.values())
    _remove_dead(graph)
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    if fmt == "qdq":
        for op in model.opset_import:
            if op.domain in ("", "ai.onnx") and op.version < 21:
                op.version = 21
    log.info("rewrote %d packed layers as %s", count, fmt)
    return model


def _linear_nodes(layer: Any, safe: str, a: str, node: Any, fmt: str, accuracy_level: int | None,
                  add_init: AddInit) -> list[Any]:
    from onnx import helper

    out = node.output[0]
    bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
    K, N = layer._cols, layer._rows
    block = _block_size(K, layer.group_size)
    mm_out = out if bias is None else out + "_nobias"
    nodes = []
    if fmt == "matmulnbits" and layer.bits in MATMULNBITS_BITS and block is not None:
        B, S, Z, nb = _blocked_params(layer, block)
        ins = [a, add_init(f"{safe}_Bq{block}", B), add_init(f"{safe}_scales{block}", S),
               add_init(f"{safe}_zp{block}", Z)]
        attrs = {"K": K, "N": N, "bits": 4 if layer.bits == 3 else layer.bits, "block_size": block}
        if accuracy_level is not None:
            attrs["accuracy_level"] = accuracy_level
        nodes.append(helper.make_node("MatMulNBits", ins, [mm_out], name=f"{safe}_MatMulNBits",
                                      domain="com.microsoft", **attrs))
    else:  # DequantizeLinear (K, N) -> MatMul
        data, dt, zeros = dq_weights(layer.codes().numpy().T, layer.zeros().numpy().T, layer.bits)  # (K, N), (G, N)
        scales = layer.scales.float().numpy().T  # (G, N)
        w = f"{safe}_Wdq"
        whole = layer.group_size == -1
        ins = [add_init(f"{safe}_Wq", data, dt), add_init(f"{safe}_Ws", scales[0] if whole else scales)]
        if zeros is not None:
            ins.append(add_init(f"{safe}_Wz", zeros[0] if whole else zeros, dt))
        dq = (helper.make_node("DequantizeLinear", ins, [w], axis=1) if whole else
              helper.make_node("DequantizeLinear", ins, [w], axis=0, block_size=layer.group_size))
        nodes += [dq, helper.make_node("MatMul", [a, w], [mm_out], name=f"{safe}_MatMul")]
    if bias is not None:
        nodes.append(helper.make_node("Add", [mm_out, bias], [out]))
    return nodes


def _tied_gather_nodes(layer: Any, safe: str, head: tuple[str, Any] | None, indices: str, out: str, fmt: str,
                       add_init: AddInit) -> list[Any] | None:
    """The lookup of an embedding tied to a packed LM head, reading the head's MatMulNBits table
    ``(vocab, blocks, block bytes)`` (the same bytes: rows of codes, two 4-bit codes a byte, low
    nibble first) through GatherBlockQuantized along its last axis, then the blocks reshaped into
    the hidden axis: the table is stored once. None where the layouts cannot be shared."""
    from onnx import helper

    if head is None or fmt != "matmulnbits" or layer.bits not in (4, 8):
        return None
    hname, hlayer = head
    D = layer._cols
    block = _block_size(hlayer._cols, hlayer.group_size)
    if block is None:
        return None
    B, _, _, nb = _blocked_params(hlayer, block)  # the last block padded with zero codes where block does not divide D
    g = D if layer.group_size == -1 else layer.group_size
    gidx = np.arange(nb) * block // g
    scales = layer.scales.float().numpy()[:, gidx].reshape(-1, nb, 1)
    zeros = layer.zeros().numpy()[:, gidx].astype(np.uint8).reshape(-1, nb, 1)  # one code a block: low nibble
    blocks = f"{out}_blocks"
    ins = [add_init(f"{hname.replace('.', '_')}_Bq{block}", B), indices, add_init(f"{safe}_Gs3_{block}", scales),
           add_init(f"{safe}_Gz3_{block}", zeros)]
    padded = nb * block != D
    nodes = [helper.make_node("GatherBlockQuantized", ins, [blocks], name=f"{safe}_GatherBlockQuantized",
                              domain="com.microsoft", gather_axis=0, quantize_axis=2, block_size=block, bits=layer.bits),
             helper.make_node("Reshape", [blocks, add_init(f"{safe}_hidden_shape", np.array([0, 0, nb * block], np.int64))],
                              [f"{out}_padded" if padded else out], name=f"{safe}_Reshape")]
    if padded:  # cut the padded last block's columns
        nodes.append(helper.make_node("Slice", [f"{out}_padded", add_init(f"{safe}_start", np.array([0], np.int64)),
                                                add_init(f"{safe}_end", np.array([D], np.int64)),
                                                add_init(f"{safe}_axis", np.array([-1], np.int64))],
                                      [out], name=f"{safe}_Slice"))
    return nodes


def _gather_nodes(layer: Any, safe: str, indices: str, out: str, fmt: str, add_init: AddInit) -> list[Any]:
    from onnx import helper

    D = layer._cols
    block = _block_size(D, layer.group_size, exact=True)
    if fmt == "matmulnbits" and layer.bits in (4, 8) and block is not None:
        g = D if layer.group_size == -1 else layer.group_size
        gidx = np.arange(D // block) * block // g  # group of each block
        data = layer.qweight.numpy() if layer.bits == 8 else pack_codes(layer.codes(), 4).numpy()
        packed_zeros = pack_codes(layer.zeros()[:, gidx], layer.bits).numpy()
        ins = [add_init(f"{safe}_Gq", data), indices,
               add_init(f"{safe}_Gs{block}", layer.scales.float().numpy()[:, gidx]),
               add_init(f"{safe}_Gz{block}", packed_zeros)]
        return [helper.make_node("GatherBlockQuantized", ins, [out], name=f"{safe}_GatherBlockQuantized",
                                 domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=block,
                                 bits=layer.bits)]
    data, dt, zeros = dq_weights(layer.codes().numpy(), layer.zeros().numpy(), layer.bits)
    scales = layer.scales.float().numpy()
    w = f"{safe}_Tdq"
    whole = layer.group_size == -1
    ins = [add_init(f"{safe}_Tq", data, dt), add_init(f"{safe}_Ts", scales[:, 0] if whole else scales)]
    if zeros is not None:
        ins.append(add_init(f"{safe}_Tz", zeros[:, 0] if whole else zeros, dt))
    dq = (helper.make_node("DequantizeLinear", ins, [w], axis=0) if whole else
          helper.make_node("DequantizeLinear", ins, [w], axis=1, block_size=layer.group_size))
    return [dq, helper.make_node("Gather", [w, indices], [out], axis=0)]


def _remove_dead(graph: Any) -> None:
    outputs = {o.name for o in graph.output}
    while True:
        used = set(outputs)
        for node in graph.node:
            used.update(i for i in node.input if i)
        keep = [n for n in graph.node if any(o in used for o in n.output)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    used = set(outputs)
    for node in graph.node:
        used.update(i for i in node.input if i)
    inits = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(inits)


# --- causal LM export with the KV cache ---------------------------------------------------------


def _hf_model(module: Any) -> Any:
    inner = getattr(module, "model", None)
    if inner is not None and hasattr(inner, "config") and hasattr(inner, "generate"):
        return inner
    if hasattr(module, "config") and hasattr(module, "generate"):
        return module
    raise BadInputError("KV-cache export needs a Hugging Face causal LM (a CausalLMWrapper or *ForCausalLM)")


def choose_graph(handle: Any, graph: str, *, with_past: bool = True, fmt: str = "matmulnbits") -> str:
    """The graph ``export_causal_lm`` writes: ``"fused"`` (``lm_graph``: GroupQueryAttention, fused
    norms and matmuls, in-place KV cache) where the architecture and settings allow it, else
    ``"traced"`` (optimum's export with the packed layers rewritten). ``graph="auto"`` chooses."""
    if graph not in GRAPHS:
        raise bad_choice("causal-LM graph", graph, GRAPHS)
    if graph == "traced":
        return graph
    ok, why = supports_fused_graph(_hf_model(handle.module))
    if ok and not with_past:
        ok, why = False, "the fused graph always carries the KV cache"
    if ok and fmt != "matmulnbits":
        ok, why = False, f"the fused graph writes MatMulNBits, not {fmt!r}"
    if graph == "fused" and not ok:
        raise BadInputError(f"--graph fused is not available for {handle.name}: {why} (use --graph traced)")
    if not ok:
        log.info("writing the traced graph: %s", why)
    return "fused" if ok else "traced"


def export_causal_lm(handle: Any, out_dir: str | os.PathLike[str], *, with_past: bool = True,
                     fmt: str = "matmulnbits", accuracy_level: int | None = DEFAULT_ACCURACY_LEVEL, opset: int = 21,
                     parity: bool = True, atol: float = 2e-3, rtol: float = 2e-3, graph: str = "auto",
                     block_size: int | None = None) -> Path:
    """Export a (packed or float) causal LM to an ``onnx`` artifact folder with its KV cache.

    ``graph``: ``"fused"`` writes ONNX Runtime's fused decoder graph (``lm_graph``) from the
    weights, ``"traced"`` traces the model with optimum and rewrites the packed layers, ``"auto"``
    (default) takes the fused graph where the architecture has one. ``block_size``: the fused
    graph's MatMulNBits block (default: the quantization group).

    The fused graph's weights are written to a temporary file layer by layer as they are made, and
    copied from there into the graph's file one tensor at a time: memory holds the packed model, never
    a second packed copy of it beside it.

    >>> export_causal_lm(load_model("out/w4"), "out/w4-onnx")  # doctest: +SKIP
    """
    graph = choose_graph(handle, graph, with_past=with_past, fmt=fmt)
    with tempfile.TemporaryDirectory(prefix="edgekit-lm-weights-") as spill:
        return _export_causal_lm(handle, out_dir, graph, os.path.join(spill, "weights.bin"), with_past=with_past,
                                 fmt=fmt, accuracy_level=accuracy_level, opset=opset, parity=parity, atol=atol,
                                 rtol=rtol, block_size=block_size)


def _export_causal_lm(handle: Any, out_dir: str | os.PathLike[str], graph: str, spill: str, *, with_past: bool,
                      fmt: str, accuracy_level: int | None, opset: int, parity: bool, atol: float, rtol: float,
                      block_size: int | None) -> Path:
    """``export_causal_lm`` once the graph kind is chosen; ``spill``: where the fused graph's weights are
    written layer by layer as they are made (``fused_decoder_parts``), read back into the graph's file."""
    import onnx

    task = "text-generation-with-past" if with_past else "text-generation"
    t0 = time.perf_counter()
    tensors: list[tuple[str, Initializer]] = []  # the fused graph's initializers, written after it (save_parts)
    if graph == "fused":
        proto, tensors = fused_decoder_parts(_hf_model(handle.module), FusedGraphConfig(
            block_size=block_size, accuracy_level=accuracy_level, opset=opset), spill=spill)
        release_memory()  # each layer's arrays were freed once spilled: their pages go back
        export_s = time.perf_counter() - t0
    else:
        if block_size is not None:
            raise BadInputError("--block-size applies to the fused graph (--graph fused)")
        proto = _traced_graph(handle, task, with_past, opset)
        export_s = time.perf_counter() - t0
        proto = rewrite_packed_graph(proto, handle.module, fmt=fmt, accuracy_level=accuracy_level)
        release_memory()  # the traced float weights the rewrite replaced
    out_dir = Path(out_dir)
    # what the manifest and the checks need from the graph, so that the proto is freed once saved:
    # the checks below hold ONNX Runtime sessions and the float model, never the proto beside them
    names = [i.name for i in proto.graph.input]
    outputs = [o.name for o in proto.graph.output]
    blocks = _graph_block_size(proto)
    step = decode_step_inputs(graph_inputs(proto)[0])(1, sequence=2, past_sequence_length=0)
    # past protobuf's 2 GB the weights go to model.onnx.data (the fused graph's a tensor at a time)
    large = proto.ByteSize() + sum(a.nbytes for _, a in tensors) > 2**31 - 2**20
    write_parts = save_parts_external if large else save_parts
    # a graph without MatMulNBits or QMoE computes the same whatever its accuracy level: no twin to check
    twin_parity = parity and bool(accuracy_level) and any(n.op_type in ACCURACY_OPS for n in proto.graph.node)
    with staged_dir(out_dir, (handle.source, handle.onnx_path)) as folder, \
            tempfile.TemporaryDirectory(prefix="edgekit-lm-parity-") as tmp:
        if tensors:
            write_parts(proto, tensors, folder / "model.onnx")
        else:
            onnx.save_model(proto, str(folder / "model.onnx"), save_as_external_data=large,
                            location="model.onnx.data" if large else None)
        twin = os.path.join(tmp, "model.onnx")
        if twin_parity:  # the same graph with fp32 compute (accuracy_level removed in place: no second copy),
            # its weights in a data file that ONNX Runtime maps instead of copying them (the same logits)
            if tensors:
                save_parts_external(set_accuracy_level(proto, None), tensors, twin)
            else:
                onnx.save_model(set_accuracy_level(proto, None), twin, save_as_external_data=True,
                                location="model.onnx.data")
        del proto, tensors
        release_memory()
        metrics: dict[str, Any] = {"export_seconds": round(export_s, 2),
                                   "onnx_bytes": sum(f.stat().st_size for f in folder.iterdir())}
        # PyTorch's logits once, before any ONNX Runtime session opens; every check below compares with them,
        # and meanwhile the packed model waits on disk: its weights are never in memory beside a session's
        refs = lm_references(handle, with_past=with_past, position_ids="position_ids" in names,
                             against_float=bool(handle.steps)) if parity else None
        release_memory(collect=False)  # the forwards' dequantized blocks
        # (in the staging folder: on the output's disk, not a memory-backed /tmp, and removed with it on failure)
        with weights_on_disk(handle.module, folder) if parity else contextlib.nullcontext(0):
            release_memory()  # once: what the forwards left to the collector goes too
            verify_onnx_runs(folder / "model.onnx", step, label=f"the exported graph of {handle.name}")
            release_memory(collect=False)  # the verifying session's arena
            if twin_parity:
                # int8 compute is an approximation by design: the graph itself is checked strictly on a twin
                # with fp32 compute, the shipped setting's deviation is recorded beside it
                metrics["parity"] = check_lm_parity(handle, twin, with_past=with_past, atol=atol, rtol=rtol,
                                                    references=refs)
                if handle.steps:  # against the float model too (quantization error as the tolerance)
                    metrics["parity_float"] = check_against_float(handle, twin, with_past=with_past, references=refs)
                metrics["parity"]["compute"] = "fp32 (twin of the shipped graph without accuracy_level)"
                metrics["parity_int8_compute"] = check_lm_parity(handle, folder / "model.onnx", with_past=with_past,
                                                                 atol=atol, rtol=INT8_COMPUTE_RTOL, references=refs)
            elif parity:
                metrics["parity"] = check_lm_parity(handle, folder / "model.onnx", with_past=with_past, atol=atol,
                                                    rtol=rtol, references=refs)
            if parity and not metrics["parity"]["passed"]:  # nothing is written: a wrong graph is not an artifact
                raise CheckFailedError(f"the exported graph of {handle.name} does not compute what the PyTorch "
                                       f"model computes: {parity_failure(metrics['parity'])}")
            if parity and handle.steps and "parity_float" not in metrics:
                metrics["parity_float"] = check_against_float(handle, folder / "model.onnx", with_past=with_past,
                                                              references=refs)
        context = declared_context(_hf_model(handle.module))
        write_manifest(folder, Manifest(
            kind="onnx", files={"onnx": "model.onnx"}, source=handle.source, metrics=metrics,
            model={**handle.describe(), "inputs": [{"name": n} for n in names],
                   "outputs": outputs, "kv_cache": with_past, **({"context": context} if context else {})},
            steps=[{"name": s.name, "config": s.config, "meta": {k: v for k, v in s.meta.items() if k != "layers"}}
                   for s in handle.steps],
            config={"task": task, "format": fmt, "accuracy_level": accuracy_level, "opset": opset, "graph": graph,
                    "block_size": blocks}))
    return out_dir


def forward_graph_without_cache(proto: Any) -> Any:
    """The fused decoder graph (``lm_graph``) as one forward from an empty cache, in place: inputs
    ``input_ids`` and ``attention_mask`` (batch, sequence), output ``logits``. The past keys and values
    become empty tensors made in the graph, ``position_ids`` the places 0 .. sequence - 1, the presents
    are no longer outputs. What the INT8 step calibrates and quantizes for a causal LM the fused graph
    writes: the same computation as the traced float export, without the dynamo trace (minutes and
    several GB for a 135M-parameter model)."""
    from onnx import TensorProto, helper

    g = proto.graph
    past = [i for i in g.input if i.name.startswith("past_key_values.")]
    nodes = [helper.make_node("Shape", ["input_ids"], ["nocache/ids_shape"], name="nocache/ids_shape"),
             helper.make_node("Slice", ["nocache/ids_shape", "nocache/zero1", "nocache/one1"], ["nocache/batch"],
                              name="nocache/batch"),
             helper.make_node("Gather", ["nocache/ids_shape", "nocache/one"], ["nocache/seq"], name="nocache/seq",
                              axis=0),
             helper.make_node("Range", ["nocache/zero", "nocache/seq", "nocache/one"], ["nocache/places"],
                              name="nocache/places"),
             helper.make_node("Unsqueeze", ["nocache/places", "nocache/zero1"], ["nocache/places2"],
                              name="nocache/places2"),
             helper.make_node("Expand", ["nocache/places2", "nocache/ids_shape"], ["position_ids"],
                              name="nocache/position_ids")]
    inits = [helper.make_tensor("nocache/zero", TensorProto.INT64, [], [0]),
             helper.make_tensor("nocache/one", TensorProto.INT64, [], [1]),
             helper.make_tensor("nocache/zero1", TensorProto.INT64, [1], [0]),
             helper.make_tensor("nocache/one1", TensorProto.INT64, [1], [1])]
    for i in past:  # (batch, kv_heads, 0, head_dim): an empty past of the batch's size
        dims = i.type.tensor_type.shape.dim
        rest = helper.make_tensor(f"nocache/{i.name}/dims", TensorProto.INT64, [3], [dims[1].dim_value, 0,
                                                                                     dims[3].dim_value])
        inits.append(rest)
        nodes += [helper.make_node("Concat", ["nocache/batch", rest.name], [f"nocache/{i.name}/shape"],
                                   name=f"nocache/{i.name}/shape", axis=0),
                  helper.make_node("ConstantOfShape", [f"nocache/{i.name}/shape"], [i.name], name=f"nocache/{i.name}",
                                   value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))]
    keep = [i for i in g.input if i.name in ("input_ids", "attention_mask")]
    del g.input[:]
    g.input.extend(keep)
    logits = [o for o in g.output if o.name == "logits"]
    del g.output[:]
    g.output.extend(logits)
    old = list(g.node)
    del g.node[:]
    g.node.extend(nodes + old)  # the made inputs first: the graph stays in topological order
    g.initializer.extend(inits)
    props = [p for p in proto.metadata_props if p.key != KV_CACHE_METADATA]
    del proto.metadata_props[:]
    proto.metadata_props.extend(props)
    return proto


def export_forward_graph(handle: Any, out_dir: str | os.PathLike[str]) -> Path | None:
    """A float causal LM's fused decoder graph as one forward without a cache
    (``forward_graph_without_cache``) in ``out_dir/model.onnx``, its weights written a tensor at a time;
    None where the model has no fused graph (the caller traces it instead). No parity check here: the
    INT8 step compares what it makes of the graph with the PyTorch model."""
    try:
        hf = _hf_model(handle.module)
    except BadInputError:  # a decoder without transformers' generate (MEGA, Open-Llama): the caller traces it
        return None
    ok, _ = supports_fused_graph(hf)
    if not ok or any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in handle.module.modules()):
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgekit-lm-weights-") as spill:
        proto, tensors = fused_decoder_parts(hf, FusedGraphConfig(), spill=os.path.join(spill, "weights.bin"))
        proto = forward_graph_without_cache(proto)
        large = proto.ByteSize() + sum(a.nbytes for _, a in tensors) > 2**31 - 2**20
        (save_parts_external if large else save_parts)(proto, tensors, out / "model.onnx")
    del proto, tensors
    release_memory()
    return out


def _traced_graph(handle: Any, task: str, with_past: bool, opset: int) -> Any:
    """optimum's traced export of the model (packed layers as float placeholders)."""
    import onnx
    import torch

    try:
        from optimum.exporters.onnx import onnx_export_from_model
    except ImportError as e:
        raise UnavailableError(f"causal-LM export with the KV cache needs optimum-onnx: {e}") from None
    hf = _hf_model(handle.module)
    cfg = hf.config
    if cfg.model_type == "falcon" and getattr(cfg, "new_decoder_architecture", False) and \
            getattr(cfg, "num_kv_heads", None) not in (None, cfg.num_attention_heads):
        # optimum's Falcon configuration shapes the cache with one KV head per query head
        raise traced_export_failure(cfg, RuntimeError(
            f"its Falcon configuration assumes as many KV heads as query heads, this model has {cfg.num_kv_heads} "
            f"for {cfg.num_attention_heads} (new_decoder_architecture, grouped KV)"))
    with tempfile.TemporaryDirectory(prefix="edgekit-lm-") as tmp:
        use_cache = hf.config.use_cache
        hf.config.use_cache = with_past
        try:
            # position-dependent rotary types (dynamic NTK, longrope) choose their rotation in the graph
            with torch.no_grad(), float_placeholders(handle.module), traceable_rope(hf):
                onnx_export_from_model(hf, output=tmp, task=task, opset=opset, do_validation=False,
                                       no_post_process=True)
        except BadInputError:  # edgekit's own refusal (an unknown rope type): already one line with its reason
            raise
        except (ValueError, RuntimeError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise traced_export_failure(hf.config, e) from None
        finally:
            hf.config.use_cache = use_cache
        release_memory()  # the float placeholders and the exporter's own copies, before the graph loads
        return onnx.load(os.path.join(tmp, "model.onnx"))


def traced_export_failure(config: Any, error: Exception) -> BadInputError:
    """One line for an architecture neither graph can write: the model type, what is missing (no
    fused graph, and what optimum's tracer said), and what does work (compress, PyTorch)."""
    model_type = getattr(config, "model_type", "?")
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "unsupported architecture" in text or "not supported" in text:
        why = "optimum's ONNX exporter has no configuration for it"
    elif "assumes" in text:
        why = f"optimum's ONNX exporter does not fit it: {text}"
    else:
        why = f"optimum's ONNX exporter fails on it ({type(error).__name__}: {text[:160]})"
    fused_ok, fused_why = supports_fused_graph_for(config)
    if fused_ok:  # the traced graph was asked for (--graph traced)
        fused_why = "the traced graph was asked for (the fused graph writes it: --graph auto or fused)"
    return BadInputError(f"cannot export model type {model_type!r} with the KV cache: {fused_why}, and {why}; "
                         "its compressed PyTorch model is still usable (edgekit compress, evaluate)")


def supports_fused_graph_for(config: Any) -> tuple[bool, str]:
    """``supports_fused_graph`` from a config alone."""
    class _Holder:  # a model with a config and no modules (the rotary checks find none)
        def named_modules(self) -> Iterator[tuple[str, Any]]:
            return iter(())

    holder = _Holder()
    holder.config = config  # type: ignore[attr-defined]
    return supports_fused_graph(holder)


def _graph_block_size(proto: Any) -> list[int]:
    """The MatMulNBits block sizes in a graph (empty for a float graph)."""
    from onnx import helper

    return sorted({int(helper.get_attribute_value(a)) for n in proto.graph.node if n.op_type == "MatMulNBits"
                   for a in n.attribute if a.name == "block_size"})


@contextlib.contextmanager
def float_placeholders(module: Any) -> Iterator[Any]:
    """Temporarily swap packed layers for float ``nn.Linear`` / ``nn.Embedding`` holding the
    dequantized weights (a tied table stays one shared tensor). Tracing then costs what a
    float export costs, and ``rewrite_packed_graph`` finds the weights by content."""
    import torch
    from torch import nn

    swapped = []
    tables: dict[int, nn.Parameter] = {}
    for name, m in list(module.named_modules()):
        if not isinstance(m, (QuantLinear, QuantEmbedding)):
            continue
        key = m.qweight.data_ptr()
        if key not in tables:
            tables[key] = nn.Parameter(m.dequantize().detach(), requires_grad=False)
        new: nn.Module
        if isinstance(m, QuantLinear):
            new = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            new.weight = tables[key]
            if m.bias is not None:
                new.bias = nn.Parameter(m.bias.detach().clone(), requires_grad=False)
        else:
            new = ScaledEmbedding(m.num_embeddings, m.embedding_dim, padding_idx=m.padding_idx, _weight=tables[key],
                                  scale=m.scale)
        parent, _, child = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        setattr(owner, child, new)
        swapped.append((owner, child, m))
    try:
        yield module
    finally:
        for owner, child, m in swapped:
            setattr(owner, child, m)
        del tables
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def lm_session(path: str | os.PathLike[str], threads: int = 1, fp32_compute: bool = False) -> Any:
    """A CPU session for a causal-LM graph. ``fp32_compute``: ONNX Runtime fuses blocked 4-bit
    DequantizeLinear -> MatMul into MatMulNBits with int8 compute by default; keep it fp32 (for parity)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # parity runs a few short prompts beside the PyTorch model: without the arena each run's buffers go
    # back, instead of the arena keeping every run's high-water mark until the session closes
    so.enable_cpu_mem_arena = False
    if fp32_compute:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def empty_past(sess: Any, batch: int = 1) -> dict[str, np.ndarray]:
    """Zero-length past_key_values feeds for a with-past session."""
    feeds = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            _, heads, _, dim = i.shape
            feeds[i.name] = np.zeros((batch, int(heads), 0, int(dim)), dtype=np.float32)
    return feeds


def lm_feeds(sess: Any, input_ids: np.ndarray, past: dict[str, np.ndarray] | None = None,
             start: int = 0) -> dict[str, np.ndarray]:
    """Feeds for one forward: ``input_ids`` (b, t) after ``past`` (feeds of the previous present), at
    positions ``start + past length`` onwards (``start``: where a sequence begins, for checks far into
    the context without a long prompt)."""
    past = past if past is not None else empty_past(sess, input_ids.shape[0])
    plen = next(iter(past.values())).shape[2] if past else 0
    b, t = input_ids.shape
    names = {i.name for i in sess.get_inputs()}
    feeds = {"input_ids": input_ids.astype(np.int64)}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones((b, plen + t), dtype=np.int64)
    if "position_ids" in names:
        first = start + plen
        feeds["position_ids"] = np.broadcast_to(np.arange(first, first + t, dtype=np.int64), (b, t)).copy()
    feeds.update({k: v for k, v in past.items() if k in names})
    return feeds


def presents_to_past(sess: Any, outputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return {n.replace("present", "past_key_values"): v for n, v in zip(names, outputs) if n.startswith("present")}


def onnx_logits(sess: Any, ids: np.ndarray, prompt_len: int, with_past: bool, start: int = 0) -> np.ndarray:
    """Logits of ``ids`` through the session: a prefill of ``prompt_len`` tokens then one-token decode
    steps on the cache (with past; positions from ``start``), else one forward."""
    if with_past:
        out = sess.run(None, lm_feeds(sess, ids[:, :prompt_len], start=start))
        logits = [out[0]]
        for k in range(prompt_len, ids.shape[1]):
            out = sess.run(None, lm_feeds(sess, ids[:, k:k + 1], presents_to_past(sess, out), start=start))
            logits.append(out[0])
        return np.concatenate(logits, axis=1)
    return sess.run(None, {k: v for k, v in {"input_ids": ids, "attention_mask": np.ones_like(ids)}.items()
                           if k in {i.name for i in sess.get_inputs()}})[0]


def torch_logits(hf: Any, ids: np.ndarray, prompt_len: int, start: int = 0) -> np.ndarray:
    """Logits of ``ids`` through transformers as ``generate`` runs it: a prefill of ``prompt_len`` tokens
    at positions ``start`` onwards, then one-token steps on its own KV cache, from a fresh rotary state
    (position-dependent rotary types choose each step's rotation from its position)."""
    import torch
    from transformers import DynamicCache

    reset_rope_state(hf)
    t = torch.from_numpy(ids)
    cache = DynamicCache()
    logits = []
    with torch.no_grad():
        for lo, hi in [(0, prompt_len)] + [(k, k + 1) for k in range(prompt_len, ids.shape[1])]:
            positions = torch.arange(start + lo, start + hi).expand(ids.shape[0], -1)
            out = hf(input_ids=t[:, lo:hi], attention_mask=torch.ones(ids.shape[0], hi, dtype=torch.int64),
                     position_ids=positions, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits.float())
    reset_rope_state(hf)
    return torch.cat(logits, 1).numpy()


# Decode steps after each prefill of the long-context checks (the first crosses the position a prefill ends at).
LONG_CHECK_DECODE = 2


def check_long_context(handle: Any, sess: Any, ids: np.ndarray, *, prompt_len: int, atol: float,
                       rtol: float, references: dict[int, np.ndarray] | None = None) -> dict[str, Any] | None:
    """Parity far into the context, where rotary scaling changes what a position computes: for each
    threshold the config declares (dynamic NTK's ``max_position_embeddings``, longrope's and the
    scalings' ``original_max_position_embeddings``), a prefill ending at it whose decode steps cross it
    and a prefill starting at it, and a prefill whose decode steps reach the end of the declared
    context (``rope.check_starts``). Short prompts placed there by their position ids, so a
    128k-context model costs what a 16-token check costs. None for a model without rotary embedding
    or a graph without position ids. ``references``: PyTorch's logits from each start
    (``long_context_references``), else computed here."""
    hf = _hf_model(handle.module)
    spec = model_rope(hf)
    if spec is None or "position_ids" not in {i.name for i in sess.get_inputs()}:
        return None
    starts = check_starts(spec, prompt_len, LONG_CHECK_DECODE)
    if references is None:
        references = long_context_references(handle, ids, prompt_len)
    worst_abs, worst_rel, agree, count = 0.0, 0.0, 0, 0
    passed = True
    for start in starts:
        ref = references[start]
        got = onnx_logits(sess, ids, prompt_len, True, start)
        diff = float(np.abs(got - ref).max())
        scale = float(np.abs(ref).max())
        worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, diff / max(scale, 1e-12))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        count += got.shape[0] * got.shape[1]
        passed &= diff <= atol + rtol * scale
    return {"rope_type": spec.rope_type, "thresholds": list(spec.thresholds), "context": spec.context,
            "starts": starts, "tokens_each": int(ids.shape[1]), "max_abs_diff": worst_abs, "max_rel_diff": worst_rel,
            "argmax_agreement": agree / max(count, 1), "passed": bool(passed)}


def long_context_references(handle: Any, ids: np.ndarray, prompt_len: int) -> dict[int, np.ndarray]:
    """PyTorch's logits of ``ids`` from each first position ``check_long_context`` checks (empty for a
    model without rotary embedding)."""
    hf = _hf_model(handle.module)
    spec = model_rope(hf)
    if spec is None:
        return {}
    return {start: torch_logits(hf, ids, prompt_len, start) for start in check_starts(spec, prompt_len,
                                                                                        LONG_CHECK_DECODE)}


@dataclass
class LMReferences:
    """The PyTorch logits the parity checks compare a causal-LM graph with (``lm_references``)."""

    prompt_len: int
    ids: np.ndarray  # (1, prompt_len + LONG_CHECK_DECODE) token ids
    short: np.ndarray  # (1, prompt_len + 1, vocab): one forward over ids[:, :prompt_len + 1]
    long: dict[int, np.ndarray] | None  # first position -> logits far into the context (with past only)
    float_ids: np.ndarray | None = None  # check_against_float's prompt (against_float)
    float_packed: np.ndarray | None = None  # the packed model's logits on it (``short`` where the prompts agree)


def float_check_ids(handle: Any, prompt_len: int) -> np.ndarray:
    """The prompt ``check_against_float`` compares on: (1, prompt_len + 1) token ids."""
    return handle.sample_inputs(1, sequence=prompt_len + 1)["input_ids"][:, : prompt_len + 1]


def lm_references(handle: Any, *, with_past: bool = True, prompt_len: int = 16, position_ids: bool = True,
                  against_float: bool = False) -> LMReferences:
    """PyTorch's side of ``check_lm_parity`` (and, ``against_float``, the packed logits of
    ``check_against_float``), computed once, before any ONNX Runtime session opens: the packed model's
    forwards dequantize its weights block by block, and those transients never sit beside a session of
    its graph. The checks of the fp32 twin and of the int8-compute graph compare with the same logits,
    so they are computed once. ``position_ids``: whether the graph takes them (else the long-context
    check does not run).

    >>> refs = lm_references(handle)  # doctest: +SKIP
    >>> check_lm_parity(handle, "out/model.onnx", references=refs)["passed"]  # doctest: +SKIP
    """
    import torch

    feeds = handle.sample_inputs(1, sequence=prompt_len + LONG_CHECK_DECODE)
    ids = np.ascontiguousarray(feeds["input_ids"][:, : prompt_len + LONG_CHECK_DECODE])
    short = torch.from_numpy(ids[:, : prompt_len + 1])
    with torch.no_grad():
        ref = handle.module(short, torch.ones_like(short)).float().numpy()
    long = long_context_references(handle, ids, prompt_len) if with_past and position_ids else None
    refs = LMReferences(prompt_len=prompt_len, ids=ids, short=ref, long=long)
    if against_float:
        refs.float_ids = float_check_ids(handle, prompt_len)
        if np.array_equal(refs.float_ids, short.numpy()):
            refs.float_packed = ref
        else:
            t = torch.from_numpy(np.ascontiguousarray(refs.float_ids))
            with torch.no_grad():
                refs.float_packed = handle.module(t, torch.ones_like(t)).float().numpy()
    return refs


def parity_failure(report: dict[str, Any]) -> str:
    """What a failed ``check_lm_parity`` report found, in one line."""
    tol = f"atol {report['atol']:g} + rtol {report['rtol']:g} x the largest logit"
    parts = []
    if report["max_abs_diff"] > report["atol"] + report["rtol"] * report["largest_logit"]:
        parts.append(f"a {report['tokens'] - 1}-token prefill and a decode step differ by {report['max_abs_diff']:.3g} "
                     f"(relative {report['max_rel_diff']:.3g}; {tol})")
    bound = report.get("io_binding", {}).get("max_abs_diff_to_plain_loop", 0.0)
    if bound > report["atol"]:
        parts.append(f"the IO-bound KV-cache loop differs from the plain loop by {bound:.3g}")
    long = report.get("long_context")
    if long and not long["passed"]:
        parts.append(f"far into the context ({long['rope_type']} rotary, thresholds {long['thresholds']}, checked "
                     f"from positions {long['starts']}) the logits differ by {long['max_abs_diff']:.3g} (relative "
                     f"{long['max_rel_diff']:.3g}, top-1 agreement {long['argmax_agreement']:.2f}; {tol})")
    return "; ".join(parts) or f"parity report {report}"


def check_lm_parity(handle: Any, onnx_path: str | os.PathLike[str], *, with_past: bool = True, prompt_len: int = 16,
                    atol: float = 2e-3, rtol: float = 2e-3, references: LMReferences | None = None) -> dict[str, Any]:
    """Logits of ONNX Runtime vs the PyTorch model, on a prefill and (with past) one decode step, and
    (with past, for rotary models) far into the context (``check_long_context``). ``references``:
    PyTorch's logits (``lm_references``) shared by several checks; else computed here, before the
    session opens."""
    if references is None:
        references = lm_references(handle, with_past=with_past, prompt_len=prompt_len)
        release_memory(collect=False)  # the forwards' dequantized blocks, before the session's weights
    elif references.prompt_len != prompt_len:
        raise ValueError(f"references for a {references.prompt_len}-token prompt, parity asked for {prompt_len}")
    ids, ref = references.ids, references.short
    short = ids[:, : prompt_len + 1]
    sess = lm_session(onnx_path, threads=2, fp32_compute=True)
    report: dict[str, Any] = {"atol": atol, "rtol": rtol}
    got = onnx_logits(sess, short, prompt_len, with_past)
    diff = np.abs(got - ref)
    scale = np.abs(ref).max()
    report.update({"max_abs_diff": float(diff.max()), "max_rel_diff": float(diff.max() / max(scale, 1e-12)),
                   "argmax_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
                   "tokens": int(short.shape[1]), "largest_logit": float(scale)})
    report["passed"] = bool(report["max_abs_diff"] <= atol + rtol * scale)
    if with_past:  # the IO-bound loop (in-place KV cache where the graph allows it) must give the same logits
        decoder = KVCacheDecoder(sess, max_length=prompt_len + 8)
        bound = np.concatenate([decoder.forward(short[:, :prompt_len]), decoder.forward(short[:, prompt_len:])],
                               axis=1)
        report["io_binding"] = {"kv_cache": "in place (shared buffer)" if decoder.shared else "bound presents",
                                "max_abs_diff_to_plain_loop": float(np.abs(bound - got).max())}
        report["passed"] = report["passed"] and bool(np.abs(bound - got).max() <= atol)
        del decoder
        release_memory(collect=False)  # the runs' freed outputs, before the next runs' transients
        long = check_long_context(handle, sess, ids, prompt_len=prompt_len, atol=atol, rtol=rtol,
                                  references=references.long)
        if long is not None:
            report["long_context"] = long
            report["passed"] = report["passed"] and long["passed"]
    del sess
    release_memory(collect=False)  # the session's weights and buffers, before the next check
    if not report["passed"]:
        log.warning("LM parity failed: %s", report)
    return report


# The ONNX may differ from the float model by the quantization error, measured on the same prompt as
# the packed PyTorch model's distance to the float model, plus this slack for ONNX Runtime's own
# accumulation order; and that distance may be at most FLOAT_ERROR_FACTOR times the relative logit
# error compress recorded on held-out data (metrics.quality, in the step's meta), at least FLOAT_ERROR_FLOOR.
FLOAT_PARITY_SLACK = (1.1, 1e-3)
FLOAT_ERROR_FACTOR, FLOAT_ERROR_FLOOR = 3.0, 0.05


def check_against_float(handle: Any, onnx_path: str | os.PathLike[str], *, with_past: bool = True,
                        prompt_len: int = 16, references: LMReferences | None = None) -> dict[str, Any]:
    """Parity of a compressed model's ONNX against the *float* model it came from (reloaded from
    ``handle.source``): the relative logit error may be the quantization error and no more
    (``FLOAT_PARITY_SLACK``, ``FLOAT_ERROR_FACTOR``). Raises ``CheckFailedError`` beyond it: a graph
    that matches an already-wrong PyTorch model does not pass. ``references``: the compressed model's
    logits already computed for ``check_lm_parity`` (``lm_references``), used where their prompt is
    this check's."""
    import torch

    ids = float_check_ids(handle, prompt_len)
    t = torch.from_numpy(ids)
    # the compressed model's and the graph's logits first, the float model last and alone: it never
    # shares the memory with an ONNX Runtime session
    if references is not None and references.float_packed is not None and references.float_ids is not None and \
            np.array_equal(references.float_ids, ids):
        packed = references.float_packed
    else:
        with torch.no_grad():
            packed = handle.module(t, torch.ones_like(t)).float().numpy()
        release_memory(collect=False)  # the forward's dequantized blocks, before the session's weights
    sess = lm_session(onnx_path, threads=2)
    got = onnx_logits(sess, ids, prompt_len, with_past)
    del sess
    release_memory()
    # a base stored in bfloat16 loads as stored and computes in float32 a layer at a time, each layer's
    # pages of the file let go after it: the float model is never whole in memory beside the compressed one
    base = load_model(handle.source, half_storage=True)
    if base.module is None:
        return {"skipped": f"the base model {handle.source} has no PyTorch module"}
    with torch.no_grad(), float32_compute(base.module, drop_pages=True):
        ref = base.module(t, torch.ones_like(t)).float().numpy()
    del base

    def rel(a: np.ndarray) -> float:
        return float(np.linalg.norm(a - ref) / max(float(np.linalg.norm(ref)), 1e-30))

    recorded = [s.meta.get("quality", {}).get("relative_error") for s in handle.steps if isinstance(s.meta, dict)]
    recorded = [r for r in recorded if isinstance(r, (int, float))]
    factor, slack = FLOAT_PARITY_SLACK
    expected = rel(packed)
    report: dict[str, Any] = {"relative_error": round(rel(got), 6), "expected_quantization_error": round(expected, 6),
                              "argmax_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
                              "tolerance": round(factor * expected + slack, 6)}
    problems = []
    if not rel(got) <= factor * expected + slack:
        problems.append(f"its logits differ from the float model's by {rel(got):.3g} (relative), more than the "
                        f"quantization error {expected:.3g} allows")
    if recorded:
        bound = max(FLOAT_ERROR_FACTOR * max(recorded), FLOAT_ERROR_FLOOR)
        report["recorded_quantization_error"] = max(recorded)
        if not expected <= bound:
            problems.append(f"the packed model differs from the float model by {expected:.3g} (relative) on the parity "
                            f"prompt, beyond {bound:.3g} ({FLOAT_ERROR_FACTOR:g}x the {max(recorded):.3g} compress measured)")
    report["passed"] = not problems
    if problems:
        raise CheckFailedError(f"the exported graph of {handle.name} is not the model it was compressed from: "
                               f"{'; '.join(problems)}")
    return report


def generate_greedy(sess: Any, input_ids: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy decoding through a with-past ONNX session (the smoke check)."""
    out = sess.run(None, lm_feeds(sess, input_ids))
    tokens = [int(out[0][0, -1].argmax())]
    for _ in range(new_tokens - 1):
        out = sess.run(None, lm_feeds(sess, np.array([[tokens[-1]]]), presents_to_past(sess, out)))
        tokens.append(int(out[0][0, -1].argmax()))
    return np.array(tokens)


__all__ = ["rewrite_packed_graph", "export_causal_lm", "with_accuracy_level", "check_lm_parity", "lm_references",
           "LMReferences", "lm_session", "lm_feeds",
           "presents_to_past", "empty_past", "generate_greedy", "CheckFailedError"]
