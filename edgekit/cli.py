"""The ``edgekit`` command line. Each command parses, calls one API function, prints.

Exit codes: 0 ok; 1 a check failed (budget, parity, accuracy); 2 bad input or a missing
capability. Errors are one line on stderr, never a traceback.

A command imports the API it calls inside its function ("deferred:" names the heaviest package
that import loads: numpy, ONNX or torch), so that ``--help`` and every other command do not pay
for it; what is imported at the top is light (click and edgekit's own light modules).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from edgekit import __version__, interrupts
from edgekit.cli_options import (
    CALIB,
    DATA,
    EVAL_DATA,
    QUIET,
    SEED,
    TEACHER,
    VERBOSE,
    json_option,
    out_option,
    output_file,
    target_option,
    with_input_options,
)
from edgekit.errors import BadInputError, EdgekitError, os_error_message
from edgekit.options import ConfigOption, config_options, config_values, help_options
from edgekit.paths import has_journal_entries
from edgekit.progress import set_verbosity


class EdgekitGroup(click.Group):
    """Turns edgekit errors, OS errors, click usage errors and Ctrl-C into one line and an
    exit code (130 for Ctrl-C, also when a library swallowed the KeyboardInterrupt)."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        if has_journal_entries():  # staging folders of edgekit processes that were killed outright
            from edgekit.artifact import recover_abandoned_outputs  # deferred: numpy

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


# --- options: declared on the configs they set (edgekit.options), --help and --help-all, old names ---

HELP_ALL = "edgekit.help_all"  # ctx.meta key: --help-all asked for every option


class GeneratedOption(click.Option):
    """A flag generated from a config field: unset unless given (the config keeps its
    default, which the help shows), and ``basic`` or shown by ``--help-all`` only."""

    def __init__(self, decls: list[str], *, basic: bool, config_default: Any, **kwargs: Any) -> None:
        super().__init__(decls, **kwargs)
        self.basic = basic
        self.config_default = config_default

    def get_help_extra(self, ctx: click.Context) -> Any:
        extra = super().get_help_extra(ctx)
        d = self.config_default
        if d is not None and d != ():
            if isinstance(d, bool) and self.secondary_opts:
                extra["default"] = (self.opts if d else self.secondary_opts)[0].lstrip("-")
            elif isinstance(d, tuple):
                extra["default"] = ",".join(str(v) for v in d)
            else:
                extra["default"] = str(d)
        return extra


class OldChoices(click.Choice):
    """``choices``, as the help shows them, and ``old`` values still taken (a renamed step): passed
    on as given, for the config to map to the current value with its warning."""

    def __init__(self, choices: Sequence[str], old: Sequence[str] = ()) -> None:
        super().__init__(choices)
        self.old = tuple(old)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value if value in self.old else super().convert(value, param, ctx)


class DeprecatedOption(click.Option):
    """The old names of an option, accepted for one release: hidden from the help; given, they
    print one warning line naming the new flag and set the new option's value."""

    def __init__(self, decls: Sequence[str], *, new_dest: str, new_flag: str, **kwargs: Any) -> None:
        super().__init__(decls, hidden=True, **kwargs)
        self.new_dest, self.new_flag = new_dest, new_flag


def deprecated(*old: str, dest: str, new: str, **kwargs: Any) -> Any:
    """The old names ``old`` of the option ``new`` (parsed into ``dest``), as a decorator."""
    return click.option(f"deprecated_{dest}", *old, cls=DeprecatedOption, new_dest=dest, new_flag=new, **kwargs)


def _show_help_all(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        ctx.meta[HELP_ALL] = True
        click.echo(ctx.get_help(), color=ctx.color)
        ctx.exit()


class EdgekitCommand(click.Command):
    """Every edgekit command: ``--help`` shows its common options, ``--help-all`` every one
    (``advanced``: the names of its own options that only ``--help-all`` shows; a generated
    option says itself); old option names (``DeprecatedOption``) warn and map to the new."""

    def __init__(self, *args: Any, advanced: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.advanced = set(advanced)
        self.params.append(click.Option(["--help-all"], is_flag=True, expose_value=False, is_eager=True,
                                        callback=_show_help_all, help="Show every option (--help: the common ones)."))

    def is_advanced(self, param: click.Parameter) -> bool:
        if isinstance(param, GeneratedOption):
            return not param.basic
        return param.name in self.advanced

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        show_all = ctx.meta.get(HELP_ALL, False)
        rows, more = [], 0
        for p in self.get_params(ctx):
            record = p.get_help_record(ctx) if isinstance(p, click.Option) else None
            if record is None:
                continue
            if self.is_advanced(p) and not show_all:
                more += 1
                continue
            rows.append(record)
        if rows:
            with formatter.section("Options"):
                formatter.write_dl(rows)
        if more:
            formatter.write_paragraph()
            formatter.write_text(f"{more} more options: --help-all shows every one.")

    def invoke(self, ctx: click.Context) -> Any:
        for p in self.get_params(ctx):
            if not isinstance(p, DeprecatedOption) or p.name not in ctx.params:
                continue
            value = ctx.params.pop(p.name)
            if value is None or value == () or value is False:
                continue
            given = ctx.get_parameter_source(p.new_dest) == click.core.ParameterSource.COMMANDLINE
            if given or ctx.params.get(p.new_dest) not in (None, ()):
                raise BadInputError(f"{'/'.join(p.opts)} is the old name of {p.new_flag}; give {p.new_flag} alone")
            click.echo(f"warning: {'/'.join(p.opts)} is deprecated and goes away in the next release; use "
                       f"{p.new_flag}", err=True)
            ctx.params[p.new_dest] = value
        return super().invoke(ctx)


EdgekitGroup.command_class = EdgekitCommand
EdgekitGroup.group_class = type  # subgroups are EdgekitGroups, whose commands are EdgekitCommands


def _compress_options() -> list[ConfigOption]:
    from edgekit.compress.options import CompressOptions, compress_options  # deferred: numpy

    return [*compress_options(), *config_options([("compress", CompressOptions)], "compress")]


def _from_configs(command: str, *configs: tuple[str, str] | tuple[str, str, tuple[str, ...]]
                  ) -> Callable[[], list[ConfigOption]]:
    """The options of ``command`` declared on ``configs``: (name, "module:Class"), or (name,
    "module:Class", fields) for a command that offers only those fields of the config (`remote
    build`: three of BuildOptions')."""

    def generate() -> list[ConfigOption]:
        classes, only = [], {}
        for name, ref, *fields in configs:
            module, _, attr = ref.partition(":")
            classes.append((name, getattr(importlib.import_module(module), attr)))
            if fields:
                only[name] = set(fields[0])
        return [o for o in config_options(classes, command)
                if any(c not in only or f in only[c] for c, f, _ in o.fields)]

    return generate


_REMOTE = ("remote", "edgekit.ssh:RemoteOptions")
# command -> (the modules its options come from, how to generate them); each config names its own flags
GENERATED: dict[str, tuple[tuple[str, ...], Callable[[], list[ConfigOption]]]] = {
    "compress": (("edgekit.compress.options",), _compress_options),
    "distill": (("edgekit.compress.distill_config",),
                _from_configs("distill", ("training", "edgekit.compress.distill_config:DistillConfig"))),
    "finetune": (("edgekit.compress.lora.config", "edgekit.finetune_options"),
                 _from_configs("finetune", ("training", "edgekit.compress.lora.config:LoraConfig"),
                               ("finetune", "edgekit.finetune_options:FinetuneOptions"))),
    "export": (("edgekit.export.config",),
               _from_configs("export", ("export", "edgekit.export.config:ExportConfig"),
                             ("lm", "edgekit.export.config:CausalLMExportOptions"))),
    "estimate": (("edgekit.estimate.options",),
                 _from_configs("estimate", ("estimate", "edgekit.estimate.options:EstimateOptions"))),
    "lint": (("edgekit.runtimes.tensorrt.lint_options",),
             _from_configs("lint", ("lint", "edgekit.runtimes.tensorrt.lint_options:LintOptions"))),
    "sweep": (("edgekit.pipelines.sweep_options",),
              _from_configs("sweep", ("sweep", "edgekit.pipelines.sweep_options:SweepOptions"))),
    "report": (("edgekit.report_options",),
               _from_configs("report", ("report", "edgekit.report_options:ReportOptions"))),
    "remote build": (("edgekit.ssh", "edgekit.runtimes.build_options"),
                     _from_configs("remote build", ("build", "edgekit.runtimes.build_options:BuildOptions",
                                                    ("precision", "runtime", "threads")), _REMOTE)),
    "remote profile": (("edgekit.ssh", "edgekit.profiling_options"),
                       _from_configs("remote profile", ("profile", "edgekit.profiling_options:ProfileConfig",
                                                        ("duration_s", "iterations")), _REMOTE)),
    "check": (("edgekit.check_options",), _from_configs("check", ("check", "edgekit.check_options:CheckOptions"))),
    "run": (("edgekit.pipelines.run_options",),
            _from_configs("run", ("run", "edgekit.pipelines.run_options:RunOptions"))),
    "build": (("edgekit.runtimes.build_options",),
              _from_configs("build", ("options", "edgekit.runtimes.build_options:BuildOptions"),
                            ("extra", "edgekit.runtimes.build_options:BuildExtras"))),
    "profile": (("edgekit.profiling_options",),
                _from_configs("profile", ("options", "edgekit.profiling_options:ProfileOptions"),
                              ("profile", "edgekit.profiling_options:ProfileConfig"),
                              ("generation", "edgekit.profiling_options:GenerationConfig"))),
}


def _options_for(command: str, for_help: bool) -> list[ConfigOption]:
    """A generated command's options: to parse, from its configs. For its help (unless the
    configs are imported already): from the help cache (cheapest: no config module at all);
    without one, every command's are generated from their configs (light modules: no torch or
    ONNX) into a new cache."""
    modules, generate = GENERATED[command]
    if for_help and not all(m in sys.modules for m in modules):
        cached = help_options(lambda: {name: gen() for name, (_, gen) in GENERATED.items()})
        if command in cached:
            return cached[command]
    return generate()


class ConfigCommand(EdgekitCommand):
    """A command whose options are declared on its configs (``GENERATED``): they go after its
    own option named ``after``, and the command reads them with ``config_fields``."""

    def __init__(self, *args: Any, after: str = "out", key: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._after = after
        self.key = key or self.name  # its line in GENERATED ("remote build" for a subcommand)
        self._own = list(self.params)
        self.options: list[ConfigOption] | None = None

    def use_options(self, options: list[ConfigOption]) -> None:
        generated = [p for o in options for p in _click_options(o)]
        flags = {d for p in self._own for d in (*p.opts, *p.secondary_opts)}
        clash = sorted(flags & {d for p in generated for d in (*p.opts, *p.secondary_opts)})
        if clash:
            raise TypeError(f"config options {clash} are also options of `{self.name}` itself")
        at = next(i for i, p in enumerate(self._own) if p.name == self._after) + 1
        self.params = [*self._own[:at], *generated, *self._own[at:]]
        self.options = options

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        before_dashes = args[:args.index("--")] if "--" in args else args
        assert self.key is not None
        if any(a in ("-h", "--help", "--help-all") for a in before_dashes):
            self.use_options(_options_for(self.key, for_help=True))
            super().parse_args(ctx, list(args))  # shows the help and exits, unless "-h" was a value (--data -h)
            ctx.params.clear()
        self.use_options(_options_for(self.key, for_help=False))  # the options that know their config fields
        return super().parse_args(ctx, args)

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if self.options is None:
            assert self.key is not None
            self.use_options(_options_for(self.key, for_help=False))
        return super().get_params(ctx)

    def invoke(self, ctx: click.Context) -> Any:
        for o in self.options or ():
            if o.sep and ctx.params.get(o.dest) is not None:
                ctx.params[o.dest] = _split(o, ctx.params[o.dest])
        return super().invoke(ctx)


def _split(o: ConfigOption, text: str) -> tuple[Any, ...]:
    """``--prompt-lengths 128,512``: one value split into the field's tuple."""
    what = {int: "whole numbers", float: "numbers", str: "names"}[o.type]
    what = f"comma-separated {what}" if o.sep == "," else f"{what} separated by {o.sep!r}"
    try:
        values = tuple(o.type(v.strip()) for v in text.split(o.sep) if v.strip())
    except ValueError:
        raise BadInputError(f"{o.decls[0]} takes {what}, got {text!r}") from None
    if not values:
        raise BadInputError(f"{o.decls[0]} takes {what}, got {text!r}")
    return values


def _click_options(o: ConfigOption) -> list[click.Option]:
    """The click options of a config option: its flag, and its old names if it has any."""
    common: dict[str, Any] = {"help": o.help or None, "basic": o.basic, "config_default": o.default}
    if o.is_pair:
        return [GeneratedOption([o.dest, *o.decls], default=None, **common)]
    kind: Any = OldChoices(o.choices, o.old_choices) if o.choices else str if o.sep else o.type
    if o.bounds is not None and o.type in (int, float):
        low, high = o.bounds
        kind = click.IntRange(int(low), int(high)) if o.type is int else click.FloatRange(low, high)
    multiple = o.multiple and not o.sep
    shape: dict[str, Any] = {"type": kind, "multiple": multiple, "default": () if multiple else None}
    if o.metavar:
        shape["metavar"] = o.metavar
    opts: list[click.Option] = [GeneratedOption([o.dest, *o.decls], **shape, **common)]
    if o.deprecated:
        opts.append(DeprecatedOption([f"deprecated_{o.dest}", *o.deprecated], new_dest=o.dest, new_flag=o.decls[0],
                                     **shape))
    return opts


def config_fields(config: str, flags: dict[str, Any]) -> dict[str, Any]:
    """The fields of the config named ``config`` that the command's given flags set (the
    others keep the config's defaults)."""
    cmd = click.get_current_context().command
    assert isinstance(cmd, ConfigCommand) and cmd.options is not None
    return config_values(cmd.options, flags, config)


def flags_of_steps(flags: dict[str, Any]) -> dict[str, Any]:
    """``compress``'s flags without those of ``CompressOptions`` (config "compress"): the steps'."""
    cmd = click.get_current_context().command
    assert isinstance(cmd, ConfigCommand) and cmd.options is not None
    own = {o.dest for o in cmd.options if all(name == "compress" for name, _, _ in o.fields)}
    return {k: v for k, v in flags.items() if k not in own}


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


def _print_json(doc: Any) -> None:
    """The one JSON document of ``--json`` on stdout."""
    click.echo(json.dumps(doc, indent=2, default=str))


def _json_done(doc: Any, json_out: str | None) -> bool:
    """``--json [FILE]``: print ``doc`` (then the command prints nothing else: True) or write it
    to FILE (then the tables follow: False); without --json nothing (False)."""
    if json_out == "-":
        _print_json(doc)
        return True
    if json_out:
        from edgekit.artifact import atomic_write_json  # deferred: numpy

        atomic_write_json(json_out, json.loads(json.dumps(doc, default=str)))
        click.echo(f"wrote {json_out}")
    return False


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
@QUIET
@VERBOSE
def cli(quiet: bool, verbose: bool) -> None:
    """edgekit: compress a PyTorch model, export it to ONNX, build an engine for a target,
    profile it and check it against a latency budget.

    Long work reports progress: rich bars on a terminal; in a log, one line per phase and
    one at least every 30 s with the elapsed time and an estimate of what remains."""
    if quiet and verbose:
        raise click.UsageError("--quiet and --verbose contradict each other; give one")
    set_verbosity(-1 if quiet else 1 if verbose else 0)


# --- export, build, profile, check, report ---

@cli.command()
@json_option("the models")
def zoo(json_out: str | None) -> None:
    """List the built-in models."""
    from edgekit.sources.zoo import DEFAULT_MODEL, ZOO  # deferred: torch

    if _json_done([{"name": name, "default": name == DEFAULT_MODEL, "kind": e.kind, "description": e.description,
                    "package": e.package} for name, e in ZOO.items()], json_out):
        return
    for name, e in ZOO.items():
        click.echo(f"{name}{' (default)' if name == DEFAULT_MODEL else ''}  [{e.kind}]  {e.description}; "
                   f"weights from {e.package}")


@cli.command(cls=ConfigCommand, advanced=("inputs_file",))
@click.argument("model")
@out_option("the ONNX artifact")
@with_input_options("shapes", "inputs")
@json_option("the folder, the ONNX file and the parity check")
def export(model: str, out: str, input_options: Any, json_out: str | None, **flags: Any) -> None:
    """Export MODEL (zoo name, file, entry point or output folder) to ONNX, checked against PyTorch.

    The options after --out are ExportConfig's (a recipe's export step names the same fields)
    and, for a causal LM's KV-cache export, CausalLMExportOptions'."""
    from edgekit.export.config import CausalLMExportOptions, ExportConfig  # deferred: numpy
    from edgekit.loading import export_onnx  # deferred: ONNX

    fields = config_fields("export", flags)
    config = ExportConfig(**fields)  # the values given are checked before anything is read or written
    lm = CausalLMExportOptions(**config_fields("lm", flags))
    if lm.kv_cache and input_options:
        raise BadInputError("--shapes and --inputs do not apply to the KV-cache export (it traces its own prefill "
                            "and decode steps); give them to build or profile")
    if lm.kv_cache:
        from edgekit.artifact import check_output_dir  # deferred: numpy
        from edgekit.export.config import LM_OPSET  # deferred: numpy
        from edgekit.export.lm import export_causal_lm  # deferred: torch
        from edgekit.loading import load_model  # deferred: ONNX

        if "dynamo" in fields:
            raise BadInputError("--dynamo/--legacy choose the exporter of a PyTorch model; the KV-cache export "
                                "uses optimum's (traced) or writes the fused graph")
        check_output_dir(out, (model,))  # before loading the model
        # the LM export's own defaults (opset 21, atol/rtol 2e-3) where a flag was not given
        lm_kwargs: dict[str, Any] = {k: fields[k] for k in ("atol", "rtol") if k in fields}
        if lm.accuracy_level is not None:
            lm_kwargs["accuracy_level"] = lm.accuracy_level
        with _json_stdout(json_out == "-"):
            handle = load_model(model)
            if handle.kind != "causal-lm":
                raise BadInputError(f"--kv-cache is for causal language models; {handle.name} is a {handle.kind!r} "
                                    "model")
            folder = export_causal_lm(handle, out, opset=fields.get("opset", LM_OPSET),
                                      parity=not fields.get("skip_parity", False), graph=lm.graph,
                                      block_size=lm.block_size, fmt=lm.weight_format, **lm_kwargs)
        _print_parity(folder, json_out)
        return
    with _json_stdout(json_out == "-"):
        folder = export_onnx(model, out, config, input_options)
    _print_parity(folder, json_out)


def _print_parity(folder: Path, json_out: str | None = None) -> None:
    from edgekit.artifact import read_manifest  # deferred: numpy

    m = read_manifest(folder)
    parity = m.metrics.get("parity") or {}
    if _json_done({"folder": str(folder), "onnx": str(m.path_of(folder, "onnx")), "parity": parity}, json_out):
        return
    outputs = parity.get("outputs") or {}
    if outputs:
        rows = [[name, f"{r.get('max_abs_error', 0):.3e}", f"{r.get('max_rel_error', 0):.3e}",
                 f"{r.get('atol', '-')}", f"{r.get('rtol', '-')}"] for name, r in outputs.items()]
        _console().print(_table("parity: ONNX Runtime vs PyTorch", ["output", "max abs err", "max rel err", "atol", "rtol"], rows))
    click.echo(f"wrote {m.path_of(folder, 'onnx')}")


@cli.command(cls=ConfigCommand, advanced=("shapes", "inputs_file"))
@click.argument("model")
@target_option(default="cpu", role="the device the engine is built for")
@out_option("the engine")
@with_input_options("shapes", "inputs")
@json_option("the engine folder, its config and metrics")
def build(model: str, target: str, out: str, input_options: Any, json_out: str | None, **flags: Any) -> None:
    """Build an engine for a target from a model, an ONNX file or a previous step's folder.

    The options after --out are BuildOptions' (and, for one runtime, BuildExtras'): a recipe's
    build step names the same fields."""
    from edgekit.build import build_engine  # deferred: ONNX
    from edgekit.runtimes.base import BuildOptions  # deferred: numpy

    options = BuildOptions(**config_fields("options", flags), extra=config_fields("extra", flags))
    with _json_stdout(json_out == "-"):
        folder = build_engine(model, target, out, options, input_options)
    from edgekit.artifact import read_manifest  # deferred: numpy

    m = read_manifest(folder)
    if _json_done({"folder": str(folder), "target": m.target, "files": m.files, "config": m.config,
                   "metrics": m.metrics}, json_out):
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


@cli.command(cls=ConfigCommand, after="engine_dir", advanced=("shapes", "inputs_file"))
@click.argument("engine_dir", type=click.Path(), required=False)
@json_option("the profile")
@with_input_options("shapes", "inputs")
def profile(engine_dir: str | None, json_out: str | None, input_options: Any, **flags: Any) -> None:
    """Measure latency percentiles and per-node times of an engine (the trtexec method); for a causal LM
    with a KV cache also time to first token, decode tokens/s and peak memory. With --trtexec DIR --onnx
    MODEL.onnx --target T: read trtexec exports made by hand, checked against the model and target."""
    from edgekit.profiling import ProfileConfig, profile_exports  # deferred: ONNX
    from edgekit.profiling_lm import GenerationConfig, profile_with_generation  # deferred: ONNX
    from edgekit.profiling_options import TRTEXEC_USAGE, ProfileOptions  # deferred: numpy

    o = ProfileOptions(**config_fields("options", flags))
    if o.reads_exports:
        assert o.trtexec is not None and o.onnx is not None and o.target is not None
        if engine_dir is not None:
            raise BadInputError(f"trtexec exports are read with {TRTEXEC_USAGE} (and no ENGINE_DIR)")
        if input_options is not None and input_options.inputs is not None:
            raise BadInputError("--inputs applies to engines timed here; with --trtexec give --shapes (the shapes "
                                "trtexec timed)")
        file = None if json_out == "-" else json_out
        top_k = ProfileConfig(**config_fields("profile", flags)).top_k
        with _json_stdout(json_out == "-"):
            result = profile_exports(o.trtexec, o.onnx, o.target, shapes=input_options.shapes if input_options
                                     else None, top_k=top_k, out_json=file)
        if json_out == "-":
            _print_json(result.to_dict())
            return
        _print_profile(result, top_k)
        if file:
            click.echo(f"wrote {file}")
        return
    if engine_dir is None:
        raise BadInputError(f"give an engine folder (edgekit profile ENGINE_DIR), or trtexec exports with "
                            f"{TRTEXEC_USAGE}")
    config = ProfileConfig(**config_fields("profile", flags))
    gen_config = GenerationConfig(**config_fields("generation", flags)) if o.generation else None
    file = None if json_out == "-" else json_out
    with _json_stdout(json_out == "-"):
        result = profile_with_generation(engine_dir, config, gen_config, out_json=file, input_options=input_options)
    if json_out == "-":
        _print_json(result.to_dict())
        return
    _print_profile(result, config.top_k)
    if result.generation:
        _print_generation(result.generation)
    if file:
        click.echo(f"wrote {file}")


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


@cli.command(cls=ConfigCommand, after="target")
@click.argument("model")
@target_option(required=True, role="one with the tensorrt runtime")
@json_option("the findings")
@with_input_options("shapes")
def lint(model: str, target: str, json_out: str | None, input_options: Any, **flags: Any) -> int:
    """Check an ONNX file (or an edgekit folder holding one) against the target's TensorRT, offline.
    --shapes / --axis give the optimization profile (else the folder's recorded one).
    Exit 0: nothing that would fail on the device; 1: findings that would; 2: bad input."""
    from edgekit.runtimes.tensorrt.lint import lint_model  # deferred: ONNX
    from edgekit.runtimes.tensorrt.lint_options import LintOptions  # deferred: numpy

    o = LintOptions(**config_fields("lint", flags))
    report = lint_model(model, target, tensorrt_version=o.tensorrt_version, dla_core=o.dla_core, precision=o.precision,
                        shapes=input_options.shapes if input_options else None, dims=o.axis_ranges())
    if _json_done(report.to_dict(), json_out):
        return report.exit_code
    if report.findings:
        _console().print(_table(f"TensorRT {report.tensorrt_version} findings", ["severity", "node", "op", "why",
                                                                                  "what to do", "rule from"],
                                [[f.severity, f.node, f.op_type, f.why, f.fix, f.source] for f in report.findings]))
    click.echo(report.summary())
    return report.exit_code


@cli.command(cls=ConfigCommand, after="profile")
@click.argument("profile", type=click.Path())
@json_option("the verdict")
def check(profile: str, json_out: str | None, **flags: Any) -> int:
    """Exit 0 when PROFILE (JSON or engine folder) meets the budget, 1 when it misses.

    The options are CheckOptions'."""
    from edgekit.check import check_budget, check_verified  # deferred: ONNX
    from edgekit.check_options import CheckOptions  # deferred: numpy
    from edgekit.profiling_lm import check_generation  # deferred: ONNX

    o = CheckOptions(**config_fields("check", flags))
    o.require_a_budget()
    verdicts: list[tuple[str, Any]] = []  # (key in the verdict JSON, verdict); the first is the record's top level
    if o.budget_ms is not None:
        verdicts.append(("budget", check_budget(profile, o.budget_ms, o.percentile, o.max_jitter,
                                                require_verified=o.require_verified)))
    if o.min_tokens_per_s is not None or o.max_ttft_ms is not None:
        verdicts.append(("generation", check_generation(profile, o.min_tokens_per_s, o.max_ttft_ms, o.percentile)))
    if o.require_verified and o.budget_ms is None:
        verdicts.append(("verified", check_verified(profile)))
    code = 0 if all(v.passed for _, v in verdicts) else 1
    if json_out:
        from edgekit.artifact import atomic_write_json  # deferred: numpy

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


@cli.command(cls=ConfigCommand, after="deprecated_out")
@click.argument("folder", type=click.Path())
@click.option("--markdown", "out", type=click.Path(), default=None, callback=output_file, metavar="FILE",
              help="The Markdown report (default FOLDER/report.md); its JSON goes beside it (FILE with .json).")
@deprecated("-o", "--out", dest="out", new="--markdown", type=click.Path(), callback=output_file)
@json_option("the report (what the JSON file holds)")
def report(folder: str, out: str | None, json_out: str | None, **flags: Any) -> None:
    """Render a Markdown and JSON report of a run folder.

    The options after --markdown are ReportOptions'."""
    from edgekit.report import render_report  # deferred: ONNX
    from edgekit.report_options import ReportOptions  # deferred: numpy

    o = ReportOptions(**config_fields("report", flags))
    with _json_stdout(json_out == "-"):
        path = render_report(folder, out, budget_ms=o.budget_ms, percentile=o.percentile, top_k=o.top_k)
    if _json_done(json.loads(path.with_suffix(".json").read_text()), json_out):
        return
    click.echo(path.read_text())
    click.echo(f"wrote {path} and {path.with_suffix('.json')}")


# --- compress ---

@cli.command(cls=ConfigCommand, advanced=("seed", "shapes", "inputs_file", "preprocess"))
@click.argument("model")
@out_option("the compressed model")
@CALIB
@DATA
@deprecated("--train", dest="data", new="--data")
@target_option(role="decides the INT8 Q/DQ scheme")
@SEED
@with_input_options("shapes", "inputs", "preprocess")
@json_option("the result (folder, steps, metrics)")
def compress(model: str, out: str, calib: str | None, data: str | None, target: str | None, seed: int,
             input_options: Any, json_out: str | None, **flags: Any) -> None:
    """Compress MODEL: INT8 PTQ/QAT, 4-bit GPTQ/AWQ/RTN, structured pruning, distillation.

    The step options below come from the steps' configs; a recipe names the same fields.
    The result is measured against the float model on held-out data (perplexity ratio,
    agreement, cosine); beyond the sanity bound the command exits 1 and writes nothing."""
    from edgekit.compress.options import CompressOptions  # deferred: numpy
    from edgekit.compress.plan import compress_from_flags  # deferred: torch
    from edgekit.measure import engine_latency  # deferred: ONNX

    o = CompressOptions(**config_fields("compress", flags))
    with _json_stdout(json_out == "-"):
        folder = compress_from_flags(model, out, flags_of_steps(flags), distill=o.distill, calib=calib, train=data,
                                     target=target, seed=seed, inputs=input_options,
                                     accept_quality_loss=o.accept_quality_loss, max_ppl_ratio=o.max_ppl_ratio,
                                     latency=engine_latency)
    from edgekit.artifact import read_manifest  # deferred: numpy

    m = read_manifest(folder)
    steps = [s["name"] for s in m.steps]
    if _json_done({"folder": str(folder), "steps": steps, "metrics": m.metrics}, json_out):
        return
    rows = _flat_rows(m.metrics)
    if rows:
        _console().print(_table("compression metrics", ["metric", "value"], rows))
    click.echo(f"wrote {folder} ({' -> '.join(steps)})")


# --- distill ---

@cli.command("distill", cls=ConfigCommand, advanced=("eval_data",))
@click.argument("model", required=False)
@TEACHER
@deprecated("--student", dest="model", new="MODEL (the first argument)")
@DATA
@EVAL_DATA
@deprecated("--eval", dest="eval_data", new="--eval-data")
@out_option("the distilled model")
@json_option("the folder, the training history and the final evaluation")
def distill_command(model: str | None, teacher: str, data: str | None, eval_data: str | None, out: str,
                    json_out: str | None, **flags: Any) -> None:
    """Distill TEACHER into MODEL (the student: e.g. a pruned artifact folder or a smaller model):
    temperature-scaled KD loss (x T^2) plus the hard-label loss. Checkpoints go to OUT.work;
    running the same command again resumes."""
    from edgekit.artifact import read_manifest  # deferred: numpy
    from edgekit.compress.distill import DistillConfig, distill  # deferred: torch

    if model is None:
        raise BadInputError("give the student model: edgekit distill MODEL --teacher TEACHER -o OUT")
    config = DistillConfig(**config_fields("training", flags))
    with _json_stdout(json_out == "-"):
        distill(teacher, model, data, config, out, eval_data=eval_data)
    m = read_manifest(Path(out))
    meta = m.steps[-1]["meta"] if m.steps else {}
    if _json_done({"folder": out, "steps": [s["name"] for s in m.steps], "validation": meta.get("validation"),
                   "history": meta.get("fit", {}).get("history", []), "eval": meta.get("eval", {}),
                   "metrics": m.metrics}, json_out):
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

@cli.command("run", cls=ConfigCommand)
@click.argument("recipe", type=click.Path())
@out_option("the run (results, reports, cached steps)", default="runs/<recipe name>")
@json_option("the results (what results.json holds; with --dry-run, the plan)")
def run_cmd(recipe: str, out: str | None, json_out: str | None, **flags: Any) -> int:
    """Run a multi-stage recipe: per-stage profile and budget, exit 1 when a budget or gate fails.

    The options after --dry-run are RunOptions'."""
    from edgekit.pipelines.recipe import load_recipe  # deferred: torch
    from edgekit.pipelines.run import (  # deferred: torch
        STAGE_COLUMNS,
        check_run_folders,
        plan,
        run_recipe,
        stage_table,
        target_verdict,
    )
    from edgekit.pipelines.run_options import RunOptions  # deferred: numpy

    o = RunOptions(**config_fields("run", flags))
    parsed = load_recipe(recipe)
    if o.dry_run:
        check_run_folders(parsed, out or Path("runs") / parsed.name, o.cache_dir)  # what the run would refuse
        if _json_done({"recipe": parsed.name, "plan": plan(parsed), "budget_ms": parsed.budget_ms,
                       "percentile": parsed.percentile}, json_out):
            return 0
        for row in plan(parsed):
            budget = "" if row["budget_ms"] is None else f" [budget {row['budget_ms']:g} ms]"
            par = f" (parallel with {', '.join(row['parallel_with'])})" if row["parallel_with"] else ""
            click.echo(f"{row['target']} / {row['stage']}{budget}{par}: " + " -> ".join(row["actions"]))
        click.echo(f"plan OK: {len(parsed.stages)} stages x {len(parsed.targets)} target(s); end-to-end budget "
                   f"{parsed.budget_ms if parsed.budget_ms is not None else '-'} ms at {parsed.percentile}")
        return 0
    with _json_stdout(json_out == "-"):
        result = run_recipe(parsed, out or Path("runs") / parsed.name, cache_dir=o.cache_dir, force=o.force,
                            wait=o.wait, remeasure=o.remeasure)
    if _json_done(result.to_dict(), json_out):
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


@cli.command(cls=ConfigCommand)
@click.argument("recipe", type=click.Path())
@out_option("the sweep (table, plots, HTML)", default="runs/<recipe>-sweep")
@json_option("the rows (what sweep.json holds)")
def sweep(recipe: str, out: str | None, json_out: str | None, **flags: Any) -> None:
    """Run a recipe over a grid of settings; table, Pareto frontier, plots and HTML.

    The options after --out are SweepOptions'."""
    from edgekit.pipelines.sweep import SWEEP_COLUMNS, run_sweep, sweep_table  # deferred: torch
    from edgekit.pipelines.sweep_options import SweepOptions  # deferred: numpy

    o = SweepOptions(**config_fields("sweep", flags))
    folder = Path(out) if out else Path("runs") / f"{Path(recipe).stem}-sweep"
    with _json_stdout(json_out == "-"):
        rows = run_sweep(recipe, list(o.grid), folder, combos=o.combinations(), jobs=o.jobs, executor=o.executor,
                         address=o.address, force=o.force, max_points=o.max_points,
                         announce=lambda line: click.echo(line, err=True))
    if _json_done({"folder": str(folder), "rows": [dataclasses.asdict(r) for r in rows]}, json_out):
        return
    _console().print(_table(f"sweep {Path(recipe).name}", SWEEP_COLUMNS, sweep_table(rows)))
    click.echo(f"wrote {folder}/sweep.json, sweep.md, sweep.html and plots")


# --- targets, TensorRT and remote devices ---

@cli.group("targets", invoke_without_command=True)
@json_option("the targets")
@click.option("--probe", is_flag=True, help="Measure this machine now (kernel rates of ONNX Runtime at 1 thread, "
              "memory and L2 bandwidth, caches, per-node overhead) for the `cpu` target, and cache it.")
@click.pass_context
def targets_group(ctx: click.Context, json_out: str | None, probe: bool) -> None:
    """List the built-in targets (`edgekit targets` or `edgekit targets list`), or show one
    (`edgekit targets show NAME`). `--probe` measures this machine for the `cpu` target
    (the first `edgekit estimate --target cpu` does so once by itself); the result is cached
    per machine and used until `--probe` measures again."""
    if json_out is not None and json_out in targets_group.commands and ctx.invoked_subcommand is None:
        raise BadInputError(f"--json takes a FILE, not the command {json_out!r}: put it after the command "
                            f"(edgekit targets {json_out} ... --json)")
    if probe:
        if ctx.invoked_subcommand is not None:
            raise BadInputError(f"--probe is an option of `edgekit targets` alone, not of `targets "
                                f"{ctx.invoked_subcommand}` (run `edgekit targets --probe`)")
        _probe(json_out)
    elif ctx.invoked_subcommand is None:
        _list_targets(json_out)


def _probe(json_out: str | None) -> None:
    from edgekit.estimate.probe import describe, probe_machine  # deferred: numpy

    with _json_stdout(json_out == "-"):
        probed = probe_machine(refresh=True)
    if _json_done({**probed.probe.to_dict(), "path": str(probed.path)}, json_out):
        return
    _console().print(_table("this machine, measured for the cpu target (one thread)", ["figure", "value"],
                            [list(r) for r in describe(probed)]))


@targets_group.command("list")
@json_option("the targets")
def targets_list(json_out: str | None) -> None:
    """List the built-in targets: dense peaks, memory, DLA cores, TensorRT versions, runtimes."""
    _list_targets(json_out)


def _list_targets(json_out: str | None) -> None:
    from edgekit.targets import list_targets, load_target  # deferred: numpy

    if _json_done([load_target(name).to_dict() for name in list_targets()], json_out):
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
@json_option("the target")
def targets_show(name: str, json_out: str | None) -> None:
    """Print one target (a built-in name or a YAML file) with the source of its numbers."""
    from edgekit.targets import load_target  # deferred: numpy

    t = load_target(name)
    d = t.to_dict()
    if _json_done(d, json_out):
        return
    rows = _flat_rows({k: v for k, v in d.items() if k not in ("provenance", "sources") and v not in (None, (), [], {})})
    _console().print(_table(f"{t.name}: {t.description}", ["field", "value"], rows))
    if t.provenance:
        _console().print(_table("where the numbers come from", ["field", "source"], [[k, v] for k, v in t.provenance.items()]))
    for s in t.sources:
        click.echo(f"source: {s}")


@cli.group("remote")
def remote_group() -> None:
    """Build or profile on another machine over SSH (edgekit must be installed there)."""


@remote_group.command("build", cls=ConfigCommand, key="remote build")
@click.argument("model")
@target_option(required=True, role="the device's")
@out_option("the engine, fetched from the device")
def remote_build_cmd(model: str, target: str, out: str, **flags: Any) -> None:
    """Run `edgekit build` on the device and fetch the engine folder (sha256-verified).

    The options after --out are BuildOptions' (given to `edgekit build` on the device) and
    RemoteOptions'."""
    from edgekit.remote import remote_build  # deferred: ONNX
    from edgekit.runtimes.build_options import BuildOptions  # deferred: numpy
    from edgekit.ssh import RemoteOptions  # deferred: numpy

    build = config_fields("build", flags)
    BuildOptions(**build)  # checked here, before connecting; the device's edgekit applies its defaults
    o = RemoteOptions(**config_fields("remote", flags))
    folder = remote_build(model, target, out, o.remote_host(), precision=build.get("precision"),
                          runtime=build.get("runtime"), threads=build.get("threads"))
    click.echo(f"built on {o.host}; fetched into {folder}")


@remote_group.command("profile", cls=ConfigCommand, key="remote profile", after="engine_dir")
@click.argument("engine_dir", type=click.Path())
@json_option("the profile")
def remote_profile_cmd(engine_dir: str, json_out: str | None, **flags: Any) -> None:
    """Upload ENGINE_DIR, run `edgekit profile` on the device, fetch the profile.

    The options are ProfileConfig's (given to `edgekit profile` on the device) and RemoteOptions'."""
    from edgekit.profiling_options import ProfileConfig  # deferred: numpy
    from edgekit.remote import remote_profile  # deferred: ONNX
    from edgekit.ssh import RemoteOptions  # deferred: numpy

    timing = config_fields("profile", flags)
    ProfileConfig(**timing)  # checked here, before connecting; the device's edgekit applies its defaults
    o = RemoteOptions(**config_fields("remote", flags))
    args = [a for name in ("duration_s", "iterations") if name in timing
            for a in (f"--{name.replace('_', '-')}", str(timing[name]))]
    file = None if json_out == "-" else json_out
    with _json_stdout(json_out == "-"):
        result = remote_profile(engine_dir, o.remote_host(), json_out=file, extra_args=args)
    if json_out == "-":
        _print_json(result.to_dict())
        return
    _print_profile(result, 10)
    if file:
        click.echo(f"wrote {file}")


# --- estimate ---

@cli.command("estimate", cls=ConfigCommand, after="target", advanced=("inputs_file",))
@click.argument("model")
@target_option(required=True, role="the device whose latency is estimated")
@json_option("the estimate")
@with_input_options("shapes", "inputs")
def estimate_cmd(model: str, target: str, json_out: str | None, input_options: Any, **flags: Any) -> None:
    """Latency ESTIMATE of a model on a target, with its range (not a measurement).

    The graph is read as the target's runtime runs it (its fusions), costed kernel by
    kernel against the target's roofs; the range comes from the estimator's validation
    errors on that target and operator mix (JSON: total_ms, low_ms, high_ms, basis).
    The options after --target are EstimateOptions'."""
    from edgekit.estimate.calibrate import estimate_with_calibration  # deferred: ONNX
    from edgekit.estimate.options import EstimateOptions  # deferred: numpy

    o = EstimateOptions(**config_fields("estimate", flags))
    with _json_stdout(json_out == "-"):
        est, report = estimate_with_calibration(model, target, precision=o.precision, batch=o.batch,
                                                dims=o.axis_sizes(), calibrate=o.calibrate, runtime=o.runtime,
                                                input_options=input_options, timing=o.timing)
    doc = {**est.to_dict(), "calibration_report": report.to_dict() if report else None}
    if json_out == "-":
        _print_json(doc)
        return
    if report is not None:
        click.echo(report.render())
        click.echo("")
    click.echo(est.render(o.top_k))
    if json_out:
        from edgekit.artifact import atomic_write_json  # deferred: numpy

        atomic_write_json(json_out, doc, protect=(model,))
        click.echo(f"wrote {json_out}")


# --- finetune ---

@cli.command(cls=ConfigCommand, after="eval_data", advanced=("eval_data", "seed"))
@click.argument("model")
@out_option("the fine-tuned model")
@DATA
@EVAL_DATA
@SEED
@json_option("the folder, the steps and the metrics")
def finetune(model: str, out: str, data: str | None, eval_data: str | None, seed: int, json_out: str | None,
             **flags: Any) -> None:
    """LoRA / QLoRA fine-tune MODEL (zoo name, file, or a compress output folder) on --data.

    The training options are LoraConfig's fields (a recipe's lora step names the same)."""
    from edgekit.artifact import read_manifest  # deferred: numpy
    from edgekit.compress import LORA_STEP  # deferred: numpy
    from edgekit.finetune import finetune as run_finetune  # deferred: torch
    from edgekit.finetune_options import FinetuneOptions  # deferred: numpy

    config = config_fields("training", flags)
    o = FinetuneOptions(**config_fields("finetune", flags))
    with _json_stdout(json_out == "-"):
        folder = run_finetune(model, data, config, out, eval_data=eval_data, requant=o.requant,
                              requant_config=o.requant_config(), seed=seed, resume=o.resume)
    m = read_manifest(folder)
    if _json_done({"folder": str(folder), "steps": [s["name"] for s in m.steps], "metrics": m.metrics}, json_out):
        return
    lm = m.metrics.get(LORA_STEP, {})
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
