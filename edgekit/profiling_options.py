"""What ``edgekit profile`` is asked besides its timing settings: ``ProfileOptions``, whose
fields declare its flags (``edgekit.options``): whether a causal LM's generation is measured,
and the trtexec exports read in place of an engine (``profiling.profile_exports`` takes the
same values). Light (no ONNX): the command line reads it to build its options.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgekit.errors import BadInputError
from edgekit.options import option
from edgekit.schema import check_fields

TRTEXEC_USAGE = "--trtexec DIR --onnx MODEL.onnx --target TARGET"


@dataclass(frozen=True)
class ProfileOptions:
    """generation: causal LMs: also measure generation (time to first token, decode tokens/s).
    trtexec / onnx / target: a folder of trtexec exports made by hand, the ONNX file its engine was
    built from and the target the results claim; given together, they are read instead of timing
    an engine here."""

    generation: bool = field(default=True, metadata=option(
        "--generation/--no-generation",
        help="Causal LMs: also measure generation (time to first token, decode tokens/s)."))
    trtexec: str | None = field(default=None, metadata=option(
        "--trtexec", metavar="DIR",
        help="A folder of trtexec exports made by hand (--exportTimes, --exportProfile, --exportLayerInfo, log; any "
             "names): read as a device profile, checked against --onnx and --target."))
    onnx: str | None = field(default=None, metadata=option(
        "--onnx", metavar="MODEL.onnx", help="With --trtexec: the ONNX file the engine was built from."))
    target: str | None = field(default=None, metadata=option(
        "--target", help="With --trtexec: the target the results claim (name or YAML file)."))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.target is not None and self.trtexec is None and self.onnx is None:
            raise BadInputError("--target applies with --trtexec (an engine folder records its target)")
        given = {"--trtexec": self.trtexec, "--onnx": self.onnx, "--target": self.target}
        missing = [flag for flag, v in given.items() if v is None]
        if 0 < len(missing) < len(given):
            raise BadInputError(f"trtexec exports are read with {TRTEXEC_USAGE} (missing {', '.join(missing)})")

    @property
    def reads_exports(self) -> bool:
        """True when the profile is read from trtexec exports instead of timed here."""
        return self.trtexec is not None
