"""The decoder conformance matrix generated from the installed transformers (issue 31).

Rows: every model type transformers maps to a ``*ForCausalLM`` class whose config can be made tiny
(``tests/tiny_models.py``: hidden 64, 2 layers, vocabulary 260, seeded random weights, built
offline). Columns (steps), each checked against the float model on the same token windows:

* ``float``: the model runs and gives finite logits over the vocabulary;
* ``rtn-4`` / ``gptq-4``: 4-bit weight-only (group 32; GPTQ with its defaults, GPTAQ included), the
  relative logit error ``||y - y_float|| / ||y_float||`` under ``W4_REL``;
* ``export-kv``: the model saved as a Hugging Face folder, loaded by edgekit's loader and exported
  with the KV cache (the export checks its own parity against PyTorch).

Each cell is ``pass`` (with the error), ``refused`` (an edgekit error of one line: what is missing),
``fail`` (a bound missed), ``over time`` (past ``CELL_SECONDS``) or ``traceback`` (any other
exception: a bug). Inputs are seeded random token windows: the weights are random too.

    python benchmarks/bench_decoder_matrix.py [--types llama,mixtral] [--steps float,rtn-4] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import byte_tokenizer, causal_lm_types, tiny_causal_lm  # noqa: E402

STEPS = ("float", "rtn-4", "gptq-4", "export-kv")
W4_REL = 0.30  # as the hand-written matrix (tests/test_conformance.py)
CELL_SECONDS = 60  # a cell past this is "over time": the matrix has no unbounded cell


class _OverTime(Exception):
    pass


def _windows(seed: int = 0, n: int = 4) -> torch.Tensor:
    return torch.randint(0, 256, (n, 32), generator=torch.Generator().manual_seed(seed))


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def run_cell(model_type: str, step: str, model: Any, want: torch.Tensor, tmp: Path) -> dict[str, Any]:
    """One cell: ``{"status": pass|refused|fail|traceback, "detail": ..., "rel": ...}``."""
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import quantize_module
    from edgekit.errors import CheckFailedError, EdgekitError

    ids = _windows()
    try:
        if step == "float":
            ok = want.shape[-1] >= 256 and bool(torch.isfinite(want).all()) and float(want.std()) > 0
            return {"status": "pass" if ok else "fail", "detail": f"logits {tuple(want.shape)}"}
        if step in ("rtn-4", "gptq-4"):
            m = copy.deepcopy(model)
            method = {"gptq": "gptq-plus"}.get(step.split("-")[0], "rtn")  # the "gptq-4" cell: the default GPTQ
            # 16 windows: with 4 calibration windows a top-2 of 4 experts sees ~64 tokens per expert for
            # 64 input features, and GPTQ's Hessians are thin (tiny Mixtral: 0.31 at 4, 0.25 at 16)
            config = WeightOnlyConfig(method=method, bits=4, group_size=32, calib_samples=16, seqlen=32)
            quantize_module(m, config, [_windows(1, 16)] if method != "rtn" else None)
            rel = _rel(_logits(m, ids), want)
            return {"status": "pass" if rel < W4_REL else "fail", "rel": round(rel, 4)}
        if step == "export-kv":
            from edgekit.export.lm import export_causal_lm
            from edgekit.loading import load_model

            folder = tmp / model_type
            model.save_pretrained(folder, safe_serialization=True)
            byte_tokenizer().save_pretrained(folder)
            export_causal_lm(load_model(str(folder)), tmp / f"{model_type}-onnx")
            return {"status": "pass", "detail": "parity checked by the export"}
        raise ValueError(step)
    except CheckFailedError as e:
        return {"status": "fail", "detail": str(e)}
    except EdgekitError as e:
        text = str(e)
        return {"status": "refused" if "\n" not in text else "traceback", "detail": text}
    except _OverTime:
        return {"status": "over time", "detail": "past the cell's time limit"}
    except Exception as e:  # noqa: BLE001 - a cell that raises anything else is what the matrix exists to find
        return {"status": "traceback", "detail": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}


def routing_diagnosis(model: Any, want: torch.Tensor, method: str = "rtn") -> dict[str, Any]:
    """Where a mixture of experts' 4-bit error comes from: the relative logit error with the model's
    own routing, with every router returning the float model's scores (the same experts for every
    token), and the share of tokens per router whose top-k expert set changed."""
    from edgekit.compress.weight_only.blocks import expert_routers
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import quantize_module

    ids = _windows()
    routers = expert_routers(model)
    if not routers:
        return {"routers": 0}
    k = getattr(model.config, "num_experts_per_tok", None) or getattr(model.config, "moe_topk", None) or 2
    k = int(k[0] if isinstance(k, (list, tuple)) else k)

    def record(m: Any) -> tuple[dict[str, torch.Tensor], list[Any]]:
        seen: dict[str, torch.Tensor] = {}
        hooks = [m.get_submodule(r).register_forward_hook(lambda _m, _a, o, r=r: seen.__setitem__(r, o))
                 for r in routers]
        return seen, hooks

    float_scores, hooks = record(model)
    _logits(model, ids)
    for h in hooks:
        h.remove()
    m = copy.deepcopy(model)
    config = WeightOnlyConfig(method=method, bits=4, group_size=32, calib_samples=16, seqlen=32)
    quantize_module(m, config, [_windows(1, 16)] if method != "rtn" else None)
    own_scores, hooks = record(m)
    own = _rel(_logits(m, ids), want)
    for h in hooks:
        h.remove()
    hooks = [m.get_submodule(r).register_forward_hook(lambda _m, _a, _o, r=r: float_scores[r]) for r in routers]
    forced = _rel(_logits(m, ids), want)
    for h in hooks:
        h.remove()

    def top(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-1]).topk(k, -1).indices.sort(-1).values

    changed = [float((top(float_scores[r]) != top(own_scores[r])).any(-1).float().mean()) for r in routers]
    return {"routers": len(routers), "top_k": k, "rel": round(own, 4), "rel_float_routing": round(forced, 4),
            "tokens_rerouted": [round(c, 3) for c in changed]}


def _alarm(_signum: int, _frame: Any) -> None:
    raise _OverTime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", help="comma-separated model types (default: all generated)")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--seconds", type=int, default=CELL_SECONDS, help="time limit of one cell")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "decoder_matrix.json"))
    ap.add_argument("--routing", action="store_true",
                    help="instead of the matrix: for each mixture of experts among --types, its RTN-4 error with "
                         "its own and with the float model's routing (routing_diagnosis); results/moe_routing.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.routing:
        diag = {}
        for mt in (args.types.split(",") if args.types else causal_lm_types()):
            model = tiny_causal_lm(mt)
            if isinstance(model, str):
                continue
            d = routing_diagnosis(model, _logits(model, _windows()))
            if d["routers"]:
                diag[mt] = d
                print(f"| {mt} | {d['routers']} | {d['rel']:.3f} | {d['rel_float_routing']:.3f} | "
                      f"{', '.join(f'{c:.0%}' for c in d['tokens_rerouted'])} |", flush=True)
        (ROOT / "benchmarks" / "results" / "moe_routing.json").write_text(json.dumps(diag, indent=1))
        return
    types = args.types.split(",") if args.types else causal_lm_types()
    steps = args.steps.split(",")
    signal.signal(signal.SIGALRM, _alarm)
    rows: dict[str, Any] = {}
    t_all, c_all = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        for mt in types:
            t0 = time.perf_counter()
            signal.alarm(args.seconds)
            try:
                model = tiny_causal_lm(mt)
                want = _logits(model, _windows()) if not isinstance(model, str) else None
            except _OverTime:
                model, want = f"building and running it takes over {args.seconds} s", None
            except Exception as e:  # noqa: BLE001 - the float model itself does not run at tiny sizes
                model, want = f"the float model does not run ({type(e).__name__}: {str(e)[:100]})", None
            finally:
                signal.alarm(0)
            if isinstance(model, str) or want is None:
                rows[mt] = {"excluded": str(model)}
                print(f"{mt:28s} excluded: {model}", flush=True)
                continue
            cells: dict[str, Any] = {}
            for step in steps:
                c0 = time.perf_counter()
                signal.alarm(args.seconds)
                try:
                    cells[step] = run_cell(mt, step, model, want, Path(tmp))
                except _OverTime:
                    cells[step] = {"status": "over time", "detail": f"> {args.seconds} s"}
                finally:
                    signal.alarm(0)
                cells[step]["seconds"] = round(time.perf_counter() - c0, 2)
            rows[mt] = {"cells": cells, "seconds": round(time.perf_counter() - t0, 2)}
            line = "  ".join(f"{s}={c['status']}" + (f"({c['rel']})" if "rel" in c else "") for s, c in cells.items())
            print(f"{mt:28s} {line}", flush=True)
    import transformers

    out = {"date": time.strftime("%Y-%m-%d"), "transformers": transformers.__version__, "torch": torch.__version__,
           "steps": steps, "rows": rows, "wall_s": round(time.perf_counter() - t_all, 1),
           "cpu_s": round(time.process_time() - c_all, 1)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    counts: dict[str, dict[str, int]] = {s: {} for s in steps}
    for r in rows.values():
        for s, c in r.get("cells", {}).items():
            counts[s][c["status"]] = counts[s].get(c["status"], 0) + 1
    print(f"\n{len(rows)} model types, {sum('cells' in r for r in rows.values())} tiny; wall {out['wall_s']} s, "
          f"CPU {out['cpu_s']} s")
    for s in steps:
        print(f"{s:10s} " + ", ".join(f"{k} {v}" for k, v in sorted(counts[s].items())))


if __name__ == "__main__":
    main()
