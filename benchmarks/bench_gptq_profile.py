"""Benchmark: where the CPU time of GPTQ's weight-only step goes, on a reduced run of SmolLM2-135M (the
first ``--blocks`` blocks, ``--windows`` calibration windows of 512 tokens), and what it extrapolates
to for the default run (30 blocks, 128 windows).

Each phase of the step is timed by wrapping its function (``time.process_time``: CPU time of the
process, all threads); a phase's time is *exclusive*: what a wrapped function calls that is itself
wrapped counts in its own phase. Phases: block 0's inputs (the embedding), the probe forward of
each block, the forward passes of the block being quantized and of GPTAQ's float copy, the
Hessian products ``X^T X`` (of the group inputs, and of the value projection's attention-mixed
inputs), GPTAQ's cross term ``dX^T X``, the value Hessian's attention re-run (eager, for the
probabilities) and its ``P X`` products, GPTAQ's target solve, the GPTQ column solve, the group
grid search, the scale refit, setting the dequantized weights, and packing.

    python benchmarks/bench_gptq_profile.py --windows 16 --blocks 4
    python benchmarks/bench_gptq_profile.py --windows 16 --blocks 4 --set value_query_stride=4
    python benchmarks/bench_gptq_profile.py --windows 16 --blocks 4 --solve-threads all   # the solve on every thread

With ``--check-windows N`` (default 8) the reduced model is also scored: the relative error of its last
hidden states (after the ``--blocks`` blocks and the final norm) against the float model's on the first N
512-token windows of the Wikipedia *calib* split (a validation text: GPTQ calibrates on Lee news and the
reported perplexities use the Wikipedia eval split). ``--calib-skip K`` calibrates on Lee-news windows
K..K+windows instead of the first ones: the spread over calibration windows is the noise a change of
the result is compared with. Perplexity needs the whole model: this error is a proxy, said as such.

Results: benchmarks/results/gptq_profile/<label>.json and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
PARTS = ROOT / "benchmarks" / "results" / "gptq_profile"


class PhaseClock:
    """Exclusive CPU time per phase over nested wrapped calls (generators timed per ``next``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list[Any]] = []  # [phase, start, time of nested phases]

    def _enter(self, phase: str) -> None:
        self.stack.append([phase, time.process_time(), 0.0])

    def _leave(self) -> None:
        phase, start, nested = self.stack.pop()
        spent = time.process_time() - start
        self.seconds[phase] += spent - nested
        if self.stack:
            self.stack[-1][2] += spent

    def wrap(self, owner: Any, attr: str, phase: str | Callable[..., str], generator: bool = False) -> None:
        original = getattr(owner, attr)
        clock = self

        def name(args: tuple[Any, ...]) -> str:
            return phase(*args) if callable(phase) else phase

        if generator:
            def gen(*args: Any, **kw: Any) -> Iterator[Any]:
                label = name(args)
                clock.calls[label] += 1
                it = original(*args, **kw)
                while True:
                    clock._enter(label)
                    try:
                        item = next(it)
                    except StopIteration:
                        return
                    finally:
                        clock._leave()
                    yield item
            setattr(owner, attr, gen)
        else:
            def fn(*args: Any, **kw: Any) -> Any:
                label = name(args)
                clock.calls[label] += 1
                clock._enter(label)
                try:
                    return original(*args, **kw)
                finally:
                    clock._leave()
            setattr(owner, attr, fn)


def instrument(clock: PhaseClock) -> None:
    from edgekit.compress.weight_only import blocks, gptq, rtn
    from edgekit.compress.weight_only import step as weight_only

    clock.wrap(blocks.BlockWalker, "_capture_block0", "block 0 inputs (embedding)")
    clock.wrap(blocks.BlockWalker, "_plan", "probe forward (first batch)")
    clock.wrap(blocks.BlockWalker, "_steps", lambda _self, track, *a: "forward, float copy (GPTAQ)" if track.frozen
               else "forward, quantized block", generator=True)
    clock.wrap(blocks.GroupInputs, "attention_mixed", "value Hessian: attention re-run", generator=True)
    clock.wrap(gptq, "add_attention_mixed", "value Hessian: P X products")
    clock.wrap(gptq.HessianAccumulator, "add_batch",
               lambda *a: "value Hessian: (P X)^T (P X)" if any(f[0] == "value Hessian: P X products" for f in clock.stack)
               else "Hessian X^T X")
    clock.wrap(gptq.AsymmetricAccumulator, "add_pair", "GPTAQ cross term dX^T X")
    clock.wrap(gptq, "asymmetric_target", "GPTAQ target (Cholesky solve)")
    clock.wrap(gptq, "gptq_solve_fixed", "GPTQ column solve")
    clock.wrap(gptq, "mse_qparams", "group grid search (mse_grid)")
    clock.wrap(gptq, "refit_scales", "scale refit")
    clock.wrap(gptq, "dequantize_groups", "set dequantized weights")
    clock.wrap(weight_only, "pack_layers", "packing (+ parity probe)")
    _ = rtn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="WeightOnlyConfig field=value (repeatable)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--solve-threads", choices=("one", "all"), default="one",
                    help="one: the step's own (solves on one thread); all: solves on every torch thread (before)")
    ap.add_argument("--calib-skip", type=int, default=0)
    ap.add_argument("--check-windows", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from machine_info import machine

    from edgekit.compress import StepContext
    from edgekit.compress.families import hf_model
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import apply
    from edgekit.sources.models import load_model

    torch.set_num_threads(args.threads)
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value) if value not in ("None",) else None
    config = WeightOnlyConfig(**{"eval_windows": 0, "calib_samples": args.windows, **overrides})
    handle = load_model("smollm2-135m")
    hf = hf_model(handle.module)
    total_blocks = len(hf.model.layers)
    hf.model.layers = torch.nn.ModuleList(list(hf.model.layers)[:args.blocks])
    hf.config.num_hidden_layers = args.blocks
    import contextlib
    import copy

    from edgekit.compress.weight_only import gptq
    from edgekit.compress.weight_only import step as weight_only
    from edgekit.sources.data import load_samples

    if args.solve_threads == "all":
        gptq.one_thread = contextlib.nullcontext  # type: ignore[assignment]
    if args.calib_skip:
        real_calib = weight_only.calibration_inputs

        def skipped(h: Any, cfg: Any, ctx: Any) -> list[Any]:
            from dataclasses import replace
            return [t[args.calib_skip:] for t in real_calib(h, replace(cfg, calib_samples=cfg.calib_samples + args.calib_skip), ctx)]
        weight_only.calibration_inputs = skipped  # type: ignore[assignment]
    float_model = copy.deepcopy(hf) if args.check_windows else None
    clock = PhaseClock()
    instrument(clock)
    load0 = os.getloadavg()
    w0, c0 = time.perf_counter(), time.process_time()
    apply(handle, config, StepContext(progress=False))
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    check = None
    if float_model is not None:
        ids = torch.from_numpy(load_samples("wikipedia", handle, split="calib", seqlen=512).inputs["input_ids"][:args.check_windows])
        with torch.no_grad():
            num = den = 0.0
            for i in range(ids.shape[0]):
                want = float_model.model(ids[i:i + 1]).last_hidden_state
                got = hf.model(ids[i:i + 1]).last_hidden_state
                num += float((got - want).pow(2).sum())
                den += float(want.pow(2).sum())
        check = round((num / den) ** 0.5, 5)
    phases = dict(sorted(clock.seconds.items(), key=lambda kv: -kv[1]))
    phases["other (calibration tokenizing, LM head, glue)"] = cpu - sum(phases.values())
    # phases that grow with the windows (forward passes, products) scale by both; the solves by blocks only
    per_block = {"probe forward (first batch)", "GPTAQ target (Cholesky solve)", "GPTQ column solve",
                 "group grid search (mse_grid)", "scale refit", "set dequantized weights", "packing (+ parity probe)"}
    by_windows, by_blocks = 128 / args.windows, total_blocks / args.blocks
    extrapolated = sum(v * by_blocks * (1 if k in per_block else by_windows) for k, v in phases.items()
                       if not k.startswith(("other", "block 0"))) \
        + sum(v * by_windows for k, v in phases.items() if k.startswith(("other", "block 0")))
    label = args.label or ("default" if not overrides else ",".join(f"{k}={v}" for k, v in overrides.items()))
    label += f"-t{args.threads}" + ("-solve-all-threads" if args.solve_threads == "all" else "") + \
        (f"-skip{args.calib_skip}" if args.calib_skip else "")
    out = {"label": label, "config": overrides, "windows": args.windows, "blocks": args.blocks,
           "threads": torch.get_num_threads(), "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
           "phases_cpu_s": {k: round(v, 2) for k, v in phases.items()},
           "extrapolated_cpu_s_128x30": round(extrapolated), "solve_threads": args.solve_threads,
           "calib_skip": args.calib_skip, "hidden_rel_error_wikipedia_calib": check, "check_windows": args.check_windows,
           "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()],
           "machine": machine(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    PARTS.mkdir(parents=True, exist_ok=True)
    (PARTS / f"{label.replace('=', '-').replace(',', '_')}-w{args.windows}-b{args.blocks}.json").write_text(
        json.dumps(out, indent=1))
    print(f"| phase ({label}, {args.windows} windows x {args.blocks} blocks) | CPU s | share |")
    print("|---|---|---|")
    for k, v in phases.items():
        print(f"| {k} | {v:.1f} | {100 * v / cpu:.0f}% |")
    print(f"| **total** | **{cpu:.1f}** (wall {wall:.1f}, load {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}) | |")
    if check is not None:
        print(f"relative error of the last hidden states on {args.check_windows} Wikipedia calib-split windows: {check}")
    print(f"extrapolated to 128 windows x {total_blocks} blocks (solves per block, the rest per window and block): "
          f"{out['extrapolated_cpu_s_128x30']:.0f} CPU s")


if __name__ == "__main__":
    main()
