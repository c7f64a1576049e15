"""The decoder conformance matrix generated from the installed transformers (issue 31).

Rows: every model type transformers maps to a ``*ForCausalLM`` class whose config can be made tiny
(``tests/tiny_models.py``: hidden 64, 2 layers, vocabulary 260, seeded random weights, built
offline). Columns (steps), each checked against the float model on the same token windows:

* ``float``: the model runs and gives finite logits over the vocabulary;
* ``rtn-8``: 8-bit weight-only round-to-nearest (group 32), the relative logit error
  ``||y - y_float|| / ||y_float||`` under ``W8_REL`` (``W8_ROUTED_REL`` for a mixture of experts);
* ``rtn-4`` / ``gptq-4`` / ``awq-4``: 4-bit weight-only (group 32; GPTQ with its defaults, GPTAQ
  included; AWQ with its folds from the table or the module-graph probe), the relative logit error
  under ``W4_REL``;
* ``int8``: the graph INT8 step as ``edgekit compress FOLDER --bits 8`` runs it (float ONNX export,
  calibration on ``INT8_CALIB`` windows of the calibration split, Q/DQ, the quality gate's float
  reference), the INT8 graph run by ONNX Runtime on the matrix's windows, the relative logit error
  under ``INT8_REL``;
* ``export-kv``: the model saved as a Hugging Face folder, loaded by edgekit's loader and exported
  with the KV cache (the export checks its own parity against PyTorch);
* ``build-profile``: that KV-cache export built for the ``cpu`` target with ONNX Runtime (one
  thread) and profiled through ``profile_generation``: a prefill of 8 tokens and 4 decode steps;
  passes when the engine is verified (the export's parity) and every decode rate is finite and > 0.

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

STEPS = ("float", "rtn-8", "rtn-4", "gptq-4", "awq-4", "int8", "export-kv", "build-profile")
W8_REL = 0.04  # as the hand-written matrix (tests/test_conformance.py; measured there 0.0006-0.018)
# 8 bits on a mixture of experts, as there: a token near a routing tie changes experts under any weight
# change, which moves its logits by far more than the rounding does (measured there 0.013-0.066)
W8_ROUTED_REL = 0.10
W4_REL = 0.30  # as the hand-written matrix
# 8-bit weights and 8-bit activations with one scale per tensor: the hand-written matrix's W8A8 bound
# (tests/test_conformance.py); the down projections stay float as the step's default keeps them
INT8_REL = 0.10
INT8_CALIB = 8  # calibration windows: the step's least (ranges of a tiny model settle within a few)
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


def _saved(model_type: str, model: Any, tmp: Path) -> Path:
    """The model as a Hugging Face folder (with the byte tokenizer), once per model type."""
    folder = tmp / model_type
    if not (folder / "config.json").exists():
        model.save_pretrained(folder, safe_serialization=True)
        byte_tokenizer().save_pretrained(folder)
    return folder


def _exported(model_type: str, model: Any, tmp: Path) -> Path:
    """Its KV-cache export through edgekit's loader, once per model type (the build reuses it)."""
    from edgekit.export.lm import export_causal_lm
    from edgekit.loading import load_model

    out = tmp / f"{model_type}-onnx"
    if not (out / "manifest.json").exists():
        export_causal_lm(load_model(str(_saved(model_type, model, tmp))), out)
    return out


def _onnx_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a graph with inputs ``input_ids`` (and ``attention_mask``), one thread."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids.numpy().astype("int64"), "attention_mask": torch.ones_like(ids).numpy().astype("int64")}
    names = {i.name for i in session.get_inputs()}
    logits = session.run(None, {k: v for k, v in feeds.items() if k in names})[0]
    return torch.from_numpy(logits).float()


def run_cell(model_type: str, step: str, model: Any, want: torch.Tensor, tmp: Path) -> dict[str, Any]:
    """One cell: ``{"status": pass|refused|fail|traceback, "detail": ..., "rel": ...}``."""
    from edgekit.compress.weight_only.blocks import expert_routers
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import quantize_module
    from edgekit.errors import CheckFailedError, EdgekitError

    ids = _windows()
    try:
        if step == "float":
            ok = want.shape[-1] >= 256 and bool(torch.isfinite(want).all()) and float(want.std()) > 0
            return {"status": "pass" if ok else "fail", "detail": f"logits {tuple(want.shape)}"}
        if step in ("rtn-8", "rtn-4", "gptq-4", "awq-4"):
            m = copy.deepcopy(model)
            name, bits = step.split("-")
            method = {"gptq": "gptq-plus"}.get(name, name)  # the "gptq-4" cell: the default GPTQ
            # 16 windows: with 4 calibration windows a top-2 of 4 experts sees ~64 tokens per expert for
            # 64 input features, and GPTQ's Hessians are thin (tiny Mixtral: 0.31 at 4, 0.25 at 16)
            config = WeightOnlyConfig(method=method, bits=int(bits), group_size=32, calib_samples=16, seqlen=32)
            quantize_module(m, config, [_windows(1, 16)] if method != "rtn" else None)
            rel = _rel(_logits(m, ids), want)
            bound = W4_REL if bits == "4" else W8_ROUTED_REL if expert_routers(model) else W8_REL
            return {"status": "pass" if rel < bound else "fail", "rel": round(rel, 4)}
        if step == "int8":
            from edgekit.compress import StepContext, compress
            from edgekit.compress.int8.config import Int8Config

            out = compress(str(_saved(model_type, model, tmp)), [("int8", Int8Config(calib_samples=INT8_CALIB))],
                           tmp / f"{model_type}-int8", StepContext(progress=False, accept_quality_loss=True))
            rel = _rel(_onnx_logits(out / "model.onnx", ids), want)
            return {"status": "pass" if rel < INT8_REL else "fail", "rel": round(rel, 4)}
        if step == "export-kv":
            _exported(model_type, model, tmp)
            return {"status": "pass", "detail": "parity checked by the export"}
        if step == "build-profile":
            from edgekit.build import build_engine
            from edgekit.profiling_lm import GenerationConfig, profile_generation
            from edgekit.runtimes.build_options import BuildOptions

            engine = build_engine(_exported(model_type, model, tmp), "cpu", tmp / f"{model_type}-engine",
                                  BuildOptions(runtime="onnxruntime", threads=1))
            quality = json.loads((engine / "manifest.json").read_text())["metrics"].get("quality", {})
            gen = profile_generation(engine, GenerationConfig(
                prompt_lengths=(8,), contexts=(8,), new_tokens=4, warmup_ms=0, duration_s=0, iterations=2,
                decode_runs=1, threads=1))
            rates = [float(d["tokens_per_s"]) for d in gen["decode"].values()]
            ok = quality.get("status") == "verified" and bool(rates) and all(0 < r < float("inf") for r in rates)
            return {"status": "pass" if ok else "fail",
                    "detail": f"engine {quality.get('status')}; decode {min(rates, default=0):.0f} tokens/s"}
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
                c0, p0 = time.perf_counter(), time.process_time()
                signal.alarm(args.seconds)
                try:
                    cells[step] = run_cell(mt, step, model, want, Path(tmp))
                except _OverTime:
                    cells[step] = {"status": "over time", "detail": f"> {args.seconds} s"}
                finally:
                    signal.alarm(0)
                cells[step]["seconds"] = round(time.perf_counter() - c0, 2)
                # the limit is on wall time; the CPU time tells a slow cell from a loaded machine
                cells[step]["cpu_s"] = round(time.process_time() - p0, 2)
            rows[mt] = {"cells": cells, "seconds": round(time.perf_counter() - t0, 2)}
            partial = Path(args.json).with_suffix(".partial.json")  # a stopped run keeps the rows it finished
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"steps": steps, "rows": rows}, indent=1))
            line = "  ".join(f"{s}={c['status']}" + (f"({c['rel']})" if "rel" in c else "") for s, c in cells.items())
            print(f"{mt:28s} {line}", flush=True)
    import transformers

    out = {"date": time.strftime("%Y-%m-%d"), "transformers": transformers.__version__, "torch": torch.__version__,
           "steps": steps, "rows": rows, "wall_s": round(time.perf_counter() - t_all, 1),
           "cpu_s": round(time.process_time() - c_all, 1)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    Path(args.json).with_suffix(".partial.json").unlink(missing_ok=True)
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
