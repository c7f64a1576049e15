"""The kernels a runtime runs for a graph: ONNX nodes grouped the way the runtime fuses them.

Every node ends up in one of four states: ``folded`` (constant: computed at build time),
``view`` (no data moves: reshapes, squeezes, DequantizeLinear of an 8-bit activation
read by its consumer, and on TensorRT concatenations and transposes that it eliminates),
``fused`` (part of a kernel headed by another node) or ``runs`` (heads a kernel).

Fusions per runtime (``FUSION_MODELS``: each runtime's rules as data, so the grouping below
never asks which runtime it models):

* ``tensorrt``: a convolution or matrix product takes the pointwise chain after it as its
  epilogue (bias, batch norm, activation, residual add, Q/DQ); pointwise chains,
  normalizations and reductions between them become one kernel (layer norm included);
  ``MatMul -> scale/mask -> Softmax -> MatMul`` becomes one attention kernel that keeps
  the scores on chip.
* ``onnxruntime`` (optimization level all): a convolution absorbs batch norm, a bias add,
  one activation and a residual add (its fused and NCHWc convolutions), a matrix product
  its bias; layer-norm, GELU and SiLU patterns become one kernel each; attention becomes
  one kernel that still writes its scores; other element-wise ops run one by one.
* ``none``: every node runs as written (a graph a runtime already optimized).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from edgekit.errors import BadInputError, bad_choice
from edgekit.estimate.cost import (
    ATTENTION_OPS,
    CONV_OPS,
    ELEMENTWISE_OPS,
    MATMUL_OPS,
    NORMALIZATION_OPS,
    VIEW_OPS,
)
from edgekit.estimate.graph import Graph, Node


@dataclass(frozen=True)
class FusionModel:
    """How a runtime groups a graph's nodes into kernels (see the module docstring)."""

    fuses: bool = True  # False: every node runs as written (constants are not folded either)
    free_ops: frozenset[str] = frozenset()  # ops its engine eliminates (folds into neighbouring kernels)
    free_transposes_at_conv: bool = False  # a layout optimizer cancels transposes next to a convolution
    pattern_islands_only: bool = False  # only recognised pointwise patterns fuse; others run one by one
    silu_fusion: bool = False  # x * sigmoid(x) becomes one kernel
    island_epilogue: bool = False  # a conv / matrix product takes the whole pointwise island after it
    chain_epilogue: bool = False  # ... or a short chain: batch norm, a bias, one activation, a residual add
    attention_keeps_scores: bool = False  # the fused attention still writes its scores
    blocked_reorders: bool = False  # on blocked-layout CPUs, reorder copies where convolutions meet other ops


FUSION_MODELS: dict[str, FusionModel] = {
    "tensorrt": FusionModel(free_ops=frozenset({"Concat", "Split", "Transpose", "Slice"}), island_epilogue=True),
    "onnxruntime": FusionModel(free_transposes_at_conv=True, pattern_islands_only=True, silu_fusion=True,
                               chain_epilogue=True, attention_keeps_scores=True, blocked_reorders=True),
    "none": FusionModel(fuses=False),
}
FUSION_RUNTIMES = tuple(FUSION_MODELS)
DEFAULT_FUSION = "onnxruntime"  # what a runtime without a fusion model of its own is read as
ANCHOR_OPS = CONV_OPS | MATMUL_OPS | ATTENTION_OPS
# Reductions that engines fuse with their pointwise neighbours (the axis is inner, not global).
_FUSABLE_REDUCE = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceSumSquare", "ReduceL2"}
POINTWISE_OPS = set(ELEMENTWISE_OPS) | set(NORMALIZATION_OPS) | _FUSABLE_REDUCE
# What a chain epilogue (ONNX Runtime's) folds into a convolution / matrix product.
_CHAIN_EPILOGUE = {"BatchNormalization", "Relu", "Clip", "LeakyRelu", "HardSigmoid", "Sigmoid", "Tanh"}


@dataclass
class Kernel:
    """One kernel the runtime launches: its nodes (the head first) and the fusion that made it."""

    head: Node
    nodes: list[Node]
    pattern: str  # "single" | "epilogue" | "pointwise" | "layernorm" | "gelu" | "attention"
    keeps_intermediates: bool = False  # the fused attention of ONNX Runtime still writes its scores
    reorder_in: bool = False  # ONNX Runtime's blocked (NCHWc) convolution copies its input into its layout
    reorder_out: bool = False  # ... and its output back, for a reader that is not a blocked op


@dataclass
class Fused:
    kernels: list[Kernel]
    status: dict[int, str]  # node index -> runs | fused | view | folded
    counts: dict[str, int] = field(default_factory=dict)  # pattern -> kernels


class _Sets:
    def __init__(self) -> None:
        self.parent: dict[int, int] = {}
        self.sizes: dict[int, int] = {}

    def find(self, a: int) -> int:
        self.parent.setdefault(a, a)
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)
            self.sizes[min(ra, rb)] = self.sizes.get(ra, 1) + self.sizes.get(rb, 1)

    def size(self, a: int) -> int:
        return self.sizes.get(self.find(a), 1)

    def split(self, a: int) -> None:
        self.parent[a] = a
        self.sizes[a] = 1


def fuse(graph: Graph, runtime: str, blocked_layout: bool = False) -> Fused:
    """Group the graph's nodes into the kernels ``runtime`` runs (see the module docstring).
    ``blocked_layout``: ONNX Runtime on a CPU with AVX-512/AVX2 runs convolutions in its
    blocked NCHWc layout, with a reorder copy wherever a convolution meets another op."""
    if runtime not in FUSION_MODELS:
        raise BadInputError(bad_choice("fusion runtime", runtime, FUSION_RUNTIMES))
    model = FUSION_MODELS[runtime]
    status: dict[int, str] = {}
    for node in graph.nodes:
        outs = [t for t in node.outputs if t is not None]
        if node.op == "Constant" or (model.fuses and outs and all(t.const for t in outs)):
            status[node.index] = "folded"
        elif node.op in VIEW_OPS or _is_free(node, model, graph):
            status[node.index] = "view"
    live = [n for n in graph.nodes if n.index not in status]
    if not model.fuses:
        kernels = [Kernel(n, [n], "single") for n in live]
        return _finish(kernels, status)

    def consumers(node: Node) -> list[Node]:
        """The live nodes that read a node's outputs, looking through views."""
        out: list[Node] = []
        todo = [t.name for t in node.outputs if t is not None]
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for c in graph.consumers.get(name, []):
                if status.get(c.index) == "view":
                    todo += [t.name for t in c.outputs if t is not None]
                elif c.index not in status:
                    out.append(c)
        return out

    def producers(node: Node) -> list[Node]:
        out: list[Node] = []
        todo = [t.name for t in node.inputs if t is not None and not t.const]
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            p = graph.producer.get(name)
            if p is None:
                continue
            if status.get(p.index) == "view":
                todo += [t.name for t in p.inputs if t is not None and not t.const]
            elif p.index not in status:
                out.append(p)
        return out

    def is_graph_output(node: Node) -> bool:
        return any(t is not None and t.name in graph.outputs for t in node.outputs)

    pointwise = {n.index for n in live if n.op in POINTWISE_OPS}
    sets = _Sets()
    for n in live:
        sets.find(n.index)
    # Islands: a pointwise node joins its pointwise producer when every reader of that
    # producer's output is pointwise (the intermediate then never leaves the kernel) and
    # there are few of them (a tensor read all over the graph, like an attention mask
    # computed once, is written once, not fused into every reader).
    for n in live:
        if n.index not in pointwise:
            continue
        for p in producers(n):
            readers = consumers(p)
            if p.index in pointwise and not is_graph_output(p) and len({r.index for r in readers}) <= 3 \
                    and all(c.index in pointwise for c in readers):
                sets.union(n.index, p.index)
    members: dict[int, list[Node]] = {}
    for n in live:
        members.setdefault(sets.find(n.index), []).append(n)
    # Attention: MatMul(Q, K) -> island with Softmax -> MatMul(P, V), both products of activations.
    attention: set[int] = set()
    for n in live:
        if n.op != "Softmax":
            continue
        island = sets.find(n.index)
        island_nodes = members.get(island, [n])
        qk = [p for m in island_nodes for p in producers(m) if _act_matmul(p)]
        av = [c for m in island_nodes for c in consumers(m) if _act_matmul(c)]
        if len(qk) == 1 and len(av) == 1 and qk[0].index != av[0].index:
            for m in (qk[0], av[0]):
                sets.union(island, m.index)
            attention = {sets.find(a) for a in attention} | {sets.find(island)}
    if model.pattern_islands_only:  # other element-wise ops run one by one
        in_attention = {sets.find(a) for a in attention}
        for root, ns in list(members.items()):
            if root not in in_attention and ns[0].index in pointwise and len(ns) > 1 \
                    and _island_pattern(ns) == "pointwise":
                for n in ns:
                    sets.split(n.index)
    if model.silu_fusion:
        for n in live:  # x * sigmoid(x): its QuickGelu/SiLU fusion
            if n.op == "Sigmoid" and n.inputs and n.inputs[0] is not None and sets.size(n.index) == 1:
                readers = consumers(n)
                if len(readers) == 1 and readers[0].op == "Mul" and sets.size(readers[0].index) == 1 and \
                        n.inputs[0].name in {t.name for t in readers[0].inputs if t is not None}:
                    sets.union(n.index, readers[0].index)
    # Epilogues: a convolution or matrix product takes the island that reads its output.
    anchored = set(attention)
    for n in live:
        if n.op not in CONV_OPS | MATMUL_OPS or sets.find(n.index) in anchored or is_graph_output(n):
            continue
        readers = consumers(n)
        if not readers or any(r.index not in pointwise for r in readers):
            continue
        if model.island_epilogue:
            roots = {sets.find(r.index) for r in readers}
            if len(roots) != 1:
                continue
            root = roots.pop()
            if root in anchored:
                continue
            sets.union(n.index, root)
            anchored.add(sets.find(root))
        elif model.chain_epilogue:
            _chain_epilogue(n, consumers, sets, pointwise)
    groups: dict[int, list[Node]] = {}
    for n in live:
        groups.setdefault(sets.find(n.index), []).append(n)
    kernels = []
    for root, ns in groups.items():
        ns.sort(key=lambda x: x.index)
        heads = [m for m in ns if m.op in ANCHOR_OPS]
        head = heads[0] if heads else ns[0]
        if root in {sets.find(a) for a in attention}:
            kernels.append(Kernel(head, [head, *[m for m in ns if m is not head]], "attention",
                                  keeps_intermediates=model.attention_keeps_scores))
        elif heads and len(ns) > 1:
            kernels.append(Kernel(head, [head, *[m for m in ns if m is not head]], "epilogue"))
        elif len(ns) > 1:
            kernels.append(Kernel(head, ns, _island_pattern(ns)))
        else:
            kernels.append(Kernel(head, ns, "single"))
    kernels.sort(key=lambda k: k.head.index)
    if blocked_layout and model.blocked_reorders:
        _mark_reorders(kernels, graph, consumers, producers)
    return _finish(kernels, status)


_BLOCKED_OPS = CONV_OPS | {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"}


def _mark_reorders(kernels: list[Kernel], graph: Graph, consumers: Callable[[Node], list[Node]],
                   producers: Callable[[Node], list[Node]]) -> None:
    head_of = {n.index: k.head for k in kernels for n in k.nodes}
    for k in kernels:
        if k.head.op not in CONV_OPS:
            continue
        inside = {n.index for n in k.nodes}
        before = [head_of.get(p.index) for p in producers(k.head)]
        k.reorder_in = not before or any(h is None or h.op not in _BLOCKED_OPS for h in before)
        after = [head_of.get(c.index) for n in k.nodes for c in consumers(n) if c.index not in inside]
        k.reorder_out = any(h is None or h.op not in _BLOCKED_OPS for h in after) or \
            any(t is not None and t.name in graph.outputs for n in k.nodes for t in n.outputs)


def _chain_epilogue(n: Node, consumers: Callable[[Node], list[Node]], sets: _Sets, pointwise: set[int]) -> None:
    """Conv/matmul fusions of a chain (ONNX Runtime's): batch norm, a bias add, one activation
    and (for a convolution) a residual add, each the single reader of the previous output."""
    chain: list[Node] = []
    cur = n
    activation = False
    residual = False
    while True:
        rs = consumers(cur)
        if len(rs) != 1 or rs[0].index not in pointwise or sets.size(rs[0].index) > 1:
            break
        r = rs[0]
        if r.op in _CHAIN_EPILOGUE and not activation:
            activation = r.op != "BatchNormalization"
        elif r.op == "QuantizeLinear":  # QDQ fusion: the kernel writes the 8-bit tensor
            chain.append(r)
            break
        elif r.op in ("Add", "Mul") and not activation and any(t is not None and t.const for t in r.inputs):
            pass  # bias, scale (ONNX Runtime's conv-add and conv-mul fusions)
        elif r.op == "Add" and n.op in CONV_OPS and not residual and not activation:
            residual = True
        else:
            break
        chain.append(r)
        cur = r
    for r in chain:
        sets.union(n.index, r.index)


def _act_matmul(node: Node) -> bool:
    return node.op == "MatMul" and all(t is not None and not t.const for t in node.inputs[:2])


def _island_pattern(nodes: list[Node]) -> str:
    ops = {n.op for n in nodes}
    if len(nodes) == 1:
        return "single"
    if ops & _FUSABLE_REDUCE and ops & {"Sqrt", "Div", "Reciprocal", "Pow"}:
        return "layernorm"
    if ops & {"Erf", "Tanh"} and "Mul" in ops:
        return "gelu"
    if ops == {"Sigmoid", "Mul"}:
        return "silu"
    return "pointwise"


def _is_free(node: Node, model: FusionModel, graph: Graph | None = None) -> bool:
    """Nodes that move no data in this runtime's engine."""
    if node.op == "DequantizeLinear" and node.inputs and node.inputs[0] is not None and not node.inputs[0].const:
        outs = {t.name for t in node.outputs if t is not None}
        return model.fuses and not (graph is not None and outs & graph.outputs)  # the consumer reads int8
    if node.op == "Cast" and node.inputs and node.inputs[0] is not None and node.outputs and node.outputs[0] is not None:
        if node.inputs[0].elem == node.outputs[0].elem:
            return True
    if node.op in model.free_ops:
        return True  # concatenation elimination; layouts folded into the neighbouring kernels
    if model.free_transposes_at_conv and node.op == "Transpose" and graph is not None:
        near = [graph.producer.get(t.name) for t in node.inputs if t is not None]
        near += [c for t in node.outputs if t is not None for c in graph.consumers.get(t.name, [])]
        return any(n is not None and n.op in CONV_OPS for n in near)  # its layout optimizer cancels these
    return False


def _finish(kernels: list[Kernel], status: dict[int, str]) -> Fused:
    counts: dict[str, int] = {}
    for k in kernels:
        status[k.head.index] = "runs"
        for n in k.nodes[1:]:
            status[n.index] = "fused"
        counts[k.pattern] = counts.get(k.pattern, 0) + 1
    return Fused(kernels, status, counts)
