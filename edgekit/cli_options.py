"""The command-line options that many commands share, declared once: the output folder
(``-o/--out``), the target, the data options (``--data``, ``--eval-data``, ``--calib``), the
teacher model, ``--seed``, ``--json [FILE]``, the model inputs (``--shapes``, ``--inputs``,
``--preprocess``) and ``-q/-v``. Every command that takes one uses the declaration here, so
its name, help and default are the same everywhere.

A command's own options are declared on the config dataclasses they set
(``edgekit.options``); this module holds what no single config owns. Light (click only):
building the command line imports nothing else.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

Decorator = Callable[[Any], Any]


def output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file named on the command line, checked before any work: a folder, a FIFO
    (no reader: the command would block at its end), a device or a system path is refused."""
    if value is not None and value != "-":
        from edgekit.artifact import check_output_file  # deferred: only a command given a file needs it

        check_output_file(value)
    return value


def out_option(what: str, *, default: str | None = None) -> Decorator:
    """``-o/--out FOLDER``: where the command writes ``what`` (an edgekit folder with its
    manifest). Required unless the command has a ``default`` (said in the help)."""
    suffix = f" (default {default})" if default else ""
    return click.option("-o", "--out", "out", required=default is None, type=click.Path(), default=None,
                        metavar="FOLDER", help=f"Output folder: {what}{suffix}.")


def json_option(what: str) -> Decorator:
    """``--json [FILE]``: write ``what`` as JSON to FILE, or with no FILE (or ``-``) print it on
    stdout as the only output. The command receives ``json_out``: None, ``"-"`` or the file."""
    return click.option("--json", "json_out", type=click.Path(), default=None, is_flag=False, flag_value="-",
                        metavar="[FILE]", callback=output_file,
                        help=f"Write {what} as JSON to FILE; without FILE (or with -) print it on stdout instead of "
                             "the tables.")


def target_option(*, required: bool = False, default: str | None = None, role: str = "") -> Decorator:
    """``--target NAME|FILE``: a built-in target (``edgekit targets`` lists them) or a YAML file;
    ``role`` says what the command uses it for."""
    return click.option("--target", "target", required=required, default=default, show_default=default is not None,
                        help=f"Target name or YAML file (`edgekit targets` lists them){': ' + role if role else ''}.")


TEACHER = click.option("--teacher", required=True, metavar="MODEL",
                       help="Teacher model: a zoo name, file, entry point or edgekit output folder.")

DATA = click.option("--data", "data", default=None, metavar="DATA",
                    help="Training data: a built-in name, folder, .npy/.npz, text file or entry point (default: the "
                         "model's).")
EVAL_DATA = click.option("--eval-data", "eval_data", default=None, metavar="DATA",
                         help="Validation data (default: the eval split of --data, else the model's).")
CALIB = click.option("--calib", "calib", default=None, metavar="DATA",
                     help="Calibration data: a built-in name, folder, .npy/.npz, text file or entry point (default: "
                          "the model's).")
SEED = click.option("--seed", type=int, default=0, show_default=True,
                    help="Seed of sampling, initialization and the data order.")

QUIET = click.option("-q", "--quiet", is_flag=True, help="No progress output (bars or log lines).")
VERBOSE = click.option("-v", "--verbose", is_flag=True, help="Also show library log messages.")

# --- model inputs: parsed and checked together into one ``input_options`` argument ---

INPUT_OPTIONS = {
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


def with_input_options(*which: str) -> Decorator:
    """Add the model-input options named in ``which`` to a command; the command receives them
    parsed and checked as one ``input_options`` argument (``edgekit.sources.inputs.InputOptions``
    or None)."""
    unknown = sorted(set(which) - set(INPUT_OPTIONS))
    if unknown:
        raise ValueError(f"unknown input options {unknown} (known: {', '.join(INPUT_OPTIONS)})")

    def decorate(f: Any) -> Any:
        @functools.wraps(f)
        def command(*args: Any, **kwargs: Any) -> Any:
            from edgekit.sources.inputs import input_options  # deferred: the sources import ONNX; --help must not

            opts = input_options(shapes=kwargs.pop("shapes", None), inputs=kwargs.pop("inputs_file", None),
                                 preprocess=kwargs.pop("preprocess", None))
            return f(*args, input_options=opts, **kwargs)

        for name in reversed(which):
            command = INPUT_OPTIONS[name](command)
        return command

    return decorate
