"""Turn ``edgekit compress`` flags into the ordered step chain.

Order: prune -> distill (recover the pruned model from its unpruned self) -> quantize
(INT8 PTQ/QAT, or weight-only GPTQ/AWQ/RTN). Only options the user set are passed on, so
each step's config keeps its own defaults.
"""
from __future__ import annotations

from typing import Any

from edgekit.errors import BadInputError

INT8_METHODS = ("ptq", "qat")
WEIGHT_ONLY_METHODS = ("gptq", "awq", "awq-gptq", "rtn")
BITS = (2, 3, 4, 8)


def plan_steps(*, bits: int | None = None, method: str | None = None, prune: float | None = None,
               distill: bool = False, int8: dict[str, Any] | None = None, int4: dict[str, Any] | None = None,
               prune_options: dict[str, Any] | None = None, distill_options: dict[str, Any] | None = None,
               ) -> list[tuple[str, dict[str, Any]]]:
    """``plan_steps(bits=4)`` -> ``[("int4", {"bits": 4, "method": "gptq"})]``."""
    steps: list[tuple[str, dict[str, Any]]] = []
    if prune is not None:
        steps.append(("prune", {"ratio": prune, **_set(prune_options)}))
    if distill:
        if prune is None:
            raise BadInputError("--distill recovers a pruned model: give --prune RATIO too "
                                "(or use `edgekit distill --teacher T --student S`)")
        steps.append(("distill", _set(distill_options)))
    if bits is None:
        if method is not None:
            raise BadInputError(f"--method {method} needs --bits (choose from {', '.join(map(str, BITS))})")
        return steps
    if bits not in BITS:
        raise BadInputError(f"unsupported bit width {bits} (choose from {', '.join(map(str, BITS))})")
    if method is None:
        method = "ptq" if bits == 8 else "gptq"
    if method in INT8_METHODS:
        if bits != 8:
            raise BadInputError(f"--method {method} quantizes weights and activations to 8 bits; got --bits {bits} "
                                f"(use --method {'|'.join(WEIGHT_ONLY_METHODS)} for {bits}-bit weights)")
        steps.append(("int8", {"method": method, **_set(int8)}))
    elif method in WEIGHT_ONLY_METHODS:
        steps.append(("int4", {"method": method, "bits": bits, **_set(int4)}))
    else:
        raise BadInputError(f"unknown method {method!r} (choose from {', '.join(INT8_METHODS + WEIGHT_ONLY_METHODS)})")
    return steps


def _set(options: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (options or {}).items() if v is not None and v != ()}
