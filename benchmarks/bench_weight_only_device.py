"""Weight-only 4-bit quantization (RTN, GPTQ, AWQ) with ``device="cuda"`` against ``device="cpu"``.

    python benchmarks/bench_weight_only_device.py [--layers 4] [--hidden 512]

On a seeded random-weight Llama (hidden 512, 4 layers, GQA 8/4 heads, vocabulary 512, weights
N(0, 0.05)) with 16 random calibration windows of 128 tokens: each method on each device that is
here, wall and process CPU time, relative logit error ``||y - y_float|| / ||y_float||`` on 4
held-out random windows, and the share of 4-bit codes the two devices agree on. Random weights, so
the errors say that the CUDA path computes the same algorithm (bounded, comparable error), not how
good a method is on a real model. Without CUDA it measures the CPU rows and says so.
Writes ``benchmarks/results/weight_only_device.json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "weight_only_device.json"))
    args = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import quantize_module

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=256)
    float_model = LlamaForCausalLM(cfg).eval()
    for p in float_model.parameters():
        p.data.normal_(0, 0.05)
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, 512, (16, 128), generator=g)]  # one tensor per model input, axis 0 = sample
    held = torch.randint(0, 512, (4, 128), generator=g)
    with torch.no_grad():
        ref = float_model(held).logits.float()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows: list[dict[str, object]] = []
    codes: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for method in ("rtn", "gptq-plus", "gptq", "awq"):
        for device in devices:
            model = copy.deepcopy(float_model)
            config = WeightOnlyConfig(method=method, bits=4, group_size=128, seqlen=128, device=device)
            t0, c0 = time.perf_counter(), time.process_time()
            results, _ = quantize_module(model, config, calib if method != "rtn" else None)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            with torch.no_grad():
                out = model.to("cpu")(held).logits.float()
            codes[(method, device)] = {k: v[0].cpu() for k, v in results.items()}
            rows.append({"method": method, "device": device, "rel_logit_err": float((out - ref).norm() / ref.norm()),
                         "wall_s": wall, "cpu_s": cpu})
    agree = {}
    for method in ("rtn", "gptq", "awq"):
        a, b = codes.get((method, "cpu")), codes.get((method, "cuda"))
        if a and b:
            same = sum(int((a[k] == b[k]).sum()) for k in a)
            agree[method] = same / sum(a[k].numel() for k in a)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    print(f"GPU: {gpu or 'none (CPU rows only)'}; torch {torch.__version__}; {os.cpu_count()} CPU cores")
    print("| method | device | rel. logit error | wall s | CPU s | codes equal to CPU's |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        eq = f"{agree[r['method']]:.1%}" if r["device"] == "cuda" and r["method"] in agree else ""
        print(f"| {r['method']} | {r['device']} | {r['rel_logit_err']:.4f} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {eq} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "cpu_cores": os.cpu_count(),
                                          "rows": rows, "codes_equal_cpu_cuda": agree}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
