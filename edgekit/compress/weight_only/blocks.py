"""The block walk shared by the weight-only algorithms (GPTQ, AWQ): the model's repeated blocks
and their linear layers, and the calibration activations flowing through them.

``BlockWalker.walk(linears, visit_group)`` captures the inputs of block 0 once for all
calibration windows; then, for each block, visits its linear layers in execution order,
grouped by shared input (q/k/v, o, gate/up, down for a Llama block), each group seeing inputs
produced by the already-quantized groups before it (``GroupInputs``: the forward stops right
after the group's input is seen); finally it runs the quantized block to produce the next
block's inputs. Memory holds one block's activations for all windows, never the whole model's.

A pass to a group replays what is already final instead of recomputing it from the block's
start: a probe forward of the first batch (``BlockPlan``) finds the submodules whose output is one
linear's output (a decoder layer's attention returns ``o_proj(x)``, its MLP ``down_proj(x)``),
so once the pass to ``o_proj`` has recorded its inputs, later passes run the attention as
``o_proj`` on them. With GPTAQ a float copy of the block runs beside it, pass for pass, giving
every group's float inputs in the same step; an expert of a mixture of experts sees only the
tokens its router sends it, and its rows are paired token by token, found by exact row match
(``row_positions``) against the router's input in each model. The algorithms plug in as the
``visit_group`` callback (``gptq.gptq_visit``, ``awq.awq_visit``); this module knows none of them.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from edgekit.compress.families import family_of, hf_model
from edgekit.errors import BadInputError
from edgekit.memory import drop_file_pages, float32_compute
from edgekit.progress import progress_bar

Quantized = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # name -> (q, scales, zeros)
# one batch of a block's inputs: its positional arguments (hidden states first) and keyword arguments
Batch = tuple[tuple[Any, ...], dict[str, Any]]


class ValueProjection(NamedTuple):
    """An attention's value projection, for GPTQ's attention-mixed Hessian (``value_projection``)."""

    name: str  # the projection's path in the model
    attn: nn.Module  # the attention module around it
    rep: int  # query heads per key/value head
    head_dim: int


# --- finding the layers -------------------------------------------------------------------------


def submodule(module: nn.Module, name: str) -> nn.Module:
    """``module``'s submodule ``name`` (the module itself for "")."""
    return module.get_submodule(name) if name else module


def linear_at(module: nn.Module, name: str) -> nn.Linear:
    """The ``nn.Linear`` at ``name`` inside ``module`` (TypeError for anything else)."""
    m = submodule(module, name)
    if not isinstance(m, nn.Linear):
        raise TypeError(f"{name!r} is a {type(m).__name__}, not nn.Linear")
    return m


def replace_module(module: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``name`` is inside ``module``."""
    parent, _, child = name.rpartition(".")
    setattr(submodule(module, parent), child, new)


def find_blocks(module: nn.Module) -> tuple[str, list[nn.Module]]:
    """The repeated blocks to walk: the ``nn.ModuleList`` holding the most linear layers
    (a transformer's layers); else the whole model as one block. Returns (prefix, blocks).
    A list of one is a block list only where the model's config says it has one layer: the
    block-level steps (the value Hessian's attention re-run) need a block's inputs, not the model's."""
    config = getattr(hf_model(module), "config", None)
    shortest = 1 if getattr(config, "num_hidden_layers", None) == 1 else 2
    best, best_n = None, 0
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) >= shortest:
            n = sum(isinstance(x, nn.Linear) for x in m.modules())
            if n > best_n:
                best, best_n = name, n
    if best is None:
        return "", [module]
    found = submodule(module, best)
    if not isinstance(found, nn.ModuleList):  # found among the ModuleLists above
        raise RuntimeError(f"{best} is no longer a ModuleList")
    return best, list(found)


def check_blocks(module: nn.Module, prefix: str, blocks: list[nn.Module]) -> None:
    """The walked blocks must be the model's layers as its config counts them (a Hugging Face model);
    anything else is a structure the walk would only guess at."""
    hf = hf_model(module)
    n = getattr(getattr(hf, "config", None), "num_hidden_layers", None)
    if isinstance(n, int) and prefix and len(blocks) != n:
        raise BadInputError(f"the block walk found {len(blocks)} blocks in {prefix!r}, but the model's config declares "
                            f"{n} layers; edgekit does not know this model's structure")


def head_layers(module: nn.Module) -> tuple[str | None, str | None]:
    """(LM head name, input embedding name) of a Hugging Face causal LM inside ``module``."""
    for _name, m in module.named_modules():
        if hasattr(m, "get_output_embeddings") and hasattr(m, "get_input_embeddings"):
            try:
                out, inp = m.get_output_embeddings(), m.get_input_embeddings()
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(out, nn.Linear):
                names = {id(x): n for n, x in module.named_modules()}
                return names.get(id(out)), names.get(id(inp)) if isinstance(inp, nn.Embedding) else None
    return None, None


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")  # config fields naming the experts
ROUTER_NAMES = ("gate", "router")  # a router's own name, or its wrapper's (JetMoE's router.layer, HunYuan's gate.wg)


def expert_routers(module: nn.Module) -> list[str]:
    """The routers of a mixture-of-experts model: linears named ``gate``/``router`` (or the one linear
    of a module so named) whose outputs are one score per expert (``config.num_local_experts`` and its
    synonyms). They stay in float:
    their few weights decide which experts run, and a 4-bit router changes the routing itself."""
    cfg = getattr(hf_model(module), "config", None)
    counts = {getattr(cfg, k, None) for k in EXPERT_COUNTS} - {None}
    counts = {c for c in counts if isinstance(c, int) and c > 1}
    if not counts:
        return []
    return [n for n, m in module.named_modules()
            if isinstance(m, nn.Linear) and m.out_features in counts
            and (n.rpartition(".")[2] in ROUTER_NAMES or n.rpartition(".")[0].rpartition(".")[2] in ROUTER_NAMES)]


def quantizable_linears(module: nn.Module) -> tuple[str, list[nn.Module], dict[str, nn.Linear]]:
    """(block prefix, blocks, name -> nn.Linear) of the linears inside the blocks, the LM head and
    mixture-of-experts routers (``expert_routers``) left out."""
    prefix, blocks = find_blocks(module)
    head, _ = head_layers(module)
    skip = {head, *expert_routers(module)}
    names = {id(m): n for n, m in module.named_modules()}
    linears: dict[str, nn.Linear] = {}
    for b in blocks:
        for m in b.modules():
            if isinstance(m, nn.Linear) and names[id(m)] not in skip:
                linears[names[id(m)]] = m
    return prefix, blocks, linears



class _Stop(Exception):
    pass


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, as a tensor of its own (a view would keep its larger base alive)."""
    t = t.detach()
    return t.clone() if t._base is not None else t


def _keep(out: Any) -> Any:
    """A module's output as a record: tensors detached and owned, tuples and lists element-wise."""
    if isinstance(out, torch.Tensor):
        return _own(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_keep(o) for o in out)
    return out


def _tensor_elements(out: Any) -> int | None:
    """Elements of the tensors in ``out`` (a tensor, or a tuple of tensors and Nones); None for anything
    else (it cannot be recorded and replayed)."""
    if isinstance(out, torch.Tensor):
        return out.numel()
    if isinstance(out, (tuple, list)):
        parts = [0 if o is None else _tensor_elements(o) for o in out]
        return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)
    return None


class Tail(NamedTuple):
    """A module whose output is the output of one of its walked linears, computed on that linear's
    input (a decoder layer's attention returns ``o_proj``'s output, its MLP ``down_proj``'s)."""

    linear: str  # the linear's path in the block
    group: int  # its group: the input recorded when the walk stops there
    wrap: int  # 0: the output is the linear's output; n: an n-tuple of it and Nones


@dataclass
class BlockPlan:
    """How one block runs, from a forward of the first batch with hooks on every submodule: the walked
    linears grouped by shared input in execution order, and when each submodule started and ended,
    which is what tells a pass what it may replay instead of recomputing. Paths are relative to the
    block, so one plan serves the block and its float copy."""

    groups: list[list[str]]
    group_of: dict[str, int]  # walked linear -> its group
    modules: list[str]  # submodules with a walked linear inside, parents before children
    inside: dict[str, list[str]]  # submodule -> the walked linears inside it
    enter: dict[str, int]  # submodule -> step at which its forward started
    leave: dict[str, int]  # ... and returned
    calls: dict[str, int]
    tails: dict[str, Tail]
    output_elements: dict[str, int]  # recordable direct children -> tensor elements of the output, per sample
    input_elements: list[int]  # per group: elements of its input, per sample
    routed: set[int]  # groups that see the tokens a router sends them (experts)
    linears: list[str]  # every linear of the block, walked or not (routers), in module order

    def first(self, group: int) -> str:
        return self.groups[group][0]

    def stop_step(self, group: int) -> int:
        """The probe step at which group ``group``'s first linear started; for an expert the probe did
        not reach, the step at which its nearest reached ancestor started."""
        name = self.first(group)
        while name:
            if name in self.enter:
                return self.enter[name]
            name = name.rpartition(".")[0]
        return 0


class _Track:
    """One stream of calibration activations through a block: the block being quantized, or (GPTAQ)
    a float copy of it. ``records`` keeps what later passes replay: a group's inputs (a tail linear's
    input) and the outputs of direct children whose linears are final, within ``budget`` bytes."""

    def __init__(self, block: nn.Module, data: list[Batch], budget: int, frozen: bool) -> None:
        self.block, self.data, self.budget = block, data, budget
        self.frozen = frozen  # the float copy: no weight of it ever changes
        self.samples = sum(int(_hidden(b).shape[0]) for b in data)
        self.itemsize = _hidden(data[0]).element_size() if data else 4
        self.inputs: dict[int, list[torch.Tensor]] = {}  # group -> its input, per batch
        self.outputs: dict[str, list[Any]] = {}  # direct child -> its output, per batch
        self.held = 0  # bytes in the records

    def fits(self, elements_per_sample: int) -> bool:
        return self.held + elements_per_sample * self.samples * self.itemsize <= self.budget


class BlockWalker:
    """Runs the calibration set through the model one block at a time.

    ``walk(visit_group)`` calls ``visit_group(block_index, names, inputs)`` for each group of
    linears sharing one input, in execution order; ``inputs`` (a ``GroupInputs``) is an
    iterator factory yielding that group's input activations batch by batch (computed on
    demand through the block's already-quantized layers). ``visit_group`` quantizes the group in
    place (float weights on the quantized grid) before the walk moves on.

    A pass to a group does not recompute what it can replay: the walk records a group's inputs
    when a submodule returns the output of that group's linear (a decoder layer's attention
    returns ``o_proj(x)``, its MLP ``down_proj(x)``), so a later pass replays the attention as
    ``o_proj`` on the recorded inputs instead of re-running q/k/v and the attention; and the
    outputs of the block's direct children whose linears are all final. Replays give the same
    tensors a recomputation would (the same layers on the same inputs), so the result does not
    depend on them; what is recorded stays within ``reuse_factor`` times the block inputs' size
    per track (beyond that, passes recompute). ``reuse_factor=0`` turns replay off: a visit that
    changes layers outside its own group (AWQ folds its scales into the layer before) needs that.
    """

    def __init__(self, module: nn.Module, calib: list[torch.Tensor], device: str = "cpu",
                 batch_size: int = 8, progress: bool = True, track_float: bool = False,
                 reuse_factor: float = 4.0, float_samples: int | None = None) -> None:
        self.module = module
        self.calib = calib
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.progress = progress
        # also carry the float model's activations: a float copy of each block runs beside it, pass for
        # pass, so GroupInputs.paired() gives each group's inputs in both models
        self.track_float = track_float
        self.float_samples = float_samples  # the first samples only (whole batches); None: all
        self.reuse_factor = reuse_factor
        self.prefix, self.blocks = find_blocks(module)
        self.names = {id(m): n for n, m in module.named_modules()}
        self.linears: dict[str, nn.Linear] = {}
        self._routers = expert_routers(module)

    def _capture_block0(self) -> list[Batch]:
        if not self.prefix:  # the whole model is the block: its inputs are the samples
            n = self.calib[0].shape[0]
            return [(tuple(t[i:i + self.batch_size].to(self.device) for t in self.calib), {})
                    for i in range(0, n, self.batch_size)]
        captured: list[Batch] = []

        def grab(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            kw = dict(kwargs)
            for cache in ("past_key_values", "past_key_value", "layer_past"):  # GPT-NeoX: layer_past
                if cache in kw:
                    kw[cache] = None
            if "use_cache" in kw:
                kw["use_cache"] = False
            # a KV cache passed positionally (GPT-2's blocks take it as their 2nd argument): none
            args = tuple(None if hasattr(a, "get_seq_length") else a for a in args)
            captured.append((tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), kw))
            raise _Stop

        h = self.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            n = self.calib[0].shape[0]
            for i in range(0, n, self.batch_size):
                try:
                    self.module(*[t[i:i + self.batch_size].to(self.device) for t in self.calib])
                except _Stop:
                    pass
        finally:
            h.remove()
        return captured

    def _structure(self, block: nn.Module) -> tuple[Any, ...]:
        """What a block's plan depends on besides its data: its submodules' paths and classes, and its
        walked linears' paths and shapes. Blocks alike in these run their forwards alike."""
        return tuple((n, type(m).__name__, tuple(m.weight.shape) if isinstance(m, nn.Linear) else None,
                      isinstance(m, nn.Linear) and self.names.get(id(m)) in self.linears)
                     for n, m in block.named_modules())

    def _plan_for(self, block: nn.Module, batch: Batch, plans: dict[tuple[Any, ...], BlockPlan]) -> BlockPlan:
        """``_plan``, probed once for all the blocks of one structure (a decoder's 30 alike layers: one
        probe forward, not 30). A plan with routed groups is not shared: which experts its probe
        reached depends on the block's router and data."""
        key = self._structure(block)
        plan = plans.get(key)
        if plan is None:
            plan = self._plan(block, batch)
            if not plan.routed:
                plans[key] = plan
        return plan

    def _plan(self, block: nn.Module, batch: Batch) -> BlockPlan:
        """Probe ``block`` on ``batch`` (the first): groups, order of the submodules, tails, routed groups."""
        rel = {id(m): n for n, m in block.named_modules() if n}
        walked = [n for n, m in block.named_modules() if n and isinstance(m, nn.Linear)
                  and self.names.get(id(m)) in self.linears]
        step = [0]
        enter: dict[str, int] = {}
        leave: dict[str, int] = {}
        calls: dict[str, int] = {}
        outputs: dict[str, Any] = {}
        order: list[tuple[str, torch.Tensor]] = []
        hooks: list[RemovableHandle] = []

        def pre(m: nn.Module, args: tuple[Any, ...]) -> None:
            name = rel[id(m)]
            step[0] += 1
            enter.setdefault(name, step[0])
            calls[name] = calls.get(name, 0) + 1
            if name in walked and args and isinstance(args[0], torch.Tensor):
                order.append((name, args[0]))

        def post(m: nn.Module, _args: tuple[Any, ...], out: Any) -> None:
            name = rel[id(m)]
            step[0] += 1
            leave[name] = step[0]
            outputs[name] = out

        for name, m in block.named_modules():
            if name:
                hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        try:
            # the whole first batch, as captured: slicing to one sample would have to know every block's
            # own state arguments (RWKV, recurrent Gemma, XLNet), and more samples reach more experts
            args, kw = batch
            block(*args, **kw)
        finally:
            for h in hooks:
                h.remove()
        groups: list[list[str]] = []
        last: torch.Tensor | None = None
        for name, x in order:  # tensors kept alive here, so identity is reliable
            if any(name in g for g in groups):
                continue
            if groups and x is last:
                groups[-1].append(name)
            else:
                groups.append([name])
            last = x
        # experts the probe batch was not routed to: one group each, in module order (their inputs
        # come from whatever calibration tokens the router sends them, possibly none)
        seen = {n for g in groups for n in g}
        groups += [[n] for n in walked if n not in seen]
        group_of = {n: i for i, g in enumerate(groups) for n in g}
        inside = {n: [lin for lin in group_of if lin == n or lin.startswith(n + ".")]
                  for n, _m in block.named_modules() if n}
        modules = [n for n, _m in block.named_modules() if n and inside[n]]
        tails: dict[str, Tail] = {}
        for n in modules:
            out = outputs.get(n)
            for lin in inside[n]:
                if lin == n or lin not in outputs:
                    continue
                if out is outputs[lin]:
                    tails[n] = Tail(lin, group_of[lin], 0)
                elif isinstance(out, tuple) and out and out[0] is outputs[lin] and all(o is None for o in out[1:]):
                    tails[n] = Tail(lin, group_of[lin], len(out))
        per = max(1, int(_hidden(batch).shape[0]))  # samples in the probe batch
        output_elements = {n: e // per for n in modules if "." not in n
                           and (e := _tensor_elements(outputs.get(n))) is not None}
        firsts = {g[0]: i for i, g in enumerate(groups)}
        input_elements = [0] * len(groups)
        tokens = _hidden(batch).shape[:-1].numel()
        reached: dict[str, torch.Size] = {}
        for name, x in order:
            reached.setdefault(name, x.shape)
            if name in firsts:
                input_elements[firsts[name]] = x.numel() // per
        # groups that see a subset of the tokens (mixture-of-experts experts): linears of the blocks
        # of a ModuleList beside a router, or whose probe input is not one row per token (so too where
        # the router is no nn.Linear: GLM-4 MoE's gate is a bare weight)
        routers = {self.names.get(id(m)) for m in block.modules()} & set(self._routers)
        lists = {n for n, m in block.named_modules() if isinstance(m, nn.ModuleList)}
        routed = {i for i, g in enumerate(groups)
                  if (g[0] in reached and reached[g[0]][:-1].numel() != tokens)
                  or (routers and (g[0].rpartition(".")[0].rpartition(".")[0] in lists or g[0] not in reached))}
        linears = [n for n, m in block.named_modules() if n and isinstance(m, nn.Linear)]
        return BlockPlan(groups, group_of, modules, inside, enter, leave, calls, tails, output_elements,
                         input_elements, routed, linears)

    @torch.no_grad()
    def walk(self, linears: dict[str, nn.Linear], visit_group: GroupVisit,
             after_block: Callable[[list[str]], None] | None = None) -> None:
        """Visit every group of ``linears``; ``after_block(names)`` once a block's linears are final.
        A model stored in half precision computes in float32: the layers before the first block one
        at a time (``float32_compute``), each block cast up as the walk reaches it."""
        self.linears = linears
        with float32_compute(self.module):
            data = self._capture_block0()
        data = [(tuple(_upcast_half_tensor(a) for a in args), {k: _upcast_half_tensor(v) for k, v in kw.items()})
                for args, kw in data]
        data_fp: list[Batch] | None = data if self.track_float else None  # the blocks before the first are not quantized
        if data_fp is not None and self.float_samples is not None:
            data_fp = data_fp[:max(1, -(-self.float_samples // self.batch_size))]
        plans: dict[tuple[Any, ...], BlockPlan] = {}  # a probe's plan for every block built the same way
        for bi in progress_bar(range(len(self.blocks)), "quantize blocks", enabled=self.progress):
            block = self.blocks[bi]
            upcast_half(block)
            if not any(isinstance(m, nn.Linear) and self.names[id(m)] in linears for m in block.modules()):
                if data_fp is not None:
                    data_fp = [_with_hidden(b, self._run(block, b)) for b in data_fp]
                data = [_with_hidden(b, self._run(block, b)) for b in data]
                continue
            plan = self._plan_for(block, data[0], plans)
            # the float copy is taken before any group of the block changes
            tracks = [_Track(block, data, self._budget(data), frozen=False)]
            if data_fp is not None:
                tracks.append(_Track(copy.deepcopy(block), data_fp, self._budget(data_fp), frozen=True))
            prefix = self.names[id(block)]
            for gi, rel_names in enumerate(plan.groups):
                names = [f"{prefix}.{n}" if prefix else n for n in rel_names]
                visit_group(bi, names, GroupInputs(self, plan, gi, tracks[0], tracks[1] if len(tracks) > 1 else None))
            outs = [[_with_hidden(b, y) for y, b in zip(self._pass(t, plan, None), t.data, strict=True)]
                    for t in tracks]
            data = outs[0]
            if data_fp is not None:
                data_fp = outs[1]
            del tracks, outs
            if after_block is not None:
                after_block([n for g in plan.groups for n in (f"{prefix}.{r}" if prefix else r for r in g)])

    @torch.no_grad()
    def groups(self, linears: dict[str, nn.Linear]) -> list[list[str]]:
        """The walk's groups of ``linears`` in every block (model paths), from the probe of each
        block on the first calibration batch, without quantizing anything."""
        self.linears = linears
        batch = self._capture_block0()[0]
        out: list[list[str]] = []
        for block in self.blocks:
            prefix = self.names[id(block)]
            if any(isinstance(m, nn.Linear) and self.names[id(m)] in linears for m in block.modules()):
                out += [[f"{prefix}.{n}" if prefix else n for n in g] for g in self._plan(block, batch).groups]
            batch = _with_hidden(batch, self._run(block, batch))
        return out

    def _budget(self, data: list[Batch]) -> int:
        return int(self.reuse_factor * sum(_hidden(b).numel() * _hidden(b).element_size() for b in data))

    def _run(self, block: nn.Module, batch: Batch) -> torch.Tensor:
        args, kw = batch
        return _first(block(*args, **kw)).detach()

    def _pass(self, track: _Track, plan: BlockPlan, target: int | None) -> Iterator[torch.Tensor]:
        """Per batch of ``track``: the input of group ``target`` (the block stops at its first linear),
        or the block's output (``target`` None), replaying what the records allow; batches that do
        not reach ``target`` (tokens the router sent elsewhere) are left out."""
        return (x for x in self._steps(track, plan, target) if x is not None)

    def _steps(self, track: _Track, plan: BlockPlan, target: int | None,
               watch: dict[str, torch.Tensor] | None = None) -> Iterator[torch.Tensor | None]:
        """``_pass`` with one item per batch: None for a batch that does not reach ``target``. With
        ``watch``, each batch first clears it, then fills it with the input of every linear of the
        block the forward reaches (by path in the block; what runs is not replayed)."""
        groups = len(plan.groups)
        upto = groups if target is None else target
        stop_at = None if target is None else plan.stop_step(target)

        def eligible(name: str) -> bool:
            return (plan.calls.get(name) == 1 and name in plan.leave
                    and (stop_at is None or plan.leave[name] < stop_at)
                    and (track.frozen or all(plan.group_of[lin] < upto for lin in plan.inside[name])))

        replay: list[tuple[str, str]] = []  # (submodule, "output" | "tail")
        record: list[str] = []
        planned = 0
        covered: list[str] = []
        for name in plan.modules:
            if any(name.startswith(c + ".") for c in covered) or not eligible(name):
                continue
            tail = plan.tails.get(name)
            if name in track.outputs:
                replay.append((name, "output"))
                covered.append(name)
            elif tail is not None and tail.group in track.inputs:
                replay.append((name, "tail"))
                covered.append(name)
            # record a direct child's output for the passes after this one (a tail replay's too: its
            # output then replaces the linear's recorded inputs, with nothing left to compute)
            if (target is not None and name not in track.outputs and name in plan.output_elements
                    and (tail is None or tail.group in track.inputs) and self.reuse_factor > 0
                    and track.fits(planned + plan.output_elements[name])):
                record.append(name)
                planned += plan.output_elements[name]
        keep_input = (target is not None and self.reuse_factor > 0 and target not in track.inputs
                      and any(t.group == target for t in plan.tails.values())
                      and track.fits(planned + plan.input_elements[target]))
        new_inputs: list[torch.Tensor] = []
        new_outputs: dict[str, list[Any]] = {n: [] for n in record}
        current = [0]

        def replay_output(name: str) -> Callable[..., Any]:
            return lambda *_a, **_k: track.outputs[name][current[0]]

        def replay_tail(tail: Tail) -> Callable[..., Any]:
            lin = track.block.get_submodule(tail.linear)

            def run(*_a: Any, **_k: Any) -> Any:
                y = lin(track.inputs[tail.group][current[0]])
                return y if tail.wrap == 0 else (y,) + (None,) * (tail.wrap - 1)
            return run

        box: list[torch.Tensor] = []

        def stop(_m: nn.Module, args: tuple[Any, ...]) -> None:
            box.append(_own(args[0]))
            raise _Stop

        for i, (args, kw) in enumerate(track.data):
            current[0] = i
            box.clear()
            patched: list[nn.Module] = []
            hooks: list[RemovableHandle] = []
            try:
                for name, how in replay:
                    m = track.block.get_submodule(name)
                    m.forward = replay_output(name) if how == "output" else replay_tail(plan.tails[name])
                    patched.append(m)
                for name in record:
                    hooks.append(track.block.get_submodule(name).register_forward_hook(
                        lambda _m, _a, out, name=name: new_outputs[name].append(_keep(out))))
                if watch is not None:
                    watch.clear()
                    for name in plan.linears:
                        hooks.append(track.block.get_submodule(name).register_forward_pre_hook(
                            lambda _m, a, name=name: watch.setdefault(name, a[0].detach())))
                if target is not None:
                    hooks.append(track.block.get_submodule(plan.first(target)).register_forward_pre_hook(stop))
                try:
                    out = track.block(*args, **kw)
                except _Stop:
                    out = None
            finally:
                for m in patched:
                    del m.forward
                for h in hooks:
                    h.remove()
            if target is None:
                yield _first(out).detach()
            elif box:
                if keep_input:
                    new_inputs.append(box[0])
                yield box[0]
            else:
                yield None
        # a pass run to its end: its records are complete
        for name, outs in new_outputs.items():
            track.outputs[name] = outs
            track.held += sum(_tensor_elements(o) or 0 for o in outs) * track.itemsize
        if keep_input and len(new_inputs) == len(track.data):
            track.inputs[target] = new_inputs  # type: ignore[index]
            track.held += sum(x.numel() for x in new_inputs) * track.itemsize
        for group in list(track.inputs):  # inputs whose every user is now replayed from its output
            if all(m in track.outputs for m, t in plan.tails.items() if t.group == group):
                track.held -= sum(x.numel() for x in track.inputs.pop(group)) * track.itemsize


GroupVisit = Callable[[int, list[str], "GroupInputs"], None]  # (block index, linear names, their inputs)


class GroupInputs:
    """The inputs of one group of linears, computed on demand from the block's inputs.

    ``inputs()`` yields the group's input activations batch by batch (the block's forward
    stops right at the group's first layer). ``paired()`` yields ``(x, x_float)``: the same
    inputs in the float model (a walker with ``track_float``), computed in the same step.
    ``attention_mixed(attn, v_proj)`` yields, per batch, the attention probabilities ``P``
    (batch, heads, queries, keys) of ``attn`` and the inputs ``X`` (batch, keys, features) of
    its value projection: a value projection's output only matters through ``P @ (X Wᵀ)``, so
    its GPTQ objective uses ``P X``.
    """

    def __init__(self, walker: BlockWalker, plan: BlockPlan, group: int, track: _Track,
                 float_track: _Track | None = None) -> None:
        self.walker, self.plan, self.group = walker, plan, group
        self.track, self.float_track = track, float_track
        self.block, self.data = track.block, track.data
        self.paired_rows = self.float_rows = 0  # routed groups: rows seen, rows with a float counterpart

    def __call__(self) -> Iterator[torch.Tensor]:
        return self.walker._pass(self.track, self.plan, self.group)

    @property
    def routed(self) -> bool:
        """Whether the group sees a subset of the block's tokens (a mixture-of-experts expert)."""
        return self.group in self.plan.routed

    def paired(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(x, x_float)`` per batch: the group's input here and in the unquantized model (needs a
        walker with ``track_float``); ``x_float`` is None for the batches beyond the float model's
        (``float_samples``). For a routed group (an expert) the rows are the tokens the router sends
        it *here*; each is paired with the same token's input in the float model where the float
        model has one (the float router may have chosen other tokens), else with itself (the plain
        GPTQ objective for that token)."""
        if self.float_track is None:
            raise RuntimeError("paired inputs need BlockWalker(track_float=True)")
        if self.routed:
            return self._paired_by_token(self.float_track)
        return self._paired_by_position(self.float_track)

    def _paired_by_position(self, float_track: _Track) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        floats = self.walker._pass(float_track, self.plan, self.group)
        carried = len(float_track.data)
        for i, x in enumerate(self()):
            yield x, next(floats) if i < carried else None
        for _ in floats:  # run the float pass to its end, which completes its records
            pass

    def _tokens(self, seen: dict[str, torch.Tensor], tokens: int) -> torch.Tensor | None:
        """Token positions (among a batch's ``tokens`` flattened tokens) of this expert's rows, from the
        linear inputs ``seen`` in one forward (the float model's or this one's): the expert's entry
        layer's rows are exact copies of rows of a full-token layer's input (the router's), found by
        match."""
        first = self.plan.first(self.group)
        rows = seen.get(first)
        if rows is None:
            return None
        n = rows.reshape(-1, rows.shape[-1]).shape[0]
        parent = first.rpartition(".")[0]
        expert = [first] + [m for m in self.plan.linears if m != first and m.rpartition(".")[0] == parent]
        for entry in expert:
            x = seen.get(entry)
            if x is None or x.reshape(-1, x.shape[-1]).shape[0] != n:
                continue
            x = x.reshape(-1, x.shape[-1])
            for layer in self.plan.linears:
                table = seen.get(layer)
                if layer in expert or table is None or table.shape[-1] != x.shape[-1] \
                        or table.shape[:-1].numel() != tokens:  # one row per token
                    continue
                idx = row_positions(x, table.reshape(-1, table.shape[-1]))
                if idx is not None:
                    return idx
        return None

    def _paired_by_token(self, float_track: _Track) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        seen: dict[str, torch.Tensor] = {}
        float_seen: dict[str, torch.Tensor] = {}
        floats = self.walker._steps(float_track, self.plan, self.group, float_seen)
        carried = len(float_track.data)
        for b, x in enumerate(self.walker._steps(self.track, self.plan, self.group, seen)):
            fp = next(floats) if b < carried else None
            if x is None:  # the router sent this expert no token of this batch
                continue
            x = x.reshape(-1, x.shape[-1])
            self.paired_rows += x.shape[0]
            if b >= carried:  # beyond the windows the float model runs for
                yield x, None
                continue
            x_fp = x.clone()
            if fp is not None:
                tokens = _hidden(self.data[b]).shape[:-1].numel()
                here, there = self._tokens(seen, tokens), self._tokens(float_seen, tokens)
                if here is not None and there is not None:
                    fp = fp.reshape(-1, x.shape[-1])
                    where = torch.full((tokens,), -1, dtype=torch.long, device=x.device)
                    where[there] = torch.arange(there.shape[0], device=x.device)
                    match = where[here]
                    hit = match >= 0
                    x_fp[hit] = fp[match[hit]]
                    self.float_rows += int(hit.sum())
            yield x, x_fp
        for _ in floats:  # run the float pass to its end, which completes its records
            pass

    def attention_mixed(self, attn: nn.Module, v_proj: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(P, X) per batch, with the attention run eagerly (the probabilities are its 2nd output)."""
        config: Any = attn.config  # a transformers PretrainedConfig
        saved = config._attn_implementation
        xs: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []

        def grab_x(_m: nn.Module, args: tuple[Any, ...]) -> None:
            xs.append(args[0].detach())

        def grab_p(_m: nn.Module, _args: tuple[Any, ...], out: Any) -> None:
            probs.append(out[1].detach())
            raise _Stop

        hooks = [v_proj.register_forward_pre_hook(grab_x), attn.register_forward_hook(grab_p)]
        config._attn_implementation = "eager"
        try:
            for args, kw in self.data:
                xs.clear()
                probs.clear()
                kw = dict(kw)
                if kw.get("attention_mask") is None:  # sdpa ran causal without a mask; eager needs one
                    n = args[0].shape[1]
                    causal = torch.full((n, n), torch.finfo(args[0].dtype).min, device=args[0].device).triu(1)
                    kw["attention_mask"] = causal[None, None].expand(args[0].shape[0], 1, n, n)
                try:
                    self.block(*args, **kw)
                except _Stop:
                    pass
                if probs and probs[0] is not None and xs:
                    yield probs[0], xs[0]
        finally:
            config._attn_implementation = saved
            for h in hooks:
                h.remove()


def value_projection(module: nn.Module, names: list[str]) -> ValueProjection | None:
    """(name, attention module, heads per key/value head, head dim) of the value projection
    among ``names``, for the families whose description names one (``families.py``: Llama,
    Gemma, ...: ``v_proj`` inside a module with ``head_dim``, ``num_key_value_groups`` and a
    config); None otherwise."""
    value = family_of(module).value_proj
    if value is None:
        return None
    for name in names:
        parent_name, _, child = name.rpartition(".")
        if not name.endswith("." + value) and name != value:
            continue
        attn = submodule(module, parent_name)
        groups, head_dim = getattr(attn, "num_key_value_groups", None), getattr(attn, "head_dim", None)
        if isinstance(groups, int) and isinstance(head_dim, int) and \
                hasattr(getattr(attn, "config", None), "_attn_implementation"):
            return ValueProjection(name, attn, groups, head_dim)
    return None


def _hidden(batch: Batch) -> torch.Tensor:
    """The hidden states of a block's batch: its first positional argument, else its
    ``hidden_states`` keyword (blocks called with keywords only)."""
    args, kw = batch
    x = args[0] if args else kw.get("hidden_states")
    if not isinstance(x, torch.Tensor):
        raise BadInputError("the block walk cannot find the hidden states among the block's arguments")
    return x


def _with_hidden(batch: Batch, hidden: torch.Tensor) -> Batch:
    """``batch`` with ``hidden`` as its hidden states, where the block takes them (see ``_hidden``)."""
    args, kw = batch
    if args:
        return (hidden,) + tuple(args[1:]), kw
    return args, {**kw, "hidden_states": hidden}


def row_positions(rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """For each row of ``rows`` (n, d), the index of an identical row of ``table`` (N, d) (exact
    equality: a gathered copy); None when some row is not in ``table``."""
    both = torch.cat([table, rows])
    _, inverse = torch.unique(both, dim=0, return_inverse=True)
    where = torch.full((int(inverse.max()) + 1,), -1, dtype=torch.long, device=rows.device)
    where[inverse[:table.shape[0]]] = torch.arange(table.shape[0], device=rows.device)
    idx = where[inverse[table.shape[0]:]]
    return None if bool((idx < 0).any()) else idx


def upcast_half(module: nn.Module) -> None:
    """Cast the bfloat16/float16 parameters and buffers of ``module`` to float32, in place (a block of
    a model stored in half precision, as the walk reaches it). The half-precision originals' pages
    in a memory-mapped file go back to the kernel (``drop_file_pages``): the model no longer reads them."""
    replaced = []
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if p.dtype in (torch.bfloat16, torch.float16):
                replaced.append(p.data)
                p.data = p.data.float()
        for name, b in m.named_buffers(recurse=False):
            if b is not None and b.dtype in (torch.bfloat16, torch.float16):
                replaced.append(b)
                m._buffers[name] = b.float()
    drop_file_pages(replaced)


def _upcast_half_tensor(a: Any) -> Any:
    return a.float() if isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) else a


__all__ = ["EXPERT_COUNTS", "expert_routers", "row_positions", "Batch", "BlockPlan", "BlockWalker", "upcast_half", "GroupInputs", "GroupVisit", "Quantized", "ValueProjection", "check_blocks",
           "find_blocks", "head_layers", "linear_at", "quantizable_linears", "replace_module", "submodule",
           "value_projection"]
