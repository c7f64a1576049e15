"""The ``edgekit`` command line. Each command parses, calls one API function, prints.

Exit codes: 0 ok; 1 a check failed (budget, parity, accuracy); 2 bad input or a missing
capability. Errors are one line on stderr, never a traceback.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from edgekit import __version__, interrupts
from edgekit.errors import BadInputError, EdgekitError, os_error_message
from edgekit.limits import MAX_DIM
from edgekit.paths import has_journal_entries


class EdgekitGroup(click.Group):
    """Turns edgekit errors, OS errors, click usage errors and Ctrl-C into one line and an
    exit code (130 for Ctrl-C, also when a library swallowed the KeyboardInterrupt)."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        if has_journal_entries():  # staging folders of edgekit processes that were killed outright
            from edgekit.artifact import recover_abandoned_outputs

            recover_abandoned_outputs()
        try:
            rv = super().main(*args, **kwargs)
            interrupts.raise_if_seen()
        except (click.exceptions.Abort, KeyboardInterrupt):  # Ctrl-C, SIGTERM, SIGHUP (edgekit.interrupts)
            interrupts.exiting()
            _fail("", interrupts.EXIT_INTERRUPTED)
        except MemoryError as e:  # an allocation no limit foresaw (numpy: "Unable to allocate 5.70 TiB ...")
            _fail(f"out of memory: {str(e).splitlines()[0] if str(e) else 'an allocation failed'}", 2)
        except EdgekitError as e:
            _fail(str(e), e.exit_code)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.ClickException as e:
            _fail(e.format_message(), e.exit_code)
        except BrokenPipeError:  # the reader went away (`edgekit zoo | head -1`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except OSError as e:  # permissions, a full disk, a read-only file system, a file where a folder goes
            _fail(os_error_message(e), 2)
        if isinstance(rv, int) and rv:
            sys.exit(rv)
        sys.exit(0)


def _fail(message: str, code: int) -> None:
    """One line on stderr and the exit code; after a Ctrl-C (even one a library turned
    into another error) the interrupt is what is reported, with exit 130."""
    if interrupts.seen() or code == interrupts.EXIT_INTERRUPTED:
        message, code = interrupts.interrupted_message(), interrupts.exit_status()
    with contextlib.suppress(OSError):  # a hung-up terminal (SIGHUP) has nowhere to print to
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _console() -> Any:
    from rich.console import Console

    # Off a terminal (CI logs, pipes) rich would wrap tables at 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=160)


def _table(title: str | None, columns: list[str], rows: list[list[Any]]) -> Any:
    """A rich table; every text escaped, so a name holding rich markup (``[/]``, ``[link=...]``)
    shows as written instead of styling the table or failing to render."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title) if title is not None else None)
    for c in columns:
        t.add_column(escape(c))
    for r in rows:
        t.add_row(*[escape(str(x)) for x in r])
    return t


def _escape(text: object) -> str:
    from rich.markup import escape

    return escape(str(text))


def _cell(value: Any) -> str:
    """A value as a table shows it: numbers to 4 significant digits, lists joined, never a repr."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, (dict, list, tuple)) for v in value):
            return f"{len(value)} entries (in the JSON)"
        shown = ", ".join(_cell(v) for v in value[:8])
        return shown + (f", ... ({len(value)} in all)" if len(value) > 8 else "")
    return str(value)


def _flat_rows(data: Any, prefix: str = "") -> list[list[str]]:
    """Nested mappings as [dotted key, readable value] rows (``quality.cosine``, not a dict's repr)."""
    if isinstance(data, dict):
        rows: list[list[str]] = []
        for k, v in data.items():
            rows += _flat_rows(v, f"{prefix}.{k}" if prefix else str(k))
        return rows
    return [[prefix, _cell(data)]]


def _json_flag(what: str) -> Any:
    """``--json``: print ``what`` as one JSON document on stdout, instead of the tables."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON (one document on stdout).")


def _output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file named on the command line, checked before any work: a folder, a FIFO
    (no reader: the command would block at its end), a device or a system path is refused."""
    if value is not None and value != "-":
        from edgekit.artifact import check_output_file

        check_output_file(value)
    return value


def _json_file_or_stdout(what: str) -> Any:
    """``--json [FILE]``: write ``what`` to FILE, or with no FILE (or ``-``) print it on stdout as
    the only output."""
    return click.option("--json", "json_out", type=click.Path(), default=None, is_flag=False, flag_value="-",
                        metavar="[FILE]", callback=_output_file,
                        help=f"Write {what} to FILE; without FILE (or with -) print it on stdout instead of the tables.")


def _print_json(doc: Any) -> None:
    """The one JSON document of ``--json`` on stdout."""
    click.echo(json.dumps(doc, indent=2, default=str))


@contextlib.contextmanager
def _json_stdout(enabled: bool) -> Iterator[None]:
    """With ``--json`` stdout carries the JSON document only: what the work prints (progress lines,
    libraries' messages, also native code's on file descriptor 1) goes to stderr meanwhile."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@click.group(cls=EdgekitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="edgekit")
@click.option("-q", "--quiet", is_flag=True, help="No progress output (bars or log lines).")
@click.option("-v", "--verbose", is_flag=True, help="Also show library log messages.")
def cli(quiet: bool, verbose: bool) -> None:
    """edgekit: compress a PyTorch model, export it to ONNX, build an engine for a target,
    profile it and check it against a latency budget.

    Long work reports progress: rich bars on a terminal; in a log, one line per phase and
    one at least every 30 s with the elapsed time and an estimate of what remains."""
    from edgekit.progress import set_verbosity

    if quiet and verbose:
        raise click.UsageError("--quiet and --verbose contradict each other; give one")
    set_verbosity(-1 if quiet else 1 if verbose else 0)


# --- model inputs: --shapes, --inputs, --preprocess (one declaration, shared by the commands) ---

_INPUT_OPTIONS = {
    "shapes": click.option(
        "--shapes", default=None, metavar="NAME:DIMS,...",
        help="Input shapes, trtexec's syntax: input_ids:1x128,attention_mask:1x128 (binds dynamic dimensions; "
             "default: the batch, 128 tokens for token-id inputs)."),
    "inputs": click.option(
        "--inputs", "inputs_file", type=click.Path(), default=None, metavar="FILE.npz",
        help="Real sample inputs: a .npz with one array per input name (checked against the model's names, "
             "dtypes and ranks)."),
    "preprocess": click.option(
        "--preprocess", default=None, metavar="KEY=VALUE,...",
        help="Image models: layout=nchw|nhwc, order=rgb|bgr, scale=1|255, mean=M/M/M, std=S/S/S, resize=N, "
             "size=HxW (default: what the model says, else NCHW RGB in [0, 1])."),
}


def with_input_options(*which: str) -> Any:
    """Add the model-input options named in ``which`` to a command; the command receives them
    parsed and checked as one ``input_options`` argument (``edgekit.sources.inputs.InputOptions``
    or None)."""

    def decorate(f: Any) -> Any:
        @functools.wraps(f)
        def command(*args: Any, **kwargs: Any) -> Any:
            from edgekit.sources.inputs import input_options
            opts = input_options(shapes=kwargs.pop("shapes", None), inputs=kwargs.pop("inputs_file", None),
                                 preprocess=kwargs.pop("preprocess", None))
            return f(*args, input_options=opts, **kwargs)

        for name in reversed(which):
            command = _INPUT_OPTIONS[name](command)
        return command

    return decorate


# --- export, build, profile, check, report ---

@cli.command()
@_json_flag("the models")
def zoo(as_json: bool) -> None:
    """List the built-in models."""
    from edgekit.sources.zoo import DEFAULT_MODEL, ZOO

    if as_json:
        _print_json([{"name": name, "default": name == DEFAULT_MODEL, "kind": e.kind, "description": e.description,
                      "package": e.package} for name, e in ZOO.items()])
        return
    for name, e in ZOO.items():
        click.echo(f"{name}{' (default)' if name == DEFAULT_MODEL else ''}  [{e.kind}]  {e.description}; "
                   f"weights from {e.package}")


@cli.command()
@click.argument("model")
@click.option("-o", "--out", required=True, type=click.Path(), help="Output folder (an ONNX artifact).")
@click.option("--opset", type=int, default=None, help="ONNX opset (default: the exporter's choice).")
@click.option("--legacy", is_flag=True, help="Use the TorchScript exporter instead of dynamo.")
@click.option("--atol", type=float, default=None, help="Parity: absolute tolerance.")
@click.option("--rtol", type=float, default=None, help="Parity: relative tolerance.")
@click.option("--no-parity", is_flag=True, help="Skip the ONNX Runtime vs PyTorch parity check.")
@click.option("--kv-cache", is_flag=True, help="Causal LMs: export with the KV cache as inputs and outputs "
              "(text-generation-with-past, optimum), for real one-token decode latency.")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=None,
              help="Packed low-bit layers (with --kv-cache): MatMulNBits compute precision on ONNX Runtime's CPU; "
                   "4 = int8 compute (default: 11.6x faster one-token decode on SmolLM2 than 0), 0 = fp32 compute.")
@click.option("--graph", type=click.Choice(["auto", "fused", "traced"]), default="auto", show_default=True,
              help="Causal LMs (with --kv-cache): fused = ONNX Runtime's fused decoder graph (GroupQueryAttention, "
                   "fused norms and matmuls, in-place KV cache), traced = optimum's export; auto = fused where the "
                   "architecture has it (Llama, Mistral, Qwen2, Gemma 2 and 3).")
@click.option("--block-size", type=int, default=None,
              help="Fused graph: MatMulNBits block size (16..256, dividing the quantization group; default the group).")
@click.option("--weight-format", type=click.Choice(["matmulnbits", "qdq"]), default="matmulnbits", show_default=True,
              help="Packed low-bit layers (with --kv-cache): matmulnbits = ONNX Runtime's MatMulNBits (CPU, CUDA); "
                   "qdq = blocked DequantizeLinear (opset 21), the form TensorRT 10 imports (signed, no zero points, "
                   "when the weights were quantized with --sym).")
@with_input_options("shapes", "inputs")
@_json_flag("the folder, the ONNX file and the parity check")
def export(model: str, out: str, opset: int | None, legacy: bool, atol: float | None, rtol: float | None,
           no_parity: bool, kv_cache: bool, accuracy_level: int | None, graph: str, block_size: int | None,
           weight_format: str, input_options: Any, as_json: bool) -> None:
    """Export MODEL (zoo name, file, entry point or output folder) to ONNX, checked against PyTorch."""
    from edgekit.export.onnx import ExportConfig
    from edgekit.loading import export_onnx

    if kv_cache and input_options:
        raise BadInputError("--shapes and --inputs do not apply to the KV-cache export (it traces its own prefill "
                            "and decode steps); give them to build or profile")
    if kv_cache:
        from edgekit.artifact import check_output_dir
        from edgekit.export.lm import export_causal_lm
        from edgekit.loading import load_model

        check_output_dir(out, (model,))  # before loading the model
        options: dict[str, Any] = {k: v for k, v in (("atol", atol), ("rtol", rtol), ("accuracy_level", accuracy_level))
                                   if v is not None}
        with _json_stdout(as_json):
            handle = load_model(model)
            if handle.kind != "causal-lm":
                raise BadInputError(f"--kv-cache is for causal language models; {handle.name} is a {handle.kind!r} "
                                    "model")
            folder = export_causal_lm(handle, out, opset=opset or 21, parity=not no_parity, graph=graph,
                                      block_size=block_size, fmt=weight_format, **options)
        _print_parity(folder, as_json)
        return
    if accuracy_level is not None:
        raise BadInputError("--accuracy-level applies to the KV-cache export of a packed causal LM (add --kv-cache)")
    if graph != "auto" or block_size is not None or weight_format != "matmulnbits":
        raise BadInputError("--graph, --block-size and --weight-format apply to the KV-cache export of a causal LM "
                            "(add --kv-cache)")

    fields: dict[str, Any] = {"dynamo": not legacy, "skip_parity": no_parity}
    if opset is not None:
        fields["opset"] = opset
    if atol is not None:
        fields["atol"] = atol
    if rtol is not None:
        fields["rtol"] = rtol
    with _json_stdout(as_json):
        folder = export_onnx(model, out, ExportConfig(**fields), input_options)
    _print_parity(folder, as_json)


def _print_parity(folder: Path, as_json: bool = False) -> None:
    from edgekit.artifact import read_manifest

    m = read_manifest(folder)
    parity = m.metrics.get("parity") or {}
    if as_json:
        _print_json({"folder": str(folder), "onnx": str(m.path_of(folder, "onnx")), "parity": parity})
        return
    outputs = parity.get("outputs") or {}
    if outputs:
        rows = [[name, f"{r.get('max_abs_error', 0):.3e}", f"{r.get('max_rel_error', 0):.3e}",
                 f"{r.get('atol', '-')}", f"{r.get('rtol', '-')}"] for name, r in outputs.items()]
        _console().print(_table("parity: ONNX Runtime vs PyTorch", ["output", "max abs err", "max rel err", "atol", "rtol"], rows))
    click.echo(f"wrote {m.path_of(folder, 'onnx')}")


@cli.command()
@click.argument("model")
@click.option("--target", "target", default="cpu", show_default=True, help="Target name or YAML file.")
@click.option("-o", "--out", required=True, type=click.Path(), help="Engine output folder.")
@click.option("--runtime", default=None, help="onnxruntime | openvino | torch | tensorrt | best (build with each "
              "runtime the target lists, time them here, keep the fastest); default: the target's first available.")
@click.option("--precision", default=None, help="fp32 | fp16 | bf16 | int8 | fp8 | best (default: fp32, or the model's own).")
@click.option("--threads", type=int, default=None, help="Intra-op threads (default: all cores).")
@click.option("--opt-level", type=click.Choice(["disable", "basic", "extended", "all"]), default="all", show_default=True)
@click.option("--remote", default=None, help="TensorRT: build on the device over SSH (user@host).")
@click.option("--workspace-mb", type=int, default=None, help="TensorRT: builder workspace limit.")
@click.option("--dla-core", type=int, default=None, help="TensorRT on Orin: DLA core, with GPU fallback.")
@click.option("--batch", type=click.IntRange(1, MAX_DIM), default=1, show_default=True, help="Batch the engine is optimized for (TensorRT opt shape).")
@click.option("--max-batch", type=int, default=None, help="TensorRT: largest batch of the optimization profile.")
@with_input_options("shapes", "inputs")
@_json_flag("the engine folder, its config and metrics")
def build(model: str, target: str, out: str, runtime: str | None, precision: str | None, threads: int | None,
          opt_level: str, remote: str | None, workspace_mb: int | None, dla_core: int | None, batch: int,
          max_batch: int | None, input_options: Any, as_json: bool) -> None:
    """Build an engine for a target from a model, an ONNX file or a previous step's folder."""
    from edgekit.build import build_engine
    from edgekit.runtimes.base import BuildOptions

    extra: dict[str, Any] = {k: v for k, v in {"remote": remote, "workspace_mb": workspace_mb,
                                                "dla_core": dla_core, "max_batch": max_batch}.items() if v is not None}
    options = BuildOptions(precision=precision or "fp32", threads=threads, optimization_level=opt_level, runtime=runtime,
                           batch=batch, extra=extra)
    with _json_stdout(as_json):
        folder = build_engine(model, target, out, options, input_options)
    from edgekit.artifact import read_manifest

    m = read_manifest(folder)
    if as_json:
        _print_json({"folder": str(folder), "target": m.target, "files": m.files, "config": m.config,
                     "metrics": m.metrics})
        return
    for line in m.config.get("messages", []):
        click.echo(line)
    check_summary = (m.metrics.get("tensorrt_check") or {}).get("summary")
    if check_summary:
        click.echo(check_summary)
    for w in m.metrics.get("warnings", []):
        click.echo(f"warning: {w}")
    for name, c in (m.metrics.get("runtime_candidates") or {}).items():
        click.echo(f"  {name}: " + (f"p50 {c['p50_ms']:.3f} ms" if "p50_ms" in c else c.get("error") or c.get("skipped", "")))
    status = (m.config.get("status") or {}).get("summary")
    click.echo(f"{status} (in {folder})" if status else f"built {m.config.get('runtime')} engine for {m.target} in {folder}")


@cli.command()
@click.argument("engine_dir", type=click.Path(), required=False)
@click.option("--trtexec", "trtexec_dir", type=click.Path(), default=None,
              help="A folder of trtexec exports made by hand (--exportTimes, --exportProfile, --exportLayerInfo, log; "
                   "any names): read as a device profile, checked against --onnx and --target.")
@click.option("--onnx", "onnx_file", type=click.Path(), default=None, help="With --trtexec: the ONNX the engine was built from.")
@click.option("--target", "target", default=None, help="With --trtexec: the target the results claim (name or YAML).")
@click.option("--warmup-ms", type=float, default=200.0, show_default=True)
@click.option("--duration-s", type=float, default=3.0, show_default=True)
@click.option("--iterations", type=int, default=100, show_default=True, help="Minimum timed inferences.")
@click.option("--threads", type=int, default=None)
@click.option("--batch", type=click.IntRange(1, MAX_DIM), default=1, show_default=True)
@click.option("--top-k", type=int, default=15, show_default=True)
@click.option("--no-nodes", is_flag=True, help="Skip the per-node profiling run.")
@_json_file_or_stdout("the profile JSON")
@click.option("--no-generation", is_flag=True, help="Causal LMs: skip the generation metrics.")
@click.option("--prompt-lengths", default=None, help="Causal LMs: prompt lengths whose prefill (time to first token) "
              "is timed (default 128,512, cut to the context the model declares; longer ones are refused).")
@click.option("--contexts", default=None, help="Causal LMs: context lengths after which decode tokens/s is measured "
              "(default 128,1024, cut to leave room for the new tokens within the model's context).")
@click.option("--new-tokens", type=int, default=None, help="Causal LMs: tokens generated per run (default 128, at "
              "most a quarter of the model's context).")
@with_input_options("shapes", "inputs")
def profile(engine_dir: str | None, trtexec_dir: str | None, onnx_file: str | None, target: str | None,
            warmup_ms: float, duration_s: float, iterations: int, threads: int | None, batch: int,
            top_k: int, no_nodes: bool, json_out: str | None, no_generation: bool, prompt_lengths: str | None,
            contexts: str | None, new_tokens: int | None, input_options: Any) -> None:
    """Measure latency percentiles and per-node times of an engine (the trtexec method); for a causal LM
    with a KV cache also time to first token, decode tokens/s and peak memory. With --trtexec DIR --onnx
    MODEL.onnx --target T: read trtexec exports made by hand, checked against the model and target."""
    from edgekit.profiling import ProfileConfig, profile_exports
    from edgekit.profiling_lm import GenerationConfig, profile_with_generation

    if trtexec_dir is not None or onnx_file is not None:
        if trtexec_dir is None or onnx_file is None or target is None or engine_dir is not None:
            raise BadInputError("trtexec exports are read with --trtexec DIR --onnx MODEL.onnx --target TARGET "
                                "(and no ENGINE_DIR)")
        if input_options is not None and input_options.inputs is not None:
            raise BadInputError("--inputs applies to engines timed here; with --trtexec give --shapes (the shapes "
                                "trtexec timed)")
        file = None if json_out == "-" else json_out
        with _json_stdout(json_out == "-"):
            result = profile_exports(trtexec_dir, onnx_file, target, shapes=input_options.shapes if input_options
                                     else None, top_k=top_k, out_json=file)
        if json_out == "-":
            _print_json(result.to_dict())
            return
        _print_profile(result, top_k)
        if file:
            click.echo(f"wrote {file}")
        return
    if engine_dir is None:
        raise BadInputError("give an engine folder (edgekit profile ENGINE_DIR), or trtexec exports with --trtexec "
                            "DIR --onnx MODEL.onnx --target TARGET")
    if target is not None:
        raise BadInputError("--target applies with --trtexec (an engine folder records its target)")
    config = ProfileConfig(warmup_ms=warmup_ms, duration_s=duration_s, iterations=iterations, threads=threads,
                           batch=batch, node_profile=not no_nodes, top_k=top_k)
    generation = None if no_generation else GenerationConfig(
        prompt_lengths=None if prompt_lengths is None else _int_list("--prompt-lengths", prompt_lengths),
        contexts=None if contexts is None else _int_list("--contexts", contexts),
        new_tokens=new_tokens, warmup_ms=warmup_ms, duration_s=duration_s, threads=threads)
    file = None if json_out == "-" else json_out
    with _json_stdout(json_out == "-"):
        result = profile_with_generation(engine_dir, config, generation, out_json=file, input_options=input_options)
    if json_out == "-":
        _print_json(result.to_dict())
        return
    _print_profile(result, top_k)
    if result.generation:
        _print_generation(result.generation)
    if file:
        click.echo(f"wrote {file}")


def _int_list(option: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise BadInputError(f"{option} takes comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise BadInputError(f"{option} takes comma-separated whole numbers >= 1, got {text!r}")
    return values


def _print_generation(gen: dict[str, Any]) -> None:
    con = _console()
    rows = [[f"time to first token, {n} prompt tokens", f"{r['wall_ms']['p50']:.2f}", f"{r['wall_ms']['p90']:.2f}",
             f"{r['wall_ms']['p99']:.2f}", f"{r['wall_ms']['cv']:.1%}", f"{r['cpu_ms']['p50']:.2f}", ""]
            for n, r in gen["time_to_first_token_ms"].items()]
    rows += [[f"decode step, context {c} (+{r['new_tokens']})", f"{r['step']['wall_ms']['p50']:.2f}",
              f"{r['step']['wall_ms']['p90']:.2f}", f"{r['step']['wall_ms']['p99']:.2f}",
              f"{r['step']['wall_ms']['cv']:.1%}", f"{r['step']['cpu_ms']['p50']:.2f}",
              f"{r['tokens_per_s']:.1f} ({r['cpu_tokens_per_s']:.1f} CPU)"]
             for c, r in gen["decode"].items()]
    con.print(_table(f"generation (KV cache {gen['kv_cache']})",
                     ["phase", "p50 ms", "p90 ms", "p99 ms", "CV", "CPU p50 ms", "tokens/s"], rows))
    if gen.get("peak_memory_mb"):
        con.print(f"peak memory (RSS): {gen['peak_memory_mb']:.0f} MB")


def _print_profile(result: Any, top_k: int) -> None:
    s = result.latency_ms
    con = _console()
    con.print(_table(f"latency (ms): {result.model} on {result.target} [{result.runtime}]",
                     ["min", "mean", "p50", "p90", "p95", "p99", "max", "std", "CV", "throughput"],
                     [[f"{s.min:.3f}", f"{s.mean:.3f}", f"{s.p50:.3f}", f"{s.p90:.3f}", f"{s.p95:.3f}", f"{s.p99:.3f}",
                       f"{s.max:.3f}", f"{s.std:.3f}", f"{s.cv:.1%}", f"{result.throughput_per_s:.1f}/s"]]))
    if result.noisy:
        con.print(f"noisy: CV {s.cv:.1%} after {result.attempts} attempt(s); a verdict on it is uncertain")
    if result.nodes:
        kernels = any(n.kernel for n in result.nodes)  # the kernel/ISA column, where the runtime tells
        con.print(_table(f"top {min(top_k, len(result.nodes))} nodes",
                         ["node", "op", "ms", "share", "precision"] + (["kernel"] if kernels else []),
                         [[n.label, n.op_type, f"{n.time_ms:.4f}", f"{n.share:.1%}", n.precision]
                          + ([n.kernel] if kernels else []) for n in result.nodes[:top_k]]))
    if result.float_share is not None:
        con.print(f"quantized nodes: {result.quantized_nodes}/{result.total_nodes}; "
                  f"time in float nodes: {result.float_share:.1%}")
    elif result.total_nodes:
        con.print(f"quantized nodes: unknown ({result.total_nodes} layers, none with a recorded precision: no layer "
                  "info)")
    breakdown = result.settings.get("precision_breakdown")
    if breakdown:
        con.print(_table("where the time goes, by precision", ["precision", "layers", "kind", "ms", "share"],
                         [[r["precision"], r["layers"], r["role"], f"{r['time_ms']:.4f}", f"{r['share']:.1%}"]
                          for r in breakdown["rows"]]))
    if result.provenance is not None:
        con.print(f"provenance: {result.provenance.summary()}")
    if result.source == "device":
        m = result.machine
        clocks = {True: "clocks locked", False: "clocks NOT locked"}.get(m.get("clocks_locked"), "clocks not recorded")
        device = (f"measured on the device: {m.get('board') or m.get('gpu') or 'unknown device'}"
                  + (f" ({m['sm']})" if m.get("sm") else "") + f", JetPack {m.get('jetpack') or 'not recorded'}, "
                  f"TensorRT {m.get('tensorrt_version') or 'not recorded'}, power mode "
                  f"{m.get('power_mode') or 'not recorded'}, {clocks}")
        con.print(device, markup=False)  # what the device wrote, shown as written
    for w in result.warnings:
        con.print(f"[yellow]warning:[/] {_escape(w)}")


@cli.command()
@click.argument("model")
@click.option("--target", "target", required=True, help="A target with the tensorrt runtime (name or YAML file).")
@click.option("--tensorrt", "tensorrt_version", default=None,
              help="Check against this TensorRT version (e.g. 8.5) instead of the one the target's JetPack pins.")
@click.option("--dla-core", type=int, default=None, help="Also list the layers that fall back from this DLA core.")
@click.option("--precision", default=None, help="The precision the engine will be built in (checked for the DLA).")
@click.option("--dim", "dims", multiple=True,
              help="Size a named dynamic axis for the profile: NAME=SIZE or NAME=MIN:MAX (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@with_input_options("shapes")
def lint(model: str, target: str, tensorrt_version: str | None, dla_core: int | None, precision: str | None,
         dims: tuple[str, ...], as_json: bool, input_options: Any) -> int:
    """Check an ONNX file (or an edgekit folder holding one) against the target's TensorRT, offline.
    --shapes / --dim give the optimization profile (else the folder's recorded one).
    Exit 0: nothing that would fail on the device; 1: findings that would; 2: bad input."""
    from edgekit.runtimes.tensorrt.lint import lint_model

    ranges: dict[str, tuple[int, int]] = {}
    for d in dims:
        name, _, value = d.partition("=")
        lo, _, hi = value.partition(":")
        if not name or not lo.strip().isdigit() or (hi and not hi.strip().isdigit()) or int(lo) < 0 \
                or (hi and int(hi) < int(lo)) or int(hi or lo) < 1:
            raise BadInputError(f"--dim {d!r} must be NAME=SIZE or NAME=MIN:MAX with whole numbers, 0 <= MIN <= MAX, "
                                "MAX >= 1")
        ranges[name] = (int(lo), int(hi or lo))
    report = lint_model(model, target, tensorrt_version=tensorrt_version, dla_core=dla_core, precision=precision,
                        shapes=input_options.shapes if input_options else None, dims=ranges or None)
    if as_json:
        _print_json(report.to_dict())
        return report.exit_code
    if report.findings:
        _console().print(_table(f"TensorRT {report.tensorrt_version} findings", ["severity", "node", "op", "why",
                                                                                  "what to do", "rule from"],
                                [[f.severity, f.node, f.op_type, f.why, f.fix, f.source] for f in report.findings]))
    click.echo(report.summary())
    return report.exit_code


@cli.command()
@click.argument("profile", type=click.Path())
@click.option("--budget-ms", type=float, default=None,
              help="Latency budget in milliseconds (for a causal LM: one decode step after a 128-token past).")
@click.option("--percentile", default="p99", show_default=True, help="min|mean|p50|p90|p95|p99|max")
@click.option("--max-jitter", type=float, default=None, help="Gate on p99/p50 (e.g. 1.2).")
@click.option("--min-tokens-per-s", type=float, default=None,
              help="Causal LMs: minimum decode tokens/s (median generation, slowest measured context).")
@click.option("--max-ttft-ms", type=float, default=None,
              help="Causal LMs: time-to-first-token budget at the longest measured prompt (at --percentile).")
@click.option("--require-verified", is_flag=True,
              help="Also fail (exit 1) when any field of the profile is unverified (device results whose provenance "
                   "was not recorded, an engine built without parity, an estimate), listing the reasons.")
@_json_file_or_stdout("the verdict JSON")
def check(profile: str, budget_ms: float | None, percentile: str, max_jitter: float | None,
          min_tokens_per_s: float | None, max_ttft_ms: float | None, require_verified: bool,
          json_out: str | None) -> int:
    """Exit 0 when PROFILE (JSON or engine folder) meets the budget, 1 when it misses."""
    from edgekit.check import check_budget, check_verified
    from edgekit.profiling_lm import check_generation

    if budget_ms is None and min_tokens_per_s is None and max_ttft_ms is None and not require_verified:
        raise BadInputError("give a budget: --budget-ms, --min-tokens-per-s or --max-ttft-ms (or --require-verified)")
    verdicts: list[tuple[str, Any]] = []  # (key in the verdict JSON, verdict); the first is the record's top level
    if budget_ms is not None:
        verdicts.append(("budget", check_budget(profile, budget_ms, percentile, max_jitter,
                                                require_verified=require_verified)))
    if min_tokens_per_s is not None or max_ttft_ms is not None:
        verdicts.append(("generation", check_generation(profile, min_tokens_per_s, max_ttft_ms, percentile)))
    if require_verified and budget_ms is None:
        verdicts.append(("verified", check_verified(profile)))
    code = 0 if all(v.passed for _, v in verdicts) else 1
    if json_out:
        from edgekit.artifact import atomic_write_json

        record = {**verdicts[0][1].to_dict(), "message": verdicts[0][1].message()}
        for key, v in verdicts[1:]:
            record[key] = {**v.to_dict(), "message": v.message()}
        if json_out == "-":
            _print_json(record)
            return code
        atomic_write_json(json_out, record, protect=(profile,))
    for _, v in verdicts:
        click.echo(v.message())
    return code


@cli.command()
@click.argument("folder", type=click.Path())
@click.option("-o", "--out", type=click.Path(), default=None, callback=_output_file,
              help="Markdown file (default FOLDER/report.md).")
@click.option("--budget-ms", type=float, default=None, help="Add a budget verdict for each profile.")
@click.option("--percentile", default="p99", show_default=True)
@click.option("--top-k", type=int, default=10, show_default=True)
@_json_flag("the report (what the JSON file holds)")
def report(folder: str, out: str | None, budget_ms: float | None, percentile: str, top_k: int, as_json: bool) -> None:
    """Render a Markdown and JSON report of a run folder."""
    from edgekit.report import render_report

    with _json_stdout(as_json):
        path = render_report(folder, out, budget_ms=budget_ms, percentile=percentile, top_k=top_k)
    if as_json:
        _print_json(json.loads(path.with_suffix(".json").read_text()))
        return
    click.echo(path.read_text())
    click.echo(f"wrote {path} and {path.with_suffix('.json')}")


# --- compress ---

class StepOptionsCommand(click.Command):
    """A command whose step options come from the step configs (``edgekit.compress.options``):
    read when the command runs or shows its help, so that the other commands do not import the
    steps. They go after the option named by ``after``, unset unless given."""

    def __init__(self, *args: Any, after: str = "out", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._after = after
        self._own = list(self.params)
        self._registry: tuple[tuple[str, str], ...] | None = None

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        from edgekit.compress import STEPS
        from edgekit.compress.plan import compress_options

        if self._registry != tuple(STEPS.items()):  # the registry as it is now (tests add steps)
            generated = [_step_option(o) for o in compress_options()]
            flags = {d for p in self._own for d in (*p.opts, *p.secondary_opts)}
            clash = sorted(flags & {d for p in generated for d in (*p.opts, *p.secondary_opts)})
            if clash:
                raise TypeError(f"step options {clash} are also options of `{self.name}` itself")
            at = next(i for i, p in enumerate(self._own) if p.name == self._after) + 1
            self.params = [*self._own[:at], *generated, *self._own[at:]]
            self._registry = tuple(STEPS.items())
        return super().get_params(ctx)


def _step_option(o: Any) -> click.Option:
    """The click option of a step option (``edgekit.compress.options.StepOption``)."""
    if o.is_pair:
        return click.Option([o.dest, *o.decls], default=None, help=o.help or None)
    return click.Option([o.dest, *o.decls], type=o.type, multiple=o.multiple, default=() if o.multiple else None,
                        help=o.help or None)


@cli.command(cls=StepOptionsCommand)
@click.argument("model")
@click.option("-o", "--out", required=True, type=click.Path(), help="Output folder (a compressed model).")
@click.option("--distill", is_flag=True, help="After pruning, distill from the unpruned model.")
@click.option("--calib", default=None, help="Calibration data (built-in name, folder, .npy/.npz, text file, entry point).")
@click.option("--train", "train_data", default=None, help="Training data for QAT / distillation.")
@click.option("--target", default=None, help="Target name or YAML (decides the INT8 Q/DQ scheme).")
@click.option("--seed", type=int, default=0, show_default=True)
@with_input_options("shapes", "inputs", "preprocess")
@click.option("--accept-quality-loss", is_flag=True, help="Write the model even when its quality against the float model is beyond the sanity bound (default: exit 1, nothing written).")
@click.option("--max-ppl-ratio", type=float, default=None, help="Quality gate: the compressed model's perplexity may be at most this many times the float model's (default 1.5 at 4 bits, 1.1 at 8 bits).")
@click.option("--json", "as_json", is_flag=True, help="Print the result (folder, steps, metrics) as JSON.")
def compress(model: str, out: str, distill: bool, calib: str | None, train_data: str | None, target: str | None,
             seed: int, input_options: Any, accept_quality_loss: bool, max_ppl_ratio: float | None, as_json: bool,
             **step_flags: Any) -> None:
    """Compress MODEL: INT8 PTQ/QAT, 4-bit GPTQ/AWQ/RTN, structured pruning, distillation.

    The step options below come from the steps' configs; a recipe names the same fields.
    The result is measured against the float model on held-out data (perplexity ratio,
    agreement, cosine); beyond the sanity bound the command exits 1 and writes nothing."""
    from edgekit.compress.plan import compress_from_flags
    from edgekit.measure import engine_latency

    with _json_stdout(as_json):
        folder = compress_from_flags(model, out, step_flags, distill=distill, calib=calib, train=train_data, target=target,
                                     seed=seed, inputs=input_options, accept_quality_loss=accept_quality_loss,
                                     max_ppl_ratio=max_ppl_ratio, latency=engine_latency)
    from edgekit.artifact import read_manifest

    m = read_manifest(folder)
    steps = [s["name"] for s in m.steps]
    if as_json:
        _print_json({"folder": str(folder), "steps": steps, "metrics": m.metrics})
        return
    rows = _flat_rows(m.metrics)
    if rows:
        _console().print(_table("compression metrics", ["metric", "value"], rows))
    click.echo(f"wrote {folder} ({' -> '.join(steps)})")


# --- distill ---

@cli.command("distill")
@click.option("--teacher", required=True, help="Teacher model (any model spec or artifact folder).")
@click.option("--student", required=True, help="Student model (e.g. a pruned artifact folder or a smaller model).")
@click.option("--data", default=None, help="Training data (built-in name, .npz, text file...; default: the student's).")
@click.option("--eval", "eval_data", default=None, help="Evaluation data (default: the eval split of --data).")
@click.option("-o", "--out", required=True, type=click.Path(), help="Output folder (a model artifact).")
@click.option("--temperature", type=float, default=4.0, show_default=True)
@click.option("--alpha", type=float, default=0.7, show_default=True, help="Weight of the soft (teacher) loss.")
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--batch-size", type=int, default=64, show_default=True)
@click.option("--feature-loss", is_flag=True, help="Also match the features entering the output layer.")
@click.option("--patience", type=int, default=2, show_default=True, help="Early stop after N epochs without improvement.")
@click.option("--max-steps", type=int, default=None, help="Cap on optimizer steps.")
@click.option("--limit", type=int, default=None, help="At most this many training samples.")
@click.option("--seqlen", type=int, default=128, show_default=True, help="Token window for text data.")
@click.option("--seed", type=int, default=0, show_default=True)
@_json_flag("the folder, the training history and the final evaluation")
def distill_command(teacher: str, student: str, data: str | None, eval_data: str | None, out: str,
                    temperature: float, alpha: float, epochs: int, lr: float, batch_size: int, feature_loss: bool,
                    patience: int, max_steps: int | None, limit: int | None, seqlen: int, seed: int,
                    as_json: bool) -> None:
    """Distill TEACHER into STUDENT: temperature-scaled KD loss (x T^2) plus the hard-label loss.
    Checkpoints go to OUT.work; running the same command again resumes."""
    from edgekit.artifact import read_manifest
    from edgekit.compress.distill import DistillConfig, distill

    config = DistillConfig(temperature=temperature, alpha=alpha, epochs=epochs, lr=lr, batch_size=batch_size,
                           feature_loss=feature_loss, seed=seed, patience=patience, max_steps=max_steps,
                           limit=limit, seqlen=seqlen)
    with _json_stdout(as_json):
        distill(teacher, student, data, config, out, eval_data=eval_data)
    m = read_manifest(Path(out))
    meta = m.steps[-1]["meta"] if m.steps else {}
    if as_json:
        _print_json({"folder": out, "steps": [s["name"] for s in m.steps], "validation": meta.get("validation"),
                     "history": meta.get("fit", {}).get("history", []), "eval": meta.get("eval", {}),
                     "metrics": m.metrics})
        return
    rows = [[e["epoch"] + 1, f"{e['train_loss']:.4f}", f"{e.get('val', float('nan')):.4f}", e["seconds"]]
            for e in meta.get("fit", {}).get("history", [])]
    _console().print(_table(f"distillation ({meta.get('validation')} on validation)",
                            ["epoch", "train loss", "validation", "s"], rows))
    ev = meta.get("eval", {})
    if ev:
        _console().print(_table("final evaluation", ["metric", "value"], _flat_rows(ev)))
    click.echo(f"wrote {out} ({' -> '.join(s['name'] for s in m.steps)})")


# --- pipelines: run and sweep ---

@cli.command("run")
@click.argument("recipe", type=click.Path())
@click.option("-o", "--out", "run_dir", type=click.Path(), default=None, help="Run folder (default runs/<recipe name>).")
@click.option("--dry-run", is_flag=True, help="Validate the recipe and print the resolved plan; run nothing.")
@click.option("--force", is_flag=True, help="Rebuild every cached step.")
@click.option("--remeasure", is_flag=True, help="Time the cached engines again (stage profiles and frames) without "
              "rebuilding anything.")
@click.option("--cache", "cache_dir", type=click.Path(), default=None, help="Shared cache folder (default RUN_DIR/cache).")
@click.option("--wait", is_flag=True, help="When another edgekit run is using the run folder, wait for it instead of "
              "exiting with status 2.")
@_json_flag("the results (what results.json holds; with --dry-run, the plan)")
def run_cmd(recipe: str, run_dir: str | None, dry_run: bool, force: bool, remeasure: bool, cache_dir: str | None,
            wait: bool, as_json: bool) -> int:
    """Run a multi-stage recipe: per-stage profile and budget, exit 1 when a budget or gate fails."""
    from edgekit.pipelines.recipe import load_recipe
    from edgekit.pipelines.run import STAGE_COLUMNS, check_run_folders, plan, run_recipe, stage_table, target_verdict

    parsed = load_recipe(recipe)
    if dry_run:
        check_run_folders(parsed, run_dir or Path("runs") / parsed.name, cache_dir)  # what the run would refuse
        if as_json:
            _print_json({"recipe": parsed.name, "plan": plan(parsed), "budget_ms": parsed.budget_ms,
                         "percentile": parsed.percentile})
            return 0
        for row in plan(parsed):
            budget = "" if row["budget_ms"] is None else f" [budget {row['budget_ms']:g} ms]"
            par = f" (parallel with {', '.join(row['parallel_with'])})" if row["parallel_with"] else ""
            click.echo(f"{row['target']} / {row['stage']}{budget}{par}: " + " -> ".join(row["actions"]))
        click.echo(f"plan OK: {len(parsed.stages)} stages x {len(parsed.targets)} target(s); end-to-end budget "
                   f"{parsed.budget_ms if parsed.budget_ms is not None else '-'} ms at {parsed.percentile}")
        return 0
    with _json_stdout(as_json):
        result = run_recipe(parsed, run_dir or Path("runs") / parsed.name, cache_dir=cache_dir, force=force,
                            wait=wait, remeasure=remeasure)
    if as_json:
        _print_json(result.to_dict())
        return 0 if result.passed else 1
    _console().print(_table(f"recipe {parsed.name}", STAGE_COLUMNS, stage_table(result)))
    for name, t in result.targets.items():
        click.echo(f"{name}: {target_verdict(t, percentile=result.percentile)}")
    for r in result.stages:
        for g in r.gates:
            click.echo(f"{r.target}/{r.stage}: {g['metric']} {g['value']:.4f} "
                       f"{'>=' if 'min' in g else '<='} {g.get('min', g.get('max'))}: {'PASS' if g['passed'] else 'FAIL'}")
    click.echo(f"{'PASS' if result.passed else 'FAIL'}; wrote {result.run_dir}/results.json, junit.xml, summary.md, report.html")
    return 0 if result.passed else 1


@cli.command()
@click.argument("recipe", type=click.Path())
@click.option("--grid", multiple=True, help="STEP.FIELD=v1,v2 (repeatable); every combination runs.")
@click.option("--list", "combo_list", multiple=True, help="One combination 'k=v,k2=v2' (repeatable), instead of a grid.")
@click.option("-o", "--out", type=click.Path(), default=None, help="Sweep folder (default runs/<recipe>-sweep).")
@click.option("--jobs", type=int, default=1, show_default=True, help="Parallel local processes (at most the cores).")
@click.option("--max-points", type=int, default=None, help="Refuse grids of more points than this (default 256).")
@click.option("--executor", type=click.Choice(["local", "process", "ray"]), default="local", show_default=True)
@click.option("--address", default=None, help="Ray cluster HOST:PORT (with --executor ray).")
@click.option("--force", is_flag=True)
@_json_flag("the rows (what sweep.json holds)")
def sweep(recipe: str, grid: tuple[str, ...], combo_list: tuple[str, ...], out: str | None, jobs: int,
          max_points: int | None, executor: str, address: str | None, force: bool, as_json: bool) -> None:
    """Run a recipe over a grid of settings; table, Pareto frontier, plots and HTML."""
    from edgekit.pipelines.sweep import DEFAULT_MAX_POINTS, SWEEP_COLUMNS, parse_value, run_sweep, sweep_table

    combos = None
    if combo_list:
        combos = []
        for item in combo_list:
            pairs = [p.split("=", 1) for p in item.split(",") if p.strip()]
            if any(len(p) != 2 for p in pairs):
                raise BadInputError(f"--list {item!r} must look like 'step.field=v,other.field=w'")
            combos.append({k.strip(): parse_value(v) for k, v in pairs})
    folder = Path(out) if out else Path("runs") / f"{Path(recipe).stem}-sweep"
    with _json_stdout(as_json):
        rows = run_sweep(recipe, list(grid), folder, combos=combos, jobs=jobs, executor=executor, address=address,
                         force=force, max_points=max_points or DEFAULT_MAX_POINTS,
                         announce=lambda line: click.echo(line, err=True))
    if as_json:
        _print_json({"folder": str(folder), "rows": [dataclasses.asdict(r) for r in rows]})
        return
    _console().print(_table(f"sweep {Path(recipe).name}", SWEEP_COLUMNS, sweep_table(rows)))
    click.echo(f"wrote {folder}/sweep.json, sweep.md, sweep.html and plots")


# --- targets, TensorRT and remote devices ---

@cli.group("targets", invoke_without_command=True)
@_json_flag("the targets")
@click.option("--probe", is_flag=True, help="Measure this machine now (kernel rates of ONNX Runtime at 1 thread, "
              "memory and L2 bandwidth, caches, per-node overhead) for the `cpu` target, and cache it.")
@click.pass_context
def targets_group(ctx: click.Context, as_json: bool, probe: bool) -> None:
    """List the built-in targets (`edgekit targets` or `edgekit targets list`), or show one
    (`edgekit targets show NAME`). `--probe` measures this machine for the `cpu` target
    (the first `edgekit estimate --target cpu` does so once by itself); the result is cached
    per machine and used until `--probe` measures again."""
    if probe:
        if ctx.invoked_subcommand is not None:
            raise BadInputError(f"--probe is an option of `edgekit targets` alone, not of `targets "
                                f"{ctx.invoked_subcommand}` (run `edgekit targets --probe`)")
        _probe(as_json)
    elif ctx.invoked_subcommand is None:
        _list_targets(as_json)


def _probe(as_json: bool) -> None:
    from edgekit.estimate.probe import describe, probe_machine

    with _json_stdout(as_json):
        probed = probe_machine(refresh=True)
    if as_json:
        _print_json({**probed.probe.to_dict(), "path": str(probed.path)})
        return
    _console().print(_table("this machine, measured for the cpu target (one thread)", ["figure", "value"],
                            [list(r) for r in describe(probed)]))


@targets_group.command("list")
@_json_flag("the targets")
def targets_list(as_json: bool) -> None:
    """List the built-in targets: dense peaks, memory, DLA cores, TensorRT versions, runtimes."""
    _list_targets(as_json)


def _list_targets(as_json: bool) -> None:
    from edgekit.targets import list_targets, load_target

    if as_json:
        _print_json([load_target(name).to_dict() for name in list_targets()])
        return
    header = ("name", "kind", "SM", "INT8", "FP16", "GB/s", "GB", "DLA", "TensorRT", "runtimes")
    rows = [header]
    for name in list_targets():
        t = load_target(name)
        rows.append((name, t.kind, t.sm or "-", f"{t.peak_tops.get('int8', 0):g}", f"{t.peak_tops.get('fp16', 0):g}",
                     f"{t.memory_bandwidth_gbs:g}", f"{t.memory_gb:g}", str(t.dla_cores or "-"),
                     t.tensorrt_versions or "-", ",".join(t.runtimes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    click.echo("targets: dense peaks (INT8 TOPS, FP16 TFLOPS), memory bandwidth GB/s and size GB")
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


@targets_group.command("show")
@click.argument("name")
@_json_flag("the target")
def targets_show(name: str, as_json: bool) -> None:
    """Print one target (a built-in name or a YAML file) with the source of its numbers."""
    from edgekit.targets import load_target

    t = load_target(name)
    d = t.to_dict()
    if as_json:
        _print_json(d)
        return
    rows = _flat_rows({k: v for k, v in d.items() if k not in ("provenance", "sources") and v not in (None, (), [], {})})
    _console().print(_table(f"{t.name}: {t.description}", ["field", "value"], rows))
    if t.provenance:
        _console().print(_table("where the numbers come from", ["field", "source"], [[k, v] for k, v in t.provenance.items()]))
    for s in t.sources:
        click.echo(f"source: {s}")


def _remote_host(host: str, port: int | None, identity: str | None, ssh_option: tuple[str, ...],
                 remote_edgekit: str | None, timeout: float) -> Any:
    from edgekit.remote import RemoteHost

    return RemoteHost.from_options(host, {"ssh_port": port, "ssh_identity": identity, "ssh_options": list(ssh_option),
                                          "remote_edgekit": remote_edgekit, "build_timeout": timeout,
                                          "remote_timeout": timeout})


_remote_options = [
    click.option("--host", required=True, help="user@host[:port] of the device."),
    click.option("--port", type=int, default=None, help="SSH port."),
    click.option("-i", "--identity", default=None, help="SSH private key."),
    click.option("--ssh-option", multiple=True, help="Extra ssh -o Key=Value (repeatable)."),
    click.option("--remote-edgekit", default=None, help="The edgekit command on the device (default: edgekit)."),
    click.option("--timeout", type=float, default=3600.0, show_default=True, help="Seconds for the remote command."),
]


def _with_remote_options(f: Any) -> Any:
    for opt in reversed(_remote_options):
        f = opt(f)
    return f


@cli.group("remote")
def remote_group() -> None:
    """Build or profile on another machine over SSH (edgekit must be installed there)."""


@remote_group.command("build")
@click.argument("model")
@click.option("--target", required=True, help="Target name or YAML file.")
@click.option("-o", "--out", required=True, type=click.Path(), help="Local engine folder to fetch into.")
@click.option("--precision", default=None)
@click.option("--runtime", default=None)
@click.option("--threads", type=int, default=None)
@_with_remote_options
def remote_build_cmd(model: str, target: str, out: str, precision: str | None, runtime: str | None,
                     threads: int | None, host: str, port: int | None, identity: str | None,
                     ssh_option: tuple[str, ...], remote_edgekit: str | None, timeout: float) -> None:
    """Run `edgekit build` on the device and fetch the engine folder (sha256-verified)."""
    from edgekit.remote import remote_build

    h = _remote_host(host, port, identity, ssh_option, remote_edgekit, timeout)
    folder = remote_build(model, target, out, h, precision=precision, runtime=runtime, threads=threads)
    click.echo(f"built on {host}; fetched into {folder}")


@remote_group.command("profile")
@click.argument("engine_dir", type=click.Path())
@_json_file_or_stdout("the profile JSON")
@click.option("--duration-s", type=float, default=None)
@click.option("--iterations", type=int, default=None)
@_with_remote_options
def remote_profile_cmd(engine_dir: str, json_out: str | None, duration_s: float | None, iterations: int | None,
                       host: str, port: int | None, identity: str | None, ssh_option: tuple[str, ...],
                       remote_edgekit: str | None, timeout: float) -> None:
    """Upload ENGINE_DIR, run `edgekit profile` on the device, fetch the profile."""
    from edgekit.remote import remote_profile

    h = _remote_host(host, port, identity, ssh_option, remote_edgekit, timeout)
    args = (["--duration-s", str(duration_s)] if duration_s is not None else []) + \
        (["--iterations", str(iterations)] if iterations is not None else [])
    file = None if json_out == "-" else json_out
    with _json_stdout(json_out == "-"):
        result = remote_profile(engine_dir, h, json_out=file, extra_args=args)
    if json_out == "-":
        _print_json(result.to_dict())
        return
    _print_profile(result, 10)
    if file:
        click.echo(f"wrote {file}")


# --- estimate ---

@cli.command("estimate")
@click.argument("model")
@click.option("--target", required=True, help="Target name or YAML file (`edgekit targets` lists them).")
@click.option("--precision", default=None, help="fp32 | fp16 | bf16 | int8 | int4 ... (default: the graph's own).")
@click.option("--batch", type=click.IntRange(1, MAX_DIM), default=1, show_default=True)
@click.option("--dim", "dims", multiple=True, help="Bind a dynamic axis: NAME=VALUE (repeatable).")
@click.option("--runtime", default=None, help="Whose fusions to apply: tensorrt | onnxruntime | none "
              "(default: the target's first runtime).")
@click.option("--calibrate", is_flag=True, help="First measure the model here and fit the target's efficiency factors.")
@click.option("--timing", type=click.Choice(["gpu-compute", "end-to-end"]), default="gpu-compute", show_default=True,
              help="What the total stands for: the engine's kernels (trtexec's GPU Compute Time, MLPerf's harness), or "
                   "end to end through a Python predictor with host copies of inputs and outputs (Ultralytics' "
                   "benchmark); both are estimated.")
@click.option("--top-k", type=int, default=10, show_default=True)
@_json_file_or_stdout("the estimate JSON")
@with_input_options("shapes", "inputs")
def estimate_cmd(model: str, target: str, precision: str | None, batch: int, dims: tuple[str, ...],
                 runtime: str | None, calibrate: bool, timing: str, top_k: int, json_out: str | None,
                 input_options: Any) -> None:
    """Latency ESTIMATE of a model on a target, with its range (not a measurement).

    The graph is read as the target's runtime runs it (its fusions), costed kernel by
    kernel against the target's roofs; the range comes from the estimator's validation
    errors on that target and operator mix (JSON: total_ms, low_ms, high_ms, basis)."""
    from edgekit.estimate.calibrate import estimate_with_calibration

    bound: dict[str, int] = {}
    for d in dims:
        name, _, value = d.partition("=")
        if not name or not value.strip().lstrip("-").isdigit() or not 0 <= int(value) <= MAX_DIM:
            raise BadInputError(f"--dim {d!r} must be NAME=VALUE with a whole number VALUE from 0 to {MAX_DIM} (0: an "
                                "empty axis, such as past_sequence_length=0 for a prefill)")
        bound[name] = int(value)
    with _json_stdout(json_out == "-"):
        est, report = estimate_with_calibration(model, target, precision=precision, batch=batch, dims=bound,
                                                calibrate=calibrate, runtime=runtime, input_options=input_options,
                                                timing=timing)
    doc = {**est.to_dict(), "calibration_report": report.to_dict() if report else None}
    if json_out == "-":
        _print_json(doc)
        return
    if report is not None:
        click.echo(report.render())
        click.echo("")
    click.echo(est.render(top_k))
    if json_out:
        from edgekit.artifact import atomic_write_json

        atomic_write_json(json_out, doc, protect=(model,))
        click.echo(f"wrote {json_out}")


# --- finetune ---

@cli.command()
@click.argument("model")
@click.option("-o", "--out", required=True, type=click.Path(), help="Output folder (a fine-tuned model).")
@click.option("--data", default=None, help="Training data (built-in name, folder, .npz, text file, entry point); "
              "default: the model's.")
@click.option("--eval-data", default=None, help="Validation data (default: the eval split of --data or the model's).")
@click.option("--lora-r", "r", type=int, default=8, show_default=True, help="Adapter rank.")
@click.option("--lora-alpha", "alpha", type=float, default=16.0, show_default=True, help="Scale numerator (scale = alpha / r).")
@click.option("--lora-dropout", "dropout", type=float, default=0.05, show_default=True)
@click.option("--targets", default=None, help="Comma-separated module names, suffixes or regexes "
              "(default: q/k/v/o/gate/up/down for transformers, every Linear/Conv2d otherwise).")
@click.option("--epochs", type=int, default=None, help="Training epochs (default 1 when --steps is not given).")
@click.option("--steps", type=int, default=None, help="Training steps (instead of --epochs).")
@click.option("--lr", type=float, default=2e-4, show_default=True)
@click.option("--batch-size", type=int, default=4, show_default=True)
@click.option("--seqlen", type=int, default=256, show_default=True, help="Token window for language models.")
@click.option("--train-samples", type=int, default=None, help="Use only this many training samples/windows.")
@click.option("--eval-samples", type=int, default=32, show_default=True, help="Validation samples/windows.")
@click.option("--qlora", is_flag=True, help="Train adapters over a frozen 4-bit base (the output of compress --bits 4).")
@click.option("--qlora-base", type=click.Choice(["packed", "nf4"]), default="packed", show_default=True,
              help="packed: edgekit's int4 model; nf4: bitsandbytes NF4 from a float model.")
@click.option("--merge/--no-merge", default=None, help="Fold adapters into the weights (default: yes for float and "
              "nf4; no for a packed base, whose adapters export as MatMuls beside MatMulNBits).")
@click.option("--requant", type=click.Choice(["int4", "int8"]), default=None,
              help="Re-quantize the merged float model with this step.")
@click.option("--bits", type=int, default=None, help="--requant int4: bit width (default 4).")
@click.option("--method", default=None, help="--requant int4: gptq | awq | rtn; int8: ptq.")
@click.option("--group-size", type=int, default=None, help="--requant int4: group size.")
@click.option("--checkpoint-every", type=int, default=50, show_default=True, help="Steps between checkpoints (0: none).")
@click.option("--resume/--fresh", default=True, show_default=True, help="Continue from OUT.work's checkpoint if it matches.")
@click.option("--seed", type=int, default=0, show_default=True)
@_json_flag("the folder, the steps and the metrics")
def finetune(model: str, out: str, data: str | None, eval_data: str | None, r: int, alpha: float, dropout: float,
             targets: str | None, epochs: int | None, steps: int | None, lr: float, batch_size: int, seqlen: int,
             train_samples: int | None, eval_samples: int, qlora: bool, qlora_base: str, merge: bool | None,
             requant: str | None, bits: int | None, method: str | None, group_size: int | None,
             checkpoint_every: int, resume: bool, seed: int, as_json: bool) -> None:
    """LoRA / QLoRA fine-tune MODEL (zoo name, file, or a compress output folder) on --data."""
    from edgekit.artifact import read_manifest
    from edgekit.finetune import finetune as run_finetune

    config = {"r": r, "alpha": alpha, "dropout": dropout, "targets": tuple(t for t in (targets or "").split(",") if t),
              "epochs": epochs, "steps": steps, "lr": lr, "batch_size": batch_size, "seqlen": seqlen,
              "train_samples": train_samples, "eval_samples": eval_samples, "qlora": qlora, "qlora_base": qlora_base,
              "merge": merge, "checkpoint_every": checkpoint_every}
    requant_config: dict[str, Any] = {}
    if requant == "int4":
        requant_config = {k: v for k, v in (("bits", bits), ("method", method), ("group_size", group_size))
                          if v is not None}
    elif requant == "int8" and method is not None:
        requant_config = {"method": method}
    with _json_stdout(as_json):
        folder = run_finetune(model, data, config, out, eval_data=eval_data, requant=requant,
                              requant_config=requant_config, seed=seed, resume=resume)
    m = read_manifest(folder)
    if as_json:
        _print_json({"folder": str(folder), "steps": [s["name"] for s in m.steps], "metrics": m.metrics})
        return
    lm = m.metrics.get("lora", {})
    rows = []
    for key in ("before", "after", "after_merge"):
        if key in lm:
            rows.append([key.replace("_", " "), *(f"{v:.4f}" for v in lm[key].values())])
    final = m.metrics.get("final") or {}
    metric = "perplexity" if "perplexity" in final else "accuracy" if "accuracy" in final else None
    if metric:
        rows.append([f"reloaded artifact ({metric})", "", f"{final[metric]:.4f}"])
    _console().print(_table(f"validation ({lm.get('eval_data')})", ["model", "loss", "metric"], rows))
    click.echo(f"trained {lm.get('trainable_params', 0):,} of {lm.get('total_params', 0):,} parameters "
               f"({lm.get('modules')} layers, {lm.get('steps')} steps, {lm.get('seconds_per_step')} s/step)")
    click.echo(f"wrote {folder} ({' -> '.join(s['name'] for s in m.steps)})")


def main() -> None:
    interrupts.install()
    try:
        cli()
    except SystemExit as e:
        if interrupts.is_interrupted_status(e.code):
            interrupts.exit_interrupted()
        raise
    except KeyboardInterrupt:  # Ctrl-C again before the first one was reported
        click.echo(f"error: {interrupts.interrupted_message()}", err=True)
        interrupts.exit_interrupted()


if __name__ == "__main__":
    main()
